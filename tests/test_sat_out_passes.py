"""Layers that sit out some micro-batches of an accumulated window (docs/math.md).

A task's head that runs in some micro-batches only still has its gradients divided by every
micro-batch's examples. Its ``G`` must be the average of per-example ``g gᵀ`` over the examples
it saw, ``g`` the gradient of each example's own loss (as when a worker of several has no
gradient for it), not that times ``(seen/all)²``. Checked against a float64 oracle written
here (one example at a time, with autograd): equal and uneven micro-batches, a head on
flattened ``(N·T, d)`` rows (its examples are tokens), a model whose batch size cannot be read
from its arguments (warned, exact for equal micro-batches), passes no backward reaches (not
micro-batches), a model called once per tower for one loss (one micro-batch), checkpointed and
compiled models, and every strategy at P = 3 against the oracle on the union of the workers'
batches (DP-KFAC on the owner's shard, whose owner may capture one head alone).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dkfac
from distributed_harness import run_workers
from dkfac.autograd_engine import LayerGradients, current_backward_id
from dkfac.window_passes import WindowPasses
from test_oracle_numerics import assert_close
from test_shared_layers import F64, held_factors, strategy_options

DT = torch.float64
#: A window: per micro-batch, (its examples, the task whose head runs).
Window = list[tuple[int, str]]


class TaskHeads(nn.Module):
    """A shared body and one head per task; a micro-batch runs the head of its task.

    ``tokens`` > 0: inputs ``(N, T, 12)`` and heads on the flattened ``(N·T, 6)`` rows.
    """

    def __init__(self, tokens: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = tokens
        self.body = nn.Linear(12, 6)
        self.head_a = nn.Linear(6, 4)
        self.head_b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        h = torch.tanh(self.body(x)).reshape(-1, 6)
        return (self.head_a if task == "a" else self.head_b)(h)


class Batch:
    """A model input with no tensor the batch size could be read from (not a dataclass)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class UnsizedTaskHeads(TaskHeads):
    def forward(self, batch: Batch, task: str) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch.x, task)


@dataclass
class Prediction:
    """A model output that is a dataclass (DDP searches those too), with a parameter in it."""

    logits: torch.Tensor
    temperature: torch.Tensor


