"""Equal-shaped layers preconditioned together (``batched_preconditioning``).

Oracles: the dense float64 formulas of the damped Kronecker inverse applied to torch.func
per-example factors (:mod:`test_oracle_numerics`), and the one-layer-at-a-time run (equal to
round-off: a batched product may order its sums differently); across workers, the
single-process run on the global batch.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from distributed_harness import run_workers
from dkfac.comm import ClusterCostModel
from dkfac.comm.cost_model import AlphaBeta, CubicCost
from dkfac.curvature import layer_stacks
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.inverse import inverse_from_tensors, owned_copy
from dkfac.curvature.layer_stacks import LayerStacks
from test_oracle_numerics import (
    DT,
    assert_close,
    batch_loss,
    eigen_direction,
    grad_matrix,
    inverse_direction,
    oracle_layer_factors,
    sgd_,
)

SPD_COST = ClusterCostModel(AlphaBeta(alpha=1e-3, beta=7e-9), CubicCost(c0=0.0, c3=5e-9))
#: Layers 2, 4 and 6 have equal shapes (d_A = 7, d_G = 6); 0 and 8 are alone.
EQUAL = ("2", "4", "6")


def repeated_model(dtype: torch.dtype = DT) -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(4, 6), nn.Tanh()]
    for _ in EQUAL:
        layers += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 3)).to(dtype)


def kfac_names(model: nn.Sequential) -> list[str]:
    return [str(i) for i, m in enumerate(model) if isinstance(m, nn.Linear)]


def batch(step: int, n: int = 5, dtype: torch.dtype = DT) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 4, generator=gen).to(dtype), torch.randint(0, 3, (n,), generator=gen)


def blend(
    old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running average ``ε·old + (1−ε)·new`` of both factors."""
    return decay * old[0] + (1 - decay) * new[0], decay * old[1] + (1 - decay) * new[1]


def storages(pre: dkfac.KFACPreconditioner, names: tuple[str, ...]) -> set[int]:
    """The storages the named layers' inverse tensors live in."""
    layers = {layer.name: layer for layer in pre.layers}
    return {
        tensor.untyped_storage().data_ptr()
        for name in names
        for tensor in layers[name].inverse.tensors().values()  # type: ignore[union-attr]
    }


def factor_storages(pre: dkfac.KFACPreconditioner, side: str) -> dict[tuple[int, ...], set[int]]:
    """Per running-factor shape, the storages those factors live in."""
    found: dict[tuple[int, ...], set[int]] = {}
    for layer in pre.layers:
        factor = layer.factor(side)
        assert factor is not None
        found.setdefault(tuple(factor.shape), set()).add(factor.untyped_storage().data_ptr())
    return found


@pytest.mark.parametrize("kl_clip", [None, 1e-6])
@pytest.mark.parametrize("folds", [False, True])
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_stacked_layers_precondition_as_the_float64_oracle_says(
    method: str, folds: bool, kl_clip: float | None
) -> None:
    """Four steps, a decomposition every second (restacked each time), running factors
    (``folds``: equal-shaped factors folded as stacks, their averages rows of one stack);
    ``kl_clip``: the directions scaled by ``ν = min(1, √(κ / (η² Σ⟨V, ∇⟩)))`` (its inner
    products formed in shared launches, as batched preconditioning does), binding here."""
    model, decay, damping, lr = repeated_model(), 0.7, 0.02, 0.1
    pre = dkfac.KFACPreconditioner(
        model,
        factor_dtype=DT,
        inv_dtype=DT,
        lr=lr,
        kl_clip=kl_clip,
        inverse_method=method,
        damping=damping,
        factor_decay=decay,
        inv_update_steps=2,
        batched_preconditioning=True,
        batched_factor_updates=folds,
    )
    names = kfac_names(model)
    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    decomposed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    stacks_seen = []
    for step in range(4):
        x, t = batch(step)
        for n in names:
            a, g = oracle_layer_factors(model, int(n), x, t)
            old = running.get(n)
            running[n] = (a, g) if old is None else blend(old, (a, g), decay)
        if step % 2 == 0:
            decomposed = dict(running)
        batch_loss(model(x), t).backward()
        grads = {n: grad_matrix(model[int(n)]) for n in names}
        pre.step()
        direction = eigen_direction if method == "eigen" else inverse_direction
        wants = {n: direction(*decomposed[n], grads[n], damping) for n in names}
        nu = 1.0
        if kl_clip is not None:
            vg = sum(float((wants[n] * grads[n]).sum().detach()) for n in names)
            nu = math.sqrt(kl_clip / (lr * lr * vg))
            assert nu < 0.5  # the clip binds
        for n in names:
            want = nu * wants[n]
            assert_close(grad_matrix(model[int(n)]), want, rtol=1e-9, what=f"step {step} {n}")
        stacks_seen.append(storages(pre, EQUAL))
        # A: layers 2, 4, 6 and 8 are 7 wide; G: layers 0, 2, 4 and 6 are 6 wide. The first
        # estimates are each factor's own batch; from the second fold on they are stacked.
        by_shape = {(7, 7): factor_storages(pre, "a")[(7, 7)]}
        by_shape[(6, 6)] = factor_storages(pre, "g")[(6, 6)]
        stacked = folds and step > 0
        assert all(len(seen) == (1 if stacked else 4) for seen in by_shape.values()), by_shape
        sgd_(model)
    # The three equal layers' inverses live in one stack: as many storages as one inverse has
    # tensors. (Steps 2 and 3 precondition from the new decomposition: the oracle checks it.)
    tensors = 4 if method == "eigen" else 2
    assert all(len(seen) == tensors for seen in stacks_seen)


