"""``batched_statistics``: layer inputs and output gradients held, statistics formed together.

Oracles: explicit patches and ``torch.func`` per-example gradients in float64
(:func:`test_oracle_numerics.oracle_layer_factors`), and the run that forms each statistic in
its forward hook (itself checked against that oracle), equal to round-off: a group's batched
products may add in another order. Across workers, the single-process run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dkfac
import dkfac.pending_statistics as pending_module
from distributed_harness import WorkerFailedError, run_workers
from dkfac.curvature.blocks import FactorStatistic, LinearBlock
from dkfac.curvature.layer import LayerCurvature
from dkfac.pending_statistics import HeldTensorChangedError
from dkfac.strategies.d_kfac import DKFACStrategy
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.spd import SPDStrategy
from test_oracle_numerics import (
    DT,
    assert_close,
    assert_factors,
    batch_loss,
    kfac_layers,
    make_pre,
    oracle_layer_factors,
    sgd_,
)

#: Layers 2 and 4 (3x3, bias) have equal statistics, and so do 10 and 12 (1x1) and 17, 19
#: and 21 (Linear layers of 5 inputs: A does not depend on the outputs); 0 (another input
#: width), 6 (no bias) and 15 are formed alone, 8 (stride 2) in its hook.


def equal_layers_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1, bias=False),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(27, 5),
        nn.Tanh(),
        nn.Linear(5, 5),
        nn.Tanh(),
        nn.Linear(5, 5),
        nn.Tanh(),
        nn.Linear(5, 4),
    ).to(DT)


def batch(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + step)
    x = torch.randn(n, 2, 6, 6, dtype=DT, generator=generator)
    return x, torch.randint(0, 4, (n,), generator=generator)


def formed_groups(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[str]]]:
    """Records the layers of every batched statistics call (a group's), by side.

    Each held tensor is named by the layer it was held for (by storage: a fraction's part is
    a view of it), so every member of a group is recorded, not only the layer whose block
    forms it.
    """
    groups: dict[str, list[list[str]]] = {"a": [], "g": []}
    owners: dict[int, str] = {}
    hold = pending_module.PendingStatistics.hold

    def named(
        self: pending_module.PendingStatistics,
        layer: LayerCurvature,
        side: str,
        tensor: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> bool:
        owners[tensor.untyped_storage().data_ptr()] = layer.name
        return hold(self, layer, side, tensor, *args, **kwargs)

    monkeypatch.setattr(pending_module.PendingStatistics, "hold", named)

    def recorder(side: str) -> Callable[..., Any]:
        real = getattr(LayerCurvature, f"{side}_statistics")

        def recorded(self: LayerCurvature, tensors: Sequence[torch.Tensor]) -> Any:
            names = [owners[t.untyped_storage().data_ptr()] for t in tensors]
            assert names[0] == self.name  # the first member's block forms the group
            groups[side].append(names)
            return real(self, tensors)

        return recorded

    for side in groups:
        monkeypatch.setattr(LayerCurvature, f"{side}_statistics", recorder(side))
    return groups


def test_equal_layers_statistics_formed_together_are_the_float64_oracles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = equal_layers_model()
    x, t = batch(0)
    expected = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    groups = formed_groups(monkeypatch)
    pre = make_pre(model, batched_statistics=True)
    batch_loss(model(x), t).backward()
    pre.step()
    assert_factors(pre, expected)
    # One call per group, the first layer of each forming the others' statistics too; the
    # layers without an equal one alone (the stride-2 convolution's A in its hook). G: the
    # gradients of equal outputs, 6x6 and 3x3 images and 5 features, held in the backward
    # pass (the last layer's first).
    assert sorted(groups["a"]) == [
        ["0"],
        ["10", "12"],
        ["15"],
        ["17", "19", "21"],
        ["2", "4"],
        ["6"],
    ]
    assert sorted(groups["g"]) == [
        ["12", "10", "8"],
        ["19", "17", "15"],
        ["21"],
        ["6", "4", "2", "0"],
    ]


@pytest.mark.parametrize("shape", [(4, 5), (3, 2, 5)], ids=["rows", "sequences"])
def test_linear_output_gradients_formed_together_are_their_dense_grams(
    shape: tuple[int, ...],
) -> None:
    # Σ dy dyᵀ over every row of each gradient (a sequence's positions are rows of one
    # example), from one stacked product, against the float64 formula on each.
    block = LinearBlock(nn.Linear(2, 5))
    generator = torch.Generator().manual_seed(3)
    dys = [torch.randn(shape, dtype=DT, generator=generator) for _ in range(3)]
    assert len({block.g_batch_key(dy) for dy in dys}) == 1
    for dy, statistic in zip(dys, block.g_statistics(dys, DT), strict=True):
        rows = dy.reshape(-1, 5)
        torch.testing.assert_close(statistic.total, rows.t() @ rows, rtol=1e-12, atol=1e-14)
        assert (statistic.rows, statistic.examples) == (rows.shape[0], shape[0])
    assert block.g_batch_key(torch.randn(5)) is None  # an unbatched call: alone


def trained(
    model: nn.Module, options: dict[str, Any], passes: Callable[[nn.Module, int], None]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Three factor windows of ``passes`` and SGD; the factors left."""
    pre = make_pre(model, factor_decay=0.7, **options)
    for step in range(3):
        passes(model, step)
        pre.step()
        sgd_(model)
    return {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}


def one_pass(model: nn.Module, step: int) -> None:
    x, t = batch(step)
    batch_loss(model(x), t).backward()


def two_passes(model: nn.Module, step: int) -> None:  # gradient accumulation
    for part in range(2):
        x, t = batch(10 * step + part)
        (batch_loss(model(x), t) / 2).backward()


def checkpointed(model: nn.Module, step: int) -> None:
    x, t = batch(step)
    assert isinstance(model, nn.Sequential)
    head = checkpoint(model[:6], x, use_reentrant=False)
    batch_loss(model[6:](head), t).backward()


def forward_twice_then_backward(model: nn.Module, step: int) -> None:
    # Two forward passes held before one backward pass of both.
    x, t = batch(step)
    y, u = batch(100 + step)
    (batch_loss(model(x), t) + batch_loss(model(y), u)).backward()


@pytest.mark.parametrize(
    ("passes", "options"),
    [
        (one_pass, {}),
        (two_passes, {"accumulation_steps": 2}),
        (checkpointed, {}),
        (forward_twice_then_backward, {"accumulation_steps": 2}),
        (one_pass, {"statistics_fraction": 0.5}),
        (one_pass, {"inverse_method": "inverse", "kl_clip": 0.01}),
    ],
    ids=["one-pass", "accumulation", "checkpoint", "two-forwards", "fraction", "inverse"],
)
def test_batched_statistics_equal_those_formed_in_the_hooks(
    passes: Callable[[nn.Module, int], None], options: dict[str, Any]
) -> None:
    want = trained(equal_layers_model(), {**options, "batched_statistics": False}, passes)
    got = trained(equal_layers_model(), {**options, "batched_statistics": True}, passes)
    assert set(got) == set(want)
    for name, (a, g) in want.items():
        torch.testing.assert_close(got[name][0], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[name][1], g, rtol=1e-12, atol=1e-14)


def window_in_low_precision(
    batched: bool, options: dict[str, Any], autocast: bool, scaled: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One float32 factor window: two passes (under bf16 autocast, with a GradScaler) with a
    ``torch.no_grad`` pass and an eval-mode pass between forward and backward, and an
    ``torch.inference_mode`` pass after the first backward; the factors after ``step()``.

    One window, no parameter update: under autocast a round-off difference in the weights
    could round a bf16 activation the other way, which is not what is compared here.
    """
    model = equal_layers_model().float()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if scaled else None
    pre = dkfac.KFACPreconditioner(
        model,
        kl_clip=None,
        accumulation_steps=2,
        batched_statistics=batched,
        grad_scaler=scaler,
        **options,
    )
    for part in range(2):
        x, t = batch(part)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x.float())
            if autocast:
                assert out.dtype == torch.bfloat16  # the layers really ran in bf16
            loss = batch_loss(out.float(), t) / 2
        with torch.no_grad():  # ignored by K-FAC, and does not disturb what is held
            model(batch(7)[0].float())
        model.eval()
        model(batch(8)[0].float())
        model.train()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if part == 0:  # starts a pass: the held G is formed outside it, added to at step()
            with torch.inference_mode():
                model(batch(9)[0].float())
    pre.step()
    factors = {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}
    pre.remove()
    return factors


@pytest.mark.parametrize(
    ("options", "autocast", "scaled"),
    [
        ({}, True, False),
        ({}, True, True),
        ({"statistics_precision": "bf16"}, False, False),
        ({"statistics_fraction": 0.5}, False, True),
    ],
    ids=["autocast-bf16", "autocast-grad-scaler", "bf16-statistics", "fraction-grad-scaler"],
)
def test_batched_statistics_in_low_precision_equal_those_formed_in_the_hooks(
    options: dict[str, Any], autocast: bool, scaled: bool
) -> None:
    # The hooks' float32 statistics from bf16 inputs, and bf16 statistics, are checked
    # against float64 oracles in test_amp.py and test_statistics_precision.py; formed
    # together they are the same products of the same (bf16) operands, summed in float32 in
    # another order: equal to float32 round-off.
    want = window_in_low_precision(False, options, autocast, scaled)
    got = window_in_low_precision(True, options, autocast, scaled)
    assert set(got) == set(want)
    for name, (a, g) in want.items():
        assert a.dtype == g.dtype == torch.float32
        torch.testing.assert_close(got[name][0], a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
        torch.testing.assert_close(got[name][1], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()))


def test_what_passes_the_byte_budget_is_formed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A budget of one byte: each held input is formed at once, in its forward hook (outside
    # any backward pass: no autograd graph task runs), and each output gradient in its
    # backward hook, one at a time; the same factors.
    want = trained(equal_layers_model(), {"batched_statistics": False}, one_pass)
    monkeypatch.setattr(pending_module, "PENDING_BYTES", 1)
    model = equal_layers_model()
    groups = formed_groups(monkeypatch)
    formed: list[tuple[set[str], bool]] = []  # (sides formed, in a backward pass) per call
    real = pending_module.PendingStatistics.form

    def watched(
        self: pending_module.PendingStatistics, side: str | None = None
    ) -> list[tuple[LayerCurvature, str]]:
        in_backward = torch._C._current_graph_task_id() != -1
        held = real(self, side)
        formed.append(({formed_side for _, formed_side in held}, in_backward))
        return held

    monkeypatch.setattr(pending_module.PendingStatistics, "form", watched)
    got = trained(model, {"batched_statistics": True}, one_pass)
    assert all(len(group) == 1 for side in groups.values() for group in side)
    # Every input and output gradient that can be was held, and formed alone (3 windows).
    held = ["0", "10", "12", "15", "17", "19", "2", "21", "4", "6"]
    assert sorted(group[0] for group in groups["a"]) == sorted(held * 3)
    assert sorted(group[0] for group in groups["g"]) == sorted([*held, "8"] * 3)
    assert ({"a"}, False) in formed and ({"g"}, True) in formed
    assert set(map(str, formed)) == {str(({"a"}, False)), str(({"g"}, True))}
    for name, (a, g) in want.items():
        torch.testing.assert_close(got[name][0], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[name][1], g, rtol=1e-12, atol=1e-14)


def test_the_budget_counts_what_a_held_part_keeps_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fraction's part of an output gradient is a view: holding it keeps the whole gradient,
    # which autograd would have freed, so the budget counts the whole storage.
    layer = make_pre(nn.Sequential(nn.Linear(3, 4)).to(DT)).layers[0]
    grad = torch.randn(100, 4, dtype=DT)
    monkeypatch.setattr(pending_module, "PENDING_BYTES", grad.numel() * 8)
    pending = pending_module.PendingStatistics()
    assert pending.hold(layer, "g", grad, 1, examples=100, kept=10)
    assert pending.over_budget()  # 10 rows' bytes alone would be a tenth of the budget


def test_an_input_changed_in_place_before_it_is_formed_is_refused_at_step() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(DT)
    pre = make_pre(model, batched_statistics=True)
    x = torch.randn(4, 3, dtype=DT)
    with torch.no_grad():
        model[0].weight.requires_grad_(False)
    out = model(x)
    x.add_(1.0)  # the first layer's input, held, not needed by autograd (no weight grad)
    out.sum().backward()  # left out in the backward pass, never raised from a hook
    with pytest.raises(HeldTensorChangedError, match=r"layer '0': its input was changed in"):
        pre.step()
    pre.step()  # raised once: the window's other statistics fold
    assert pre.health().refused_statistics == 1
    pre.remove()


def test_a_refusal_goes_with_its_window_when_a_state_is_loaded() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(DT)
    pre = make_pre(model, batched_statistics=True)
    state = pre.state_dict()
    with torch.no_grad():
        model[0].weight.requires_grad_(False)
    x = torch.randn(4, 3, dtype=DT)
    out = model(x)
    x.add_(1.0)
    out.sum().backward()  # refused in the backward pass, not raised yet
    pre.load_state_dict(state)  # the window (and what its refusal said was kept) is dropped
    model.zero_grad(set_to_none=True)
    x = torch.randn(4, 3, dtype=DT)
    model(x).sum().backward()
    pre.step()  # no stale refusal
    h = model[0](x).detach()
    rows = torch.cat([h, torch.ones(4, 1, dtype=DT)], dim=1)
    assert_close(pre.layers[1].a, rows.t() @ rows / 4, what="the new window's A")  # type: ignore[arg-type]
    pre.remove()


def test_an_output_gradient_changed_in_place_is_refused_at_the_next_pass() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).to(DT)
    pre = make_pre(model, batched_statistics=True, accumulation_steps=2)
    hidden = model[0](torch.randn(4, 3, dtype=DT))
    # A hook registered after dkfac's (which holds the gradient) changes it in place.
    hidden.register_hook(lambda grad: grad.mul_(0.5))
    model[2](model[1](hidden)).sum().backward()
    refusal = r"layer '0': its output gradient was changed in place"
    with pytest.raises(HeldTensorChangedError, match=refusal):
        model(torch.randn(4, 3, dtype=DT))  # formed when the next pass begins
    model(torch.randn(4, 3, dtype=DT)).sum().backward()
    pre.step()
    pre.remove()


def refusal_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def refusal_windows(accumulation: int) -> list[list[int]]:
    """The batches of each factor window; the second window's first is refused."""
    return [[0], [1], [2]] if accumulation == 1 else [[0, 1], [2, 3], [4, 5]]


def refusal_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    xs = torch.randn(6, 4, 3, dtype=DT, generator=generator)
    return [(x, torch.randint(0, 2, (4,), generator=generator)) for x in xs]


def run_with_a_refused_statistic(
    net: nn.Module, pre: dkfac.KFACPreconditioner, rows: slice, side: str, accumulation: int
) -> list[torch.Tensor]:
    """The windows of :func:`refusal_windows` (``rows`` of each batch, each loss divided by
    the window's passes), parameters unchanged. The refused batch changes layer 1's input
    (``side`` "a") or output gradient ("g") in place (its version only: the values stay);
    the error comes at the next pass (repeated) or, with one pass a window, at ``step()``
    (called again).

    Returns:
        Every factor this worker holds after the second window's step, then the third's.
    """
    model = net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net
    # Layer 1's weight then gets no gradient (frozen once K-FAC has the layer): autograd
    # keeps no copy of its input, which a pass may then change in place.
    model[1].weight.requires_grad_(False)

    def bump(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if side == "a":
            args[0].mul_(1.0)  # after dkfac's forward hook held it
        else:
            out.register_hook(lambda grad: grad.mul_(1.0))  # after dkfac's gradient hook

    windows, batches = refusal_windows(accumulation), refusal_batches()
    refused, refusal = windows[1][0], HeldTensorChangedError
    got: list[torch.Tensor] = []
    for window in windows:
        net.zero_grad(set_to_none=True)
        for index in window:
            x, t = batches[index]
            if accumulation > 1 and index == refused + 1:
                with pytest.raises(refusal, match="layer '1'"):
                    net(x[rows])
            handle = model[1].register_forward_hook(bump) if index == refused else None
            (batch_loss(net(x[rows]), t[rows]) / len(window)).backward()
            if handle is not None:
                handle.remove()
        if refused in window and accumulation == 1:
            with pytest.raises(refusal, match="layer '1'"):
                pre.step()
        pre.step()
        # A pipelined strategy learns the window's shape: a lost statistic still counts.
        assert set(getattr(pre._strategy, "expected_updates", [accumulation])) == {accumulation}
        if window is not windows[0]:
            got += [f for pair in pre.factors().values() for f in pair]
    assert pre.health().refused_statistics == (1 if pre._strategy.captures(pre.layers[1]) else 0)
    return got


def refused_statistic_oracle(side: str, accumulation: int) -> list[torch.Tensor]:
    """:func:`run_with_a_refused_statistic`'s factors from the float64 oracle: running
    averages of decay 1/2 of each window's mean, the refused factor's of its other batches
    (none with one pass a window: it keeps its average)."""
    model, batches = refusal_model(), refusal_batches()
    batch = [
        {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
        for x, t in batches
    ]
    windows = refusal_windows(accumulation)
    refused = windows[1][0]

    def mean(name: str, position: int, indices: list[int]) -> torch.Tensor:
        return sum(batch[b][name][position] for b in indices) / len(indices)

    running = {name: (mean(name, 0, windows[0]), mean(name, 1, windows[0])) for name in batch[0]}
    want: list[torch.Tensor] = []
    for window in windows[1:]:
        new = {}
        for name, pair in running.items():
            sides = []
            for position, old in enumerate(pair):
                used = window
                if (name, "ag"[position]) == ("1", side):
                    used = [b for b in window if b != refused]
                sides.append(0.5 * old + 0.5 * mean(name, position, used) if used else old)
            new[name] = (sides[0], sides[1])
        running = new
        want += [f for pair in running.values() for f in pair]
    return want


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("side", ["a", "g"])
def test_a_refused_statistic_is_left_out_and_the_rest_of_its_window_kept(
    side: str, accumulation: int
) -> None:
    """The refusal raises once, and the window then folds what it has: every factor is the
    float64 oracle's, layer 1's refused side from the window's other pass (its ``G`` still
    scaled by all the window's examples, which each gradient was divided by), or unchanged
    with one pass a window. Before, the held tensors stayed held and every later pass or
    step() raised the same error."""
    model = refusal_model()
    options = {} if accumulation == 1 else {"accumulation_steps": accumulation}
    pre = make_pre(model, batched_statistics=True, factor_decay=0.5, **options)
    got = run_with_a_refused_statistic(model, pre, slice(0, 4), side, accumulation)
    want = refused_statistic_oracle(side, accumulation)
    assert len(got) == len(want) == 12 and got[3].shape == (4, 4)  # layer 1's G
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    pre.remove()


def change_an_input_in_place(rank: int, world_size: int) -> None:
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4))).to(DT)
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = make_pre(ddp, strategy="dp", batched_statistics=True)
    # DP-KFAC: each worker captures half of the layers, layer 1 on rank 1 alone.
    assert [layer.name for layer in pre.layers if pre._strategy.captures(layer)] == (
        ["0", "2"] if rank == 0 else ["1", "3"]
    )
    with torch.no_grad():
        model[1].weight.requires_grad_(False)  # autograd then keeps no copy of its input
    x = torch.randn(4, 3, dtype=DT)
    hidden = model[0](x)
    out = model[3](model[2](model[1](hidden)))
    hidden.add_(1.0)  # layer 1's input
    out.sum().backward()
    pre.step()


def assert_refused_on_both_workers(worker: Callable[[int, int], None], refusal: str) -> None:
    """``worker`` on two processes fails with ``refusal`` on each of them."""
    with pytest.raises(WorkerFailedError) as failed:
        run_workers(worker, 2, ())
    for rank in (0, 1):
        assert re.search(rf"--- rank {rank}: {refusal}", str(failed.value)), str(failed.value)


def test_an_input_changed_in_place_is_refused_on_every_worker() -> None:
    # Rank 0 does not capture layer 1 but watches its input: both refuse (in the backward
    # pass, raised at step()), instead of rank 0 going on alone into a collective.
    refusal = r"HeldTensorChangedError: layer '1': its input was changed in place"
    assert_refused_on_both_workers(change_an_input_in_place, refusal)


def change_an_output_gradient_in_place(rank: int, world_size: int) -> None:
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4))).to(DT)
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = make_pre(ddp, strategy="dp", batched_statistics=True)
    x = torch.randn(4, 3, dtype=DT)
    hidden = model[1](model[0](x))
    # A hook registered after dkfac's (which holds the gradient on rank 1, the owner of
    # layer 1, and watches it on rank 0) changes layer 1's output gradient in place.
    hidden.register_hook(lambda grad: grad.mul_(0.5))
    model[3](model[2](hidden)).sum().backward()
    pre.step()