class PredictingTaskHeads(TaskHeads):
    """``TaskHeads`` returning a :class:`Prediction` that holds a parameter as is (as open_clip
    returns ``logit_bias``): the loss is made from its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, task: str) -> Prediction:  # type: ignore[override]
        return Prediction(super().forward(x, task), self.temperature)


def micro_batch(seed: int, examples: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (examples, tokens, 12) if tokens else (examples, 12)
    x = torch.randn(*shape, generator=g, dtype=DT)
    return x, torch.randint(0, 4, (examples * max(tokens, 1),), generator=g)


def batches(window: Window, tokens: int, seed: int = 0) -> list[tuple[Any, ...]]:
    return [
        (*micro_batch(100 * seed + i, examples, tokens), task)
        for i, (examples, task) in enumerate(window)
    ]


def rows(inputs: torch.Tensor) -> torch.Tensor:
    flat = inputs.reshape(-1, inputs.shape[-1])
    return torch.cat([flat, torch.ones(flat.shape[0], 1, dtype=DT)], dim=1)


def oracle(
    model: TaskHeads,
    micro_batches: list[tuple[Any, ...]],
    forward_only: list[tuple[Any, ...]] = (),  # type: ignore[assignment]
) -> dict[str, torch.Tensor]:
    """Every layer's A and G, one example at a time.

    An example is a sequence for ``body`` (its loss: the mean over its tokens, ``T`` rows per
    example) and a row for the heads (a token's own loss; one row per example).
    ``A = Σ ā āᵀ / rows``, ``G = Σ g gᵀ / (the layer's examples)`` over the examples it saw.
    ``forward_only``: training forward passes no backward reached (their rows are in ``A``).
    """
    a_rows: dict[str, list[torch.Tensor]] = {"body": [], "head_a": [], "head_b": []}
    g_rows: dict[str, list[torch.Tensor]] = {name: [] for name in a_rows}
    examples = dict.fromkeys(a_rows, 0)
    tokens = max(model.tokens, 1)
    for x, _, task in forward_only:
        a_rows["body"].append(rows(x))
        a_rows[f"head_{task}"].append(rows(torch.tanh(model.body(x)).reshape(-1, 6).detach()))
    for x, y, task in micro_batches:
        head = f"head_{task}"
        for n in range(x.shape[0]):
            body_in = x[n : n + 1]
            body_out = model.body(body_in)
            body_out.retain_grad()
            head_in = torch.tanh(body_out).reshape(-1, 6)
            head_out = model.get_submodule(head)(head_in)
            head_out.retain_grad()
            targets = y[n * tokens : (n + 1) * tokens]
            F.cross_entropy(head_out, targets).backward()  # the sequence's mean over tokens
            assert body_out.grad is not None and head_out.grad is not None
            a_rows["body"].append(rows(body_in))
            g_rows["body"].append(body_out.grad.reshape(-1, 6))
            a_rows[head].append(rows(head_in.detach()))
            g_rows[head].append(head_out.grad * tokens)  # each token's own loss
            examples["body"] += 1
            examples[head] += tokens
    factors = {}
    for name in a_rows:
        if not a_rows[name]:
            continue
        a, g = torch.cat(a_rows[name]), torch.cat(g_rows[name])
        factors[f"{name}/a"] = a.t() @ a / a.shape[0]
        factors[f"{name}/g"] = g.t() @ g / examples[name]
    return factors


def train_window(
    model: nn.Module, pre: dkfac.KFACPreconditioner, micro_batches: list[tuple[Any, ...]]
) -> None:
    """One window: every micro-batch's summed loss over the window's examples, then step()."""
    total = sum(y.numel() for _, y, _ in micro_batches)
    model.zero_grad(set_to_none=True)
    for x, y, task in micro_batches:
        inputs = Batch(x) if isinstance(model, UnsizedTaskHeads) else x
        output = model(inputs, task=task)
        logits = output.logits if isinstance(output, Prediction) else output
        (F.cross_entropy(logits, y, reduction="sum") / total).backward()
    pre.step()


def factors_of(pre: dkfac.KFACPreconditioner) -> dict[str, torch.Tensor]:
    return {
        f"{name}/{side}": factor
        for name, (a, g) in pre.factors().items()
        for side, factor in (("a", a), ("g", g))
    }


def assert_factors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, factor in want.items():
        assert_close(got[key], factor, what=key)


@pytest.mark.parametrize(
    ("window", "tokens"),
    [
        ([(3, "a"), (3, "b"), (3, "a")], 0),  # head_a sits out one of three, head_b two
        ([(3, "a"), (2, "b"), (4, "a")], 0),  # uneven: the passes sat out count their own size
        ([(2, "b"), (3, "a"), (1, "b")], 3),  # heads on (N*T, 6) rows: T examples per sequence
    ],
)
@pytest.mark.parametrize("batched", [False, True])  # statistics formed in the hooks or held
def test_a_head_that_sits_out_micro_batches_averages_g_over_its_own_examples(
    window: Window, tokens: int, batched: bool
) -> None:
    model = TaskHeads(tokens).double()
    pre = dkfac.KFACPreconditioner(
        model, accumulation_steps=len(window), batched_statistics=batched, **F64
    )
    micro_batches = batches(window, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every count is exact: nothing to warn about
        train_window(model, pre, micro_batches)
    assert_factors_equal(factors_of(pre), oracle(model, micro_batches))


def test_without_a_batch_size_a_sat_out_pass_counts_the_layers_mean_and_says_so() -> None:
    model = UnsizedTaskHeads().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=3, **F64)
    micro_batches = batches([(3, "a"), (3, "b"), (3, "a")], 0)
    with pytest.warns(RuntimeWarning, match="sat out micro-batches") as caught:
        train_window(model, pre, micro_batches)
    named = {name for w in caught for name in ("'head_a'", "'head_b'") if name in str(w.message)}
    assert named == {"'head_a'", "'head_b'"}
    assert_factors_equal(factors_of(pre), oracle(model, micro_batches))  # equal micro-batches


def test_passes_no_backward_reaches_are_not_micro_batches() -> None:
    model = TaskHeads().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=3, **F64)
    micro_batches = batches([(3, "a"), (3, "b"), (3, "a")], 0)
    extra = batches([(2, "b")], 0, seed=7)
    total = sum(y.numel() for _, y, _ in micro_batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a mismatch with accumulation_steps
        for i, (x, y, task) in enumerate(micro_batches):
            (F.cross_entropy(model(x, task=task), y, reduction="sum") / total).backward()
            if i == 0:
                model(extra[0][0], task="b")  # features for a log: never backpropagated
                with torch.no_grad():
                    model(x, task="b")
                model.eval()
                model(x, task="b").sum().backward()  # an evaluation pass, even backpropagated
                model.train()
        pre.step()
    # The logged pass added head_b's and body's rows to A; the others added nothing.
    assert_factors_equal(factors_of(pre), oracle(model, micro_batches, forward_only=extra))


def test_an_output_that_is_a_parameter_gets_no_hook_and_windows_stay_apart() -> None:
    model = PredictingTaskHeads().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=3, factor_decay=0.0, **F64)
    micro_batches = batches([(3, "a"), (2, "b"), (4, "a")], 0)
    want = oracle(copy.deepcopy(model), micro_batches)  # a copy: its calls are not captured
    for _ in range(3):  # a hook left on the parameter would bind the next window's passes
        train_window(model, pre, micro_batches)
        assert not model.temperature._backward_hooks
        assert_factors_equal(factors_of(pre), want)


def test_an_output_kept_from_an_earlier_window_binds_no_pass_of_this_one() -> None:
    weight = torch.ones(3, requires_grad=True)
    passes = WindowPasses(LayerGradients())
    passes.started(1, 3)
    kept = weight * 2.0
    passes.watch_outputs(1, {"kept": [kept]})
    passes.clear()  # the window ended before its backward; pass numbers start again
    passes.started(1, 3)
    kept.sum().backward()  # the earlier window's pass 1: binds nothing now
    fresh = weight * 3.0
    passes.watch_outputs(1, (fresh,))
    calls: list[int | None] = []
    fresh.register_hook(lambda grad: calls.append(current_backward_id()))  # type: ignore[no-untyped-call]
    fresh.sum().backward()
    assert calls[0] is not None and passes._backward == {1: calls[0]}


@dataclass
class Looped:
    """An output that refers to itself."""

    logits: torch.Tensor
    again: Any = None


def test_the_output_search_ends_on_a_cycle_or_a_long_list() -> None:
    weight = torch.ones(3, requires_grad=True)
    passes = WindowPasses(LayerGradients())
    passes.started(1, 3)
    looped = Looped(weight * 2.0)
    looped.again = [looped, list(range(100_000))]
    passes.watch_outputs(1, looped)  # returns
    looped.logits.sum().backward()
    assert list(passes._backward) == [1]


def test_attached_to_an_optimizer_without_accumulation_steps_nothing_is_counted() -> None:
    # Two losses a step, each its own mean (a labelled and an unlabelled batch): not
    # micro-batches of one mean, so each head's G stays the average over its own examples.
    model = TaskHeads().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pre = dkfac.KFACPreconditioner(model, optimizer=opt, **F64)
    micro_batches = batches([(4, "a"), (6, "b")], 0)
    for x, y, task in micro_batches:
        F.cross_entropy(model(x, task=task), y).backward()
    opt.step()
    want = oracle(model, micro_batches)
    got = factors_of(pre)
    for key in ("head_a/a", "head_a/g", "head_b/a", "head_b/g"):
        assert_close(got[key], want[key], what=key)
    pre.remove()


def test_a_gradient_call_on_an_output_joins_the_backward_call_of_its_loss() -> None:
    model = DualTower().double()
    pre = dkfac.KFACPreconditioner(model, **F64)  # accumulation_steps 1
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, generator=g, dtype=DT, requires_grad=True)
    t = torch.randn(4, 4, generator=g, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one backward call: no mismatch warned
        zi, zt = model(x, "img"), model(t, "txt")
        (penalty,) = torch.autograd.grad(zi.sum(), x, create_graph=True)  # reaches img first
        (((zi - zt) ** 2).sum(1).mean() + 0.0 * penalty.pow(2).sum()).backward()
        pre.step()
    pre.remove()


class DualTower(nn.Module):
    """A dual encoder: one call encodes images, another texts, for one paired loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.img = nn.Linear(5, 3)
        self.txt = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, tower: str) -> torch.Tensor:
        return self.img(x) if tower == "img" else self.txt(x)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_model_called_once_per_tower_for_one_loss_is_one_micro_batch(accumulation: int) -> None:
    model = DualTower().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=accumulation, **F64)
    g = torch.Generator().manual_seed(3)
    pairs = [
        (torch.randn(4, 5, generator=g, dtype=DT), torch.randn(4, 4, generator=g, dtype=DT))
        for _ in range(accumulation)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a mismatch with accumulation_steps
        for x, t in pairs:
            loss = ((model(x, "img") - model(t, "txt")) ** 2).sum(1).mean() / accumulation
            loss.backward()
        pre.step()
    # Oracle: each pair's own loss |img(x_n) - txt(t_n)|², one pair at a time.
    grads: dict[str, list[torch.Tensor]] = {"img": [], "txt": []}
    inputs: dict[str, list[torch.Tensor]] = {"img": [], "txt": []}
    for x, t in pairs:
        for n in range(x.shape[0]):
            zi, zt = model(x[n : n + 1], "img"), model(t[n : n + 1], "txt")
            gi, gt = torch.autograd.grad(((zi - zt) ** 2).sum(), (zi, zt))
            grads["img"].append(gi)
            grads["txt"].append(gt)
            inputs["img"].append(rows(x[n : n + 1]))
            inputs["txt"].append(rows(t[n : n + 1]))
    want = {}
    for name in grads:
        a, gr = torch.cat(inputs[name]), torch.cat(grads[name])
        want[f"{name}/a"], want[f"{name}/g"] = a.t() @ a / a.shape[0], gr.t() @ gr / gr.shape[0]
    assert_factors_equal(factors_of(pre), want)


class CheckpointedTaskHeads(TaskHeads):
    """``TaskHeads`` recomputed in backward: the whole model one checkpointed segment."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        run = super().forward
        return checkpoint(run, x, task, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recomputed_head_that_sits_out_micro_batches_is_counted_alike(reentrant: bool) -> None:
    model = CheckpointedTaskHeads(reentrant).double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=3, **F64)
    micro_batches = batches([(3, "a"), (2, "b"), (4, "a")], 0)
    # Reentrant checkpointing reaches the segment only from an input that requires grad.
    inputs = [(x.requires_grad_(reentrant), y, task) for x, y, task in micro_batches]
    train_window(model, pre, inputs)
    want = oracle(model, [(x.detach(), y, task) for x, y, task in inputs])
    assert_factors_equal(factors_of(pre), want)


def test_a_compiled_model_counts_sat_out_micro_batches_when_there_are_as_many_as_configured() -> (
    None
):
    torch._dynamo.reset()
    model = TaskHeads().double()
    compiled = torch.compile(model, backend="aot_eager")
    pre = dkfac.KFACPreconditioner(compiled, accumulation_steps=3, **F64)
    micro_batches = batches([(3, "a"), (2, "b"), (4, "a")], 0)
    train_window(compiled, pre, micro_batches)  # type: ignore[arg-type]
    assert_factors_equal(factors_of(pre), oracle(model, micro_batches))


#: Per rank: its window (each rank's loss is the mean over its own examples, as under DDP).
#: At P = 3 DP-KFAC gives each layer its own owner: a head's owner captures nothing else.
RANK_WINDOWS: list[Window] = [
    [(3, "a"), (3, "b"), (3, "a")],
    [(2, "b"), (3, "b"), (4, "a")],
    [(3, "a"), (1, "a"), (2, "b")],
]
STRATEGIES = ["dkfac", "kaisa", "spd", "pad", "dp"]


def sat_out_run(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    micro_batches = batches(RANK_WINDOWS[rank], 0, seed=rank + 1)
    for strategy in STRATEGIES:
        # A dataclass output: a head's owner (DP-KFAC) learns the micro-batches from it.
        model = PredictingTaskHeads().double()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        options = strategy_options(strategy, world_size)
        pre = dkfac.KFACPreconditioner(
            ddp, strategy=strategy, accumulation_steps=3, **options, **F64
        )
        # The same window twice, parameters unchanged: the running factor is the window's;
        # the second window's pipelined strategies hand G over from the hooks (the learned
        # window shape) and correct its scale at step().
        for _ in range(2):
            train_window(ddp, pre, micro_batches)
        out[strategy] = held_factors(pre)
        pre.remove()
    return out


def test_every_strategy_pools_sat_out_heads_like_the_oracle_on_the_union() -> None:
    results = run_workers(sat_out_run, 3, timeout=180)
    model = TaskHeads().double()
    per_rank = [batches(window, 0, seed=rank + 1) for rank, window in enumerate(RANK_WINDOWS)]
    union = oracle(model, [mb for micro_batches in per_rank for mb in micro_batches])
    for strategy in STRATEGIES:
        held: set[str] = set()
        for rank in range(3):
            # DP-KFAC's owners compute each factor from their own shard alone.
            want = oracle(model, per_rank[rank]) if strategy == "dp" else union
            for key, factor in results[rank][strategy].items():
                assert_close(factor, want[key], what=f"{strategy} rank {rank} {key}")
                held.add(key)
        assert held == set(union), strategy