class SometimesSkipped(nn.Module):
    """:func:`repeated_model` whose fourth layer (one of the equal ones) can be skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.net = repeated_model()
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, module in enumerate(self.net):
            if not (self.skip and index in (4, 5)):
                x = module(x)
        return x


def test_a_layer_skipped_in_a_window_keeps_its_factors_in_the_new_stack() -> None:
    """A factor step where one of four equal-shaped layers does not run: its factors keep
    their values (bit for bit as folding one at a time, which leaves it alone) and move into
    the new stack with the others, so no earlier stack stays alive for it."""
    runs = []
    for stacked in (False, True):
        model = SometimesSkipped()
        pre = dkfac.KFACPreconditioner(
            model, factor_dtype=DT, inv_update_steps=100, batched_factor_updates=stacked
        )
        seen = []
        for step, skip in enumerate([False, False, True, False, True, True, False]):
            model.skip = skip
            x, t = batch(step)
            model.zero_grad()
            batch_loss(model(x), t).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the skipped layer's "no statistics" notes
                pre.step()
            seen.append([layer.factor(side).clone() for layer in pre.layers for side in "ag"])  # type: ignore[union-attr]
            if stacked and step > 0:
                a_stacks, g_stacks = (
                    factor_storages(pre, "a")[(7, 7)],
                    factor_storages(pre, "g")[(6, 6)],
                )
                assert len(a_stacks) == 1 and len(g_stacks) == 1, (step, a_stacks, g_stacks)
        runs.append(seen)
    for step, (alone, stacked_run) in enumerate(zip(*runs, strict=True)):
        for mine, theirs in zip(stacked_run, alone, strict=True):
            assert torch.equal(mine, theirs), step
    skipped = 2 * 2  # the skipped layer's A and G (third K-FAC layer)
    assert torch.equal(runs[1][2][skipped], runs[1][1][skipped])  # kept on the skipped step


#: Large enough that the inverses cancel little (terms at most ~20 times the directions' largest
#: entry, against ~175 at 0.003): the round-off bound below, relative to the terms, then bites.
DAMPING = 0.3


def one_and_batched_runs(
    device: torch.device, **options: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], dkfac.KFACPreconditioner]:
    """Gradients after three K-FAC steps of a float32 model, one at a time and batched, and
    the magnitudes of the last step's products' terms (without the KL clip: a scale of its own).

    The magnitudes are each layer's preconditioning applied with its inverse's tensors' and its
    gradient's absolute values, ``|Q_G|((|Q_Gᵀ| |∇| |Q_A|) / (λ_G λ_Aᵀ + γ))|Q_Aᵀ|`` or
    ``|G⁻¹| |∇| |A⁻¹|`` (the divisor is positive): what round-off is relative to, entry by
    entry, where the terms of a sum cancel.
    """
    results, magnitudes, last = [], [], None
    for batched in (False, True):
        model = repeated_model(torch.float32).to(device)
        pre = dkfac.KFACPreconditioner(
            model, batched_preconditioning=batched, kl_clip=None, damping=DAMPING, **options
        )
        raw: list[torch.Tensor] = []
        for step in range(3):
            x, t = batch(step, 16, torch.float32)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x.to(device)), t.to(device)).backward()
            raw = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
            pre.step()
        results.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
        magnitude: list[torch.Tensor] = []
        for index, layer in enumerate(pre.layers):
            inverse = layer.inverse
            assert inverse is not None
            absolute = {name: t.abs() for name, t in inverse.tensors().items()}
            grad = layer.block.matrix_of(raw[2 * index : 2 * index + 2]).abs()
            terms = inverse._apply(absolute, grad, DAMPING, torch.matmul)
            magnitude += layer.block.split_matrix(terms)
        magnitudes.append(magnitude)
        last = pre
    assert last is not None
    largest = [torch.maximum(a, b) for a, b in zip(*magnitudes, strict=True)]
    return results[0], results[1], largest, last


@pytest.mark.parametrize(
    "device",
    [torch.device("cpu"), on_cuda(CUDA_TEST_DEVICE)],
)
# "cholesky" solves: no product-sum bound applies (its batched solves are checked against the
# float64 oracle above, and bf16 is refused with it).
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("precision", ["highest", "bf16"])
def test_batched_preconditioning_equals_one_layer_at_a_time_to_round_off(
    device: torch.device, method: str, precision: str
) -> None:
    alone, batched, magnitudes, pre = one_and_batched_runs(
        device, inverse_method=method, precondition_precision=precision
    )
    assert len(storages(pre, EQUAL)) == (2 if method == "inverse" else 4)  # stacked
    # Each way's products round (float32's unit round-off u) within Σ γ_n ≈ Σ n·u of the
    # terms' magnitude per entry (n: each product's inner dimension, 6 or 7 here; "eigen"
    # also divides, one rounding), and bf16 rounds each result once more (2⁻⁸; the operands
    # are rounded alike both ways). Two ways: twice that apart at most.
    dims = 6 + 7
    products, roundings = (2 * dims, 5) if method == "eigen" else (dims, 2)
    bf16 = 2.0**-8 if precision == "bf16" else 0.0
    per_way = products * 2.0**-24 + roundings * max(2.0**-24, bf16)
    for one, many, magnitude in zip(alone, batched, magnitudes, strict=True):
        assert bool(((one - many).abs() <= 2 * per_way * magnitude).all())
        assert not torch.equal(magnitude, torch.zeros_like(magnitude))


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_diagonal_factors_stack_too(method: str) -> None:
    """Two equal embeddings (their A a diagonal: inverses that are vectors) stacked."""
    outputs = []
    for batched in (False, True):
        torch.manual_seed(5)
        first, second, head = nn.Embedding(7, 4), nn.Embedding(7, 4), nn.Linear(4, 3)
        model = nn.ModuleDict({"first": first, "second": second, "head": head}).double()
        pre = dkfac.KFACPreconditioner(
            model,
            inverse_method=method,
            factor_dtype=DT,
            inv_dtype=DT,
            batched_preconditioning=batched,
        )
        ids, t = torch.tensor([[0, 3, 5], [1, 3, 6]]), torch.tensor([0, 2])
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            hidden = (model["first"](ids) + model["second"](ids)).mean(1)
            F.cross_entropy(model["head"](hidden), t).backward()
            pre.step()
        outputs.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        if batched:
            assert len(storages(pre, ("first", "second"))) == (3 if method == "eigen" else 2)
    for one, many in zip(*outputs, strict=True):
        torch.testing.assert_close(many, one, rtol=1e-12, atol=1e-15)


def test_layers_of_different_domains_are_never_stacked_together() -> None:
    model = repeated_model()
    pre = dkfac.KFACPreconditioner(model, factor_dtype=DT, inv_dtype=DT, kl_clip=None)
    x, t = batch(0)
    batch_loss(model(x), t).backward()
    pre.step()
    layers = [layer for layer in pre.layers if layer.name in EQUAL]
    grads = [layer.block.grad_matrix() for layer in layers]
    alone = [layer.precondition(g, 0.01) for layer, g in zip(layers, grads, strict=True)]
    stacks = LayerStacks()
    results = stacks.precondition(layers, grads, 0.01, domains=[0, 1, 0])
    # Layers "2" and "6" (domain 0) share a stack; "4" keeps its own inverse.
    assert storages(pre, ("2",)) == storages(pre, ("6",))
    assert not storages(pre, ("4",)) & storages(pre, ("2",))
    for got, want in zip(results, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


class Branches(nn.Module):
    """Three equal branches; the third runs only when asked (a layer without a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, third: bool) -> torch.Tensor:
        hidden = torch.tanh(self.a(x)) + torch.tanh(self.b(x))
        return self.head(hidden + torch.tanh(self.c(x)) if third else hidden)