def test_an_output_gradient_changed_in_place_is_refused_on_every_worker() -> None:
    # Before rank 0 watched the gradients of layers it does not capture, rank 1 alone
    # refused and rank 0 waited for its preconditioned gradients ("Connection closed").
    refusal = r"HeldTensorChangedError: layer '1': its output gradient was changed in place"
    assert_refused_on_both_workers(change_an_output_gradient_in_place, refusal)


def change_a_recomputed_output_gradient_in_place(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4))).to(DT)
    pre = make_pre(model, strategy="dp", batched_statistics=True)

    def segment(hidden: torch.Tensor) -> torch.Tensor:
        out = model[1](hidden)
        if out.requires_grad:  # the recomputation in the backward pass only
            out.register_hook(lambda grad: grad.mul_(0.5))
        return model[2](out)

    x = torch.randn(4, 3, dtype=DT)
    hidden = checkpoint(segment, model[0](x), use_reentrant=True)
    model[3](hidden).sum().backward()
    pre.step()


def test_a_recomputed_output_gradient_changed_in_place_is_refused_on_every_worker() -> None:
    # Reentrant checkpointing recomputes layer 1 in the backward pass, where its input is
    # formed at once; its output gradient is held by its owner (rank 1) and watched by rank 0.
    refusal = r"HeldTensorChangedError: layer '1': its output gradient was changed in place"
    assert_refused_on_both_workers(change_a_recomputed_output_gradient_in_place, refusal)


class BumpInBackward(torch.autograd.Function):
    """The identity on ``x`` whose backward adds one to ``victim`` in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, victim: torch.Tensor) -> torch.Tensor:
        ctx.victim = victim
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.victim.add_(1.0)
        return grad, None


def input_bumped_in_backward(rank: int, world_size: int) -> torch.Tensor | None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4))).to(DT)
    pre = make_pre(model, strategy="dp", batched_statistics=True)
    with torch.no_grad():
        model[1].weight.requires_grad_(False)  # autograd then keeps no copy of its input
    x = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    hidden = model[0](x)
    # Backward: layer 3's output gradient (each worker's first gradient hook), then the
    # bump of layer 1's input, then layer 2's output gradient (rank 0's first own layer).
    out = model[3](BumpInBackward.apply(model[2](model[1](hidden)), hidden))
    out.sum().backward()
    pre.step()
    return pre.factors()["1"][0] if "1" in pre.factors() else None


def test_an_input_changed_in_place_late_in_the_backward_pass_is_formed_alike_everywhere() -> None:
    """Every worker forms its held inputs at the backward pass's first gradient hook, its own
    layer's or a watched one's: the input of layer 1 is formed before the bump on both
    (before, rank 0 formed at its own layer 2's hook, after the bump, and refused alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4))).to(DT)
    x = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rows = torch.cat([model[0](x), torch.ones(4, 1, dtype=DT)], dim=1)
    got = run_workers(input_bumped_in_backward, 2, ())
    assert got[0] is None  # DP-KFAC: layer 1's factors are rank 1's alone
    torch.testing.assert_close(got[1], rows.t() @ rows / 4, rtol=1e-12, atol=1e-14)


def test_batched_statistics_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match="batched_statistics"):
        dkfac.KFACPreconditioner(equal_layers_model(), batched_statistics="yes")  # type: ignore[arg-type]