def test_changing_sets_of_stacked_layers_copy_nothing_and_pin_no_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stack per decomposition and set of layers, not per step: a step without ``c``
    preconditions ``a`` and ``b`` through their views; after a decomposition made while ``c``
    was idle, ``c`` keeps an inverse of its own instead of a view of the dropped stack.
    Oracle: the one-at-a-time run."""
    built: list[int] = []
    real_stack = layer_stacks.stack_inverses

    def counting(inverses: Any) -> Any:
        built.append(len(inverses))
        return real_stack(inverses)

    monkeypatch.setattr(layer_stacks, "stack_inverses", counting)
    third = [True, False, True, False, False, True]  # decompositions at steps 0 and 4
    grads = {}
    for batched in (False, True):
        model = Branches().double()
        pre = dkfac.KFACPreconditioner(
            model,
            factor_dtype=DT,
            inv_dtype=DT,
            inv_update_steps=4,
            batched_preconditioning=batched,
        )
        seen = []
        for step, use in enumerate(third):
            x, t = batch(step, 6)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x, use), t).backward()
            pre.step()
            seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            if batched and step == 4:
                layers = {layer.name: layer for layer in pre.layers}
                own = layers["c"].inverse.tensors().values()  # type: ignore[union-attr]
                assert all(t.untyped_storage().nbytes() == t.numel() * t.itemsize for t in own)
                assert storages(pre, ("a",)) == storages(pre, ("b",))
        grads[batched] = seen
    # Step 0 stacks a, b and c; steps 1-3 use that stack or their views; step 4 (a and b,
    # new inverses) stacks them anew and gives c a copy of its own; step 5 stacks all three.
    assert built == [3, 2, 3]
    for one, many in zip(grads[False], grads[True], strict=True):
        for a, b in zip(one, many, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)


def branches_stacked() -> tuple[dkfac.KFACPreconditioner, dict[str, Any], LayerStacks]:
    """One K-FAC step of :class:`Branches` (one layer at a time), then ``a``, ``b`` and ``c``
    preconditioned together by a fresh :class:`LayerStacks` (their inverses now its views)."""
    model = Branches().double()
    pre = dkfac.KFACPreconditioner(model, factor_dtype=DT, inv_dtype=DT)
    x, t = batch(0, 6)
    F.cross_entropy(model(x, True), t).backward()
    pre.step()
    layers = {layer.name: layer for layer in pre.layers}
    trio = [layers[name] for name in "abc"]
    stacks = LayerStacks()
    stacks.precondition(trio, [layer.block.grad_matrix() for layer in trio], 0.01, [0, 0, 0])
    return pre, layers, stacks


def test_a_layer_left_out_of_a_new_stack_gets_its_own_copy() -> None:
    """``a`` and ``b`` get new inverses while ``c`` keeps its old one (its decomposition
    failed, say) and has no gradient: restacking ``a`` and ``b`` drops the old stack, and
    ``c``'s view of it becomes a copy of its own with the same values."""
    pre, layers, stacks = branches_stacked()
    trio = [layers[name] for name in "abc"]
    grads = [layer.block.grad_matrix() for layer in trio]
    old_c = layers["c"].inverse
    assert old_c is not None and storages(pre, ("c",)) == storages(pre, ("a",))
    for name in "ab":  # a decomposition: new objects (here copies of the same values)
        layer = layers[name]
        assert layer.inverse is not None
        layer.inverse = inverse_from_tensors(
            layer.inverse.method, {k: v.clone() for k, v in layer.inverse.tensors().items()}
        )
    stacks.precondition(trio[:2], grads[:2], 0.01, [0, 0])
    new_c = layers["c"].inverse
    assert new_c is not None and new_c is not old_c
    for name, tensor in new_c.tensors().items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.itemsize
        assert torch.equal(tensor, old_c.tensors()[name])
    assert not storages(pre, ("c",)) & storages(pre, ("a",))