def worker_run(rank: int, world_size: int, options: dict[str, Any]) -> list[torch.Tensor]:
    ddp = nn.parallel.DistributedDataParallel(equal_layers_model())
    local = 4 // world_size
    pre = make_pre(ddp, batched_statistics=True, check_replicas_every=1, **options)
    for step in range(3):
        x, t = batch(step)
        batch_loss(
            ddp(x[rank * local : (rank + 1) * local]), t[rank * local : (rank + 1) * local]
        ).backward()
        pre.step()
        sgd_(ddp)
    pre.remove()
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.parametrize(
    "options",
    [{"strategy": "dkfac"}, {"strategy": "spd", "inverse_method": "inverse"}],
)
def test_two_workers_with_batched_statistics_equal_the_single_process_run(
    options: dict[str, Any],
) -> None:
    """SPD hands factors to its pipeline as their statistics come in: here all of ``A``'s
    when the backward pass begins, in the order they were held, on every worker."""
    model = equal_layers_model()
    pre = make_pre(model, **{k: v for k, v in options.items() if k != "strategy"})
    for step in range(3):
        one_pass(model, step)
        pre.step()
        sgd_(model)
    want = [p.detach().clone() for p in model.parameters()]
    ranks = run_workers(worker_run, 2, (options,))
    for got in ranks:
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def refused_statistic_worker(
    rank: int, world_size: int, strategy: str, side: str, accumulation: int
) -> list[torch.Tensor]:
    # Unused parameters found: layer 1's weight is frozen after DDP was made.
    ddp = nn.parallel.DistributedDataParallel(refusal_model(), find_unused_parameters=True)
    options: dict[str, Any] = {"inverse_method": "inverse"} if strategy == "spd" else {}
    if accumulation > 1:
        options["accumulation_steps"] = accumulation
    pre = make_pre(ddp, strategy=strategy, batched_statistics=True, factor_decay=0.5, **options)
    rows = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
    return run_with_a_refused_statistic(ddp, pre, rows, side, accumulation)