def test_a_stack_whose_layers_all_got_new_inverses_is_forgotten() -> None:
    """After a decomposition, a stack none of whose layers holds its view any more is
    released at the next step even if those layers are not preconditioned together again
    (here: none of them has a gradient)."""
    _, layers, stacks = branches_stacked()
    trio = [layers[name] for name in "abc"]
    stacked = stacks._stacks[("a", "b", "c")].stacked
    alive = weakref.ref(stacked)
    del stacked
    for layer in trio:
        assert layer.inverse is not None
        layer.inverse = owned_copy(layer.inverse)  # a decomposition: new objects
    head = layers["head"]
    stacks.precondition([head], [head.block.grad_matrix()], 0.01, [0])
    gc.collect()
    assert alive() is None and not stacks._stacks


def test_the_old_stack_is_freed_before_the_same_layers_are_stacked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a decomposition, preconditioning the same trio again frees its old stack before
    the new one is built (at most one stack's memory at a time), and a layer preconditioned
    alone keeps no replaced inverse alive (the grouping refers to inverses weakly)."""
    _, layers, stacks = branches_stacked()
    trio = [layers[name] for name in "abc"]
    old_stack = weakref.ref(stacks._stacks[("a", "b", "c")].stacked)
    for layer in trio:
        assert layer.inverse is not None
        layer.inverse = owned_copy(layer.inverse)  # a decomposition: new objects
    seen: list[object] = []
    real_stack = layer_stacks.stack_inverses

    def watched(inverses: Any) -> Any:
        gc.collect()
        seen.append(old_stack())
        return real_stack(inverses)

    monkeypatch.setattr(layer_stacks, "stack_inverses", watched)
    grads = [torch.randn(4, 5, dtype=DT) for _ in trio]
    stacks.precondition(trio, grads, 0.01, [0, 0, 0])
    assert seen == [None]
    head = layers["head"]
    stacks.precondition([head], [torch.randn(3, 5, dtype=DT)], 0.01, [0])
    assert head.inverse is not None
    old_head = weakref.ref(head.inverse)
    head.inverse = owned_copy(head.inverse)
    gc.collect()
    assert old_head() is None


def test_a_grouping_is_made_again_for_another_gradient_dtype_or_a_forgotten_inverse() -> None:
    """The cached grouping holds only while every layer keeps its gradient's dtype (a model
    converted in place keeps its parameters) and its inverse. Oracle: each layer alone (its
    own inverse, or its gradient unchanged without one), in its gradient's dtype."""
    _, layers, stacks = branches_stacked()
    trio = [layers[name] for name in "abc"]
    grads = [torch.randn(4, 5, dtype=DT) for _ in trio]
    stacks.precondition(trio, grads, 0.01, [0, 0, 0])
    mixed = [grads[0], grads[1].float(), grads[2]]  # one layer's gradient now float32
    done = stacks.precondition(trio, mixed, 0.01, [0, 0, 0])
    assert [got.dtype for got in done] == [DT, torch.float32, DT]
    torch.testing.assert_close(done[1], trio[1].precondition(mixed[1], 0.01))
    trio[0].inverse = None  # forgotten (LayerCurvature.forget)
    done = stacks.precondition(trio, grads, 0.01, [0, 0, 0])
    assert done[0] is grads[0]
    for layer, grad, got in zip(trio[1:], grads[1:], done[1:], strict=True):
        torch.testing.assert_close(got, layer.precondition(grad, 0.01), rtol=1e-12, atol=0)