@pytest.mark.parametrize(
    ("strategy", "side", "accumulation"),
    [("dkfac", "a", 1), ("dkfac", "g", 1), ("spd", "a", 1), ("spd", "g", 2)],
)
def test_two_workers_leave_a_refused_statistic_out_alike(
    strategy: str, side: str, accumulation: int
) -> None:
    """Both workers refuse at the same point and go on (D-KFAC exchanges at ``step()``, SPD
    from its hooks, with a late ``G`` under accumulation): their factors of the whole batch
    are the float64 oracle's."""
    want = refused_statistic_oracle(side, accumulation)
    for got in run_workers(refused_statistic_worker, 2, (strategy, side, accumulation)):
        assert len(got) == len(want)
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def refused_on_one_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank 0 takes 3 rows, rank 1 one: with a 60-byte budget rank 0 forms layer 0's input
    (72 bytes) in its hook, before a later hook changes it in place; rank 1 still holds it
    (24 bytes) and refuses. Rank 1 alone raises at step() and repeats it."""
    pending_module.PENDING_BYTES = 60
    # Unused parameters found: layer 0's weight is frozen after DDP was made.
    ddp = nn.parallel.DistributedDataParallel(refusal_model(), find_unused_parameters=True)
    pre = make_pre(ddp, strategy="dkfac", batched_statistics=True, factor_decay=0.5)
    model = ddp.module
    model[0].weight.requires_grad_(False)  # autograd keeps no copy of its input
    rows = slice(0, 3) if rank == 0 else slice(3, 4)
    raised = False

    def bump(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        args[0].mul_(1.0)  # its version only: the values stay

    for index, (x, t) in enumerate(refusal_batches()[:2]):
        x = x[rows].clone()
        handle = None
        if index == 1:
            handle = model[0].register_forward_hook(bump)
        ddp.zero_grad(set_to_none=True)
        batch_loss(ddp(x), t[rows]).backward()
        if handle is not None:
            handle.remove()
        try:
            pre.step()
        except HeldTensorChangedError:
            raised = True
            pre.step()
    assert raised == (rank == 1) and pre.health().refused_statistics == rank
    return [f for pair in pre.factors().values() for f in pair]


def test_a_statistic_refused_on_one_worker_leaves_the_replicas_equal() -> None:
    """Only rank 1 refuses layer 0's input: D-KFAC's window ``A`` of layer 0 is rank 0's rows
    alone, every other factor the whole batch's, on both ranks (the float64 oracle)."""
    model, batches = refusal_model(), refusal_batches()
    oracle = [
        {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
        for x, t in batches[:2]
    ]
    (x, t) = batches[1]
    a0 = oracle_layer_factors(model, 0, x[:3], t[:3])[0]
    want = []
    for name in oracle[0]:
        for position in (0, 1):
            new = a0 if (name, position) == ("0", 0) else oracle[1][name][position]
            want.append(0.5 * oracle[0][name][position] + 0.5 * new)
    for got in run_workers(refused_on_one_worker, 2, ()):
        assert len(got) == len(want)
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_statistics_are_batched_by_default_on_a_gpu_unless_the_hooks_start_sends() -> None:
    # SPD and PAD hand factors to their pipeline from the hooks: forming A when the backward
    # pass begins would start their sends later, so their default keeps the hooks' timing.
    assert SPDStrategy.starts_work_from_hooks and PADStrategy.starts_work_from_hooks
    assert not DKFACStrategy.starts_work_from_hooks
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    default = dkfac.KFACConfig()
    assert default.batching(gpu).statistics and not default.batching(cpu).statistics
    assert not default.batching(gpu, hooks_start_work=True).statistics
    forced = dkfac.KFACConfig(batched_statistics=True)
    assert forced.batching(cpu, hooks_start_work=True).statistics


class _Doubled(LinearBlock):
    """A user's block whose ``A`` and ``G`` are not a Linear layer's: twice them."""

    def a_statistic(self, x: torch.Tensor, dtype: torch.dtype) -> FactorStatistic:
        statistic = super().a_statistic(x, dtype)
        return statistic._replace(total=2 * statistic.total)

    def g_statistic(self, dy: torch.Tensor, dtype: torch.dtype) -> FactorStatistic:
        statistic = super().g_statistic(dy, dtype)
        return statistic._replace(total=2 * statistic.total)


class _Custom(nn.Linear):
    pass


def test_blocks_with_statistics_of_their_own_are_not_batched_as_their_base() -> None:
    # An embedding (a TransposedLinearBlock with its own A) and a user's LinearBlock subclass
    # beside Linear layers of the same input width (A) and output width (G); a forward pass
    # with no backward and one under torch.inference_mode in between (the held inputs are
    # formed there, outside it).
    def factors(batched: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 4), _Custom(4, 4), nn.Linear(4, 3)
        ).to(DT)
        pre = make_pre(model, blocks={_Custom: _Doubled}, batched_statistics=batched)
        x = torch.randint(0, 11, (5, 3))
        model(x)  # not backpropagated
        with torch.inference_mode():
            model(x)
        model(x).sum().backward()
        pre.step()
        return {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}

    want, got = factors(False), factors(True)
    assert set(got) == set(want) == {"0", "2", "3", "4"}
    for name, (a, g) in want.items():
        torch.testing.assert_close(got[name][0], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[name][1], g, rtol=1e-12, atol=1e-14)