def test_a_loaded_state_is_restacked_and_preconditions_the_same() -> None:
    model = repeated_model()
    options: dict[str, Any] = {"factor_dtype": DT, "inv_dtype": DT, "batched_preconditioning": True}
    pre = dkfac.KFACPreconditioner(model, inv_update_steps=10, **options)
    for step in range(2):
        x, t = batch(step)
        model.zero_grad(set_to_none=True)
        batch_loss(model(x), t).backward()
        pre.step()
    state = copy.deepcopy(pre.state_dict())
    twin_model = copy.deepcopy(model)
    twin = dkfac.KFACPreconditioner(twin_model, inv_update_steps=10, **options)
    twin.load_state_dict(state)
    x, t = batch(5)
    for net, p in ((model, pre), (twin_model, twin)):
        net.zero_grad(set_to_none=True)
        batch_loss(net(x), t).backward()
        p.step()
    assert len(storages(twin, EQUAL)) == 4  # the loaded inverses were stacked again
    for mine, theirs in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["batched_preconditioning", "batched_decompositions", "batched_factor_updates"]
)
def test_batching_options_must_be_a_bool_or_none(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=1 is not allowed"):
        dkfac.KFACPreconditioner(repeated_model(), **{name: 1})


def trained(
    net: nn.Module, options: dict[str, Any], shard: slice = slice(None)
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Parameters after three SGD steps with K-FAC on ``shard`` of each global batch of 8,
    and the plan's factors as (decomposer: a rank, or -1 for every worker; width)."""
    pre = dkfac.KFACPreconditioner(net, factor_dtype=DT, inv_dtype=DT, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        x, t = batch(step, 8)
        opt.zero_grad()
        F.cross_entropy(net(x[shard]), t[shard]).backward()
        pre.step()
        opt.step()
    decomposers = [(r.decomposed_by, r.dim) for r in pre._strategy.placement.factors]
    pre.remove()
    return [p.detach().clone() for p in net.parameters()], decomposers


def worker_run(
    rank: int, world_size: int, options: dict[str, Any]
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    ddp = nn.parallel.DistributedDataParallel(repeated_model())
    local = 8 // world_size
    shard = slice(rank * local, (rank + 1) * local)
    batched = {
        "batched_preconditioning": True,
        "batched_decompositions": True,
        "batched_factor_updates": True,
    }
    options = {**options, **batched, "check_replicas_every": 1}
    return trained(ddp, options, shard)


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "dkfac", "inverse_method": "eigen"},
        {"strategy": "kaisa", "grad_worker_fraction": 0.5, "inverse_method": "inverse"},
        # SPD on a network where sending a factor costs more than decomposing one up to 6
        # wide: the four 6-wide G's decomposed by every worker (one batch on each), the
        # 7-wide A's by their owners.
        {"strategy": "spd", "inverse_method": "inverse", "cost_model": SPD_COST},
    ],
)
def test_two_workers_batched_equal_the_single_process_run(options: dict[str, Any]) -> None:
    """Each worker stacks the layers whose inverse it holds and batches the factors it
    decomposes (each with those of its own domain); the ranks' parameters agree bit for bit
    and are the one-process run on the global batch, one layer at a time."""
    want, _ = trained(repeated_model(), {"inverse_method": options["inverse_method"]})
    results = run_workers(worker_run, 2, (options,))
    ranks = [params for params, _ in results]
    assert all(torch.equal(a, b) for a, b in zip(*ranks, strict=True))  # replicas' bits
    if options["strategy"] == "spd":  # both kinds of decomposer domain, batches in each
        factors = results[0][1]
        assert factors.count((-1, 6)) == 4
        assert {rank for rank, dim in factors if dim == 7} == {0, 1}
    for got in ranks:
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


class _OperatorCalls(TorchDispatchMode):
    """Counts the ATen operator calls (views included) made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def plain_step_calls(layers: int) -> Counter[str]:
    """Operator calls of a plain step (no factor, no decomposition) of ``layers`` equal layers."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(6, 6, bias=False), nn.Tanh()]
    model = nn.Sequential(*blocks)
    pre = dkfac.KFACPreconditioner(
        model, factor_update_steps=10, inv_update_steps=10, batched_preconditioning=True
    )
    x = torch.randn(5, 6)
    counted = _OperatorCalls()
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        if step == 1:
            with counted:
                pre.step()
        else:
            pre.step()
    return counted.calls


def test_a_plain_step_costs_two_operator_calls_per_stacked_layer() -> None:
    # A small model's step on a GPU is host time, each operator call a few microseconds
    # (docs/benchmarks.md, "Host time of small steps"). Per layer a plain step needs the
    # gradient's matrix view (the direction is copied back through it: no view in the
    # weight's shape) and the flat view of its KL product, taken inside one C++ call with
    # the others' (batched preconditioning forms the KL products in shared launches: no
    # product and sum per layer); its stack's rows come from one unbind, not an indexing
    # call each, and a layer without bias is one view, not a column slice and a view.
    four, eight = plain_step_calls(4), plain_step_calls(8)
    added = eight - four
    assert added == Counter({"view": 8}), added
