"""``precondition_precision="bf16"``: the preconditioning products of bfloat16-rounded operands.

Two oracles. (1) The float64 product with the decomposition's own tensors (so the
decomposition's error is not counted): each of the ``k`` roundings on a path (an operand, a
product's or an elementwise result) changes its value by at most ``u = 2⁻⁸`` relatively, so to
first order ``|got - exact| <= k·u·E`` elementwise, ``E`` being the same chain of products on
absolute values (and ``|λ_G λ_Aᵀ + γ|``): Higham's componentwise bound for products. On these
sizes the bound is about 3% of ``|exact|`` for ``"inverse"`` and 10-13% for ``"eigen"``; a
transposed or swapped factor, a wrong damping or a scaled eigenvalue fails it. (2) The claimed
pipeline replayed in float64, rounding to bfloat16 where the implementation does: most entries
must agree bit for bit (the rest differ by a float32 sum landing on the other side of a
rounding boundary); a float32 product rounded only at the end agrees on about half.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from distributed_harness import run_workers
from dkfac.bench.timed_window import kfac_memory_bytes
from dkfac.curvature.inverse import (
    EigenInverse,
    KroneckerInverse,
    TikhonovInverse,
    decompose,
    inverse_from_tensors,
)

#: The unit roundoff of bfloat16 (8 significant bits, round to nearest).
U = 2.0**-8
#: Roundings on a path, plus one for the float32 sums: inverse: the gradient, G⁻¹, A⁻¹ and the
#: two products' results (5); eigen: the gradient, Q_G and Q_A (each used twice), λ_G, λ_A,
#: their outer product, the damped denominator, the quotient and the four products' results
#: (14).
ROUNDINGS = {"inverse": 6, "eigen": 15}
#: The unit roundoff of float32 and the roundings of the default (float32) path: a product's
#: sum of ``n`` terms is within ``γₙ = n·u/(1 − n·u)`` of exact (Higham), ``n·u`` to first
#: order as above, so inverse: 5 + 7; eigen: the four products' 5 + 7 + 5 + 7, the outer
#: product, the damping and the quotient.
U32 = 2.0**-24
FLOAT32_ROUNDINGS = {"inverse": 12, "eigen": 27}
DAMPING = 0.01
DEVICES = ["cpu", on_cuda(str(CUDA_TEST_DEVICE))]


def factor(d: int, generator: torch.Generator) -> Tensor:
    """A covariance with eigenvalues spread over four decades (as real factors have)."""
    x = torch.randn(50, d, generator=generator) * torch.logspace(0, -2, d)
    return x.t() @ x / 50


def exact_and_bound(inverse: KroneckerInverse, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 product with ``inverse``'s tensors and ``E`` (the product on |values|)."""
    t = {name: value.double() for name, value in inverse.tensors().items()}
    g = grad.double()
    if isinstance(inverse, TikhonovInverse):
        g_inv, a_inv = t["g_inv"], t["a_inv"]
        if a_inv.dim() == 1:  # a diagonal factor: its inverse scales the columns
            return g_inv @ g * a_inv, g_inv.abs() @ g.abs() * a_inv.abs()
        return g_inv @ g @ a_inv, g_inv.abs() @ g.abs() @ a_inv.abs()
    # A diagonal factor has no eigenvectors: the identity.
    qg = t.get("qg", torch.eye(g.shape[0], dtype=g.dtype))
    qa = t.get("qa", torch.eye(g.shape[1], dtype=g.dtype))
    denominator = torch.outer(t["lg"], t["la"]) + DAMPING
    exact = qg @ ((qg.t() @ g @ qa) / denominator) @ qa.t()
    size = qg.abs() @ ((qg.abs().t() @ g.abs() @ qa.abs()) / denominator.abs()) @ qa.abs().t()
    return exact, size


def replayed_pipeline(inverse: KroneckerInverse, grad: Tensor) -> Tensor:
    """The bf16 arithmetic as claimed, in float64: every operand and result rounded."""

    def rounded(x: Tensor) -> Tensor:
        return x.to(torch.bfloat16).double()

    t = {name: rounded(value.double()) for name, value in inverse.tensors().items()}
    g = rounded(grad.double())
    if isinstance(inverse, TikhonovInverse):
        return rounded(rounded(t["g_inv"] @ g) @ t["a_inv"])
    qg, qa = t["qg"], t["qa"]
    denominator = rounded(rounded(torch.outer(t["lg"], t["la"])) + DAMPING)
    rotated = rounded(rounded(qg.t() @ g) @ qa)
    return rounded(rounded(qg @ rounded(rotated / denominator)) @ qa.t())


def assert_bf16_preconditioned(got: Tensor, exact: Tensor, size: Tensor, method: str) -> None:
    """``got`` within the componentwise bound of ``exact``, and computed in bfloat16."""
    error = (got.double() - exact).abs()
    allowed = ROUNDINGS[method] * U * size
    worst = float((error / allowed).max())
    assert worst <= 1.0, f"{method}: error reaches {worst:.2f} of the rounding bound"
    assert torch.equal(got, got.to(torch.bfloat16).to(got.dtype)), "not a bfloat16 result"
    relative = float(error.norm() / exact.norm())
    assert relative > 1e-5, f"error {relative:.1e}: the float32 product, not bfloat16's"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_bf16_preconditioning_is_within_the_rounding_bound_of_the_float64_product(
    method: str, device: str
) -> None:
    generator = torch.Generator().manual_seed(0)
    agreeing = entries = 0
    for _ in range(5):
        a, g = factor(7, generator), factor(5, generator)
        inverse, ok = decompose(a.to(device), g.to(device), DAMPING, method, torch.float32)
        assert bool(ok)
        grad = torch.randn(5, 7, generator=generator).to(device)
        got = inverse.precondition(grad, DAMPING, "bf16")
        assert got.dtype == torch.float32 and got.device == grad.device
        got, grad = got.cpu(), grad.cpu()
        inverse = inverse_from_tensors(method, {k: v.cpu() for k, v in inverse.tensors().items()})
        assert_bf16_preconditioned(got, *exact_and_bound(inverse, grad), method)
        agreeing += int((got.double() == replayed_pipeline(inverse, grad)).sum())
        entries += got.numel()
        # The default precision is the float32 product, within float32's componentwise
        # bound (a fixed relative tolerance fails where terms cancel, as BLAS builds differ).
        highest = inverse.precondition(grad, DAMPING)
        exact, size = exact_and_bound(inverse, grad)
        error = (highest.double() - exact).abs()
        assert bool((error <= FLOAT32_ROUNDINGS[method] * U32 * size).all()), method
    assert agreeing >= 0.9 * entries, f"{agreeing} of {entries} entries as the pipeline's"


def test_a_bound_this_tight_catches_a_wrong_product() -> None:
    """The test above can fail: a transposed factor or a dropped damping breaks the bound."""
    generator = torch.Generator().manual_seed(1)
    a, g = factor(6, generator), factor(6, generator)
    inverse, _ = decompose(a, g, DAMPING, "eigen", torch.float32)
    assert isinstance(inverse, EigenInverse)
    grad = torch.randn(6, 6, generator=generator)
    exact, size = exact_and_bound(inverse, grad)
    for wrong in (
        EigenInverse(inverse.qg, inverse.la, inverse.qa, inverse.lg),  # factors swapped
        EigenInverse(inverse.qa, inverse.la, inverse.qg, inverse.lg * 1.5),
    ):
        with pytest.raises(AssertionError, match="rounding bound"):
            assert_bf16_preconditioned(
                wrong.precondition(grad, DAMPING, "bf16"), exact, size, "eigen"
            )
    with pytest.raises(AssertionError, match="rounding bound"):
        assert_bf16_preconditioned(
            inverse.precondition(grad, 0.1 * DAMPING, "bf16"), exact, size, "eigen"
        )


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_a_diagonal_factor_is_preconditioned_in_bf16_too(method: str) -> None:
    """An embedding's ``A`` is a diagonal: a vector inverse, or eigenvalues without vectors."""
    generator = torch.Generator().manual_seed(2)
    g = factor(4, generator)
    a_diagonal = torch.rand(9, generator=generator) + 0.1
    inverse: KroneckerInverse
    if method == "inverse":
        inverse = TikhonovInverse(1.0 / a_diagonal, torch.linalg.inv(g + 0.1 * torch.eye(4)))
    else:
        lg, qg = torch.linalg.eigh(g)
        inverse = EigenInverse(None, a_diagonal, qg, lg.clamp(min=0.0))
    grad = torch.randn(4, 9, generator=generator)
    got = inverse.precondition(grad, DAMPING, "bf16")
    assert_bf16_preconditioned(got, *exact_and_bound(inverse, grad), method)


def test_the_rounded_tensors_are_made_once_per_decomposition() -> None:
    generator = torch.Generator().manual_seed(3)
    inverse, _ = decompose(
        factor(5, generator), factor(3, generator), DAMPING, "inverse", torch.float32
    )
    grad = torch.randn(3, 5, generator=generator)
    first = inverse.precondition(grad, DAMPING, "bf16")
    rounded = inverse._rounded
    assert rounded is not None and all(t.dtype == torch.bfloat16 for t in rounded.values())
    assert torch.equal(inverse.precondition(grad, DAMPING, "bf16"), first)
    assert inverse._rounded is rounded


def test_an_unknown_precision_is_refused() -> None:
    generator = torch.Generator().manual_seed(4)
    inverse, _ = decompose(
        factor(3, generator), factor(2, generator), DAMPING, "eigen", torch.float32
    )
    with pytest.raises(ValueError, match=r"precision='fp8' is not allowed: expected one of"):
        inverse.precondition(torch.randn(2, 3), DAMPING, "fp8")
    with pytest.raises(ValueError, match=r"precondition_precision='fp16' is not allowed"):
        dkfac.KFACPreconditioner(nn.Linear(3, 2), precondition_precision="fp16")


def layer_directions(
    model: nn.Module, pre: dkfac.KFACPreconditioner, x: Tensor, y: Tensor
) -> tuple[list[Tensor], list[Tensor], list[KroneckerInverse]]:
    """One step: each layer's gradient matrix before it, its direction and inverse after."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    layers = pre._layers
    grads = [layer.block.grad_matrix().clone() for layer in layers]
    pre.step()
    directions = [layer.block.grad_matrix() for layer in layers]
    inverses = [layer.inverse for layer in layers]
    assert all(inverse is not None for inverse in inverses)
    return grads, directions, inverses  # type: ignore[return-value]


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_the_preconditioner_applies_bf16_to_every_layer(method: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Tanh(), nn.Linear(3 * 4 * 4, 5))
    pre = dkfac.KFACPreconditioner(
        model,
        inverse_method=method,
        damping=DAMPING,
        kl_clip=None,
        precondition_precision="bf16",
    )
    x, y = torch.randn(16, 2, 6, 6), torch.randint(0, 5, (16,))
    for _ in range(2):
        grads, directions, inverses = layer_directions(model, pre, x, y)
        for grad, direction, inverse in zip(grads, directions, inverses, strict=True):
            assert_bf16_preconditioned(direction, *exact_and_bound(inverse, grad), method)
    assert pre.config.precondition_precision == "bf16"
    # The bf16 copies are memory the rank holds: half the float32 inverses' bytes again.
    float32_bytes = sum(t.numel() * 4 for inverse in inverses for t in inverse.tensors().values())
    assert kfac_memory_bytes(pre)[1] == float32_bytes * 3 // 2


def ranks_precondition_in_bf16(rank: int, world: int) -> bool:
    """D-KFAC at P = 2: every rank's directions against the float64 product with its inverse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = dkfac.KFACPreconditioner(
        ddp, strategy="dkfac", damping=DAMPING, kl_clip=None, precondition_precision="bf16"
    )
    generator = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 4, (8,), generator=generator)
    grads, directions, inverses = layer_directions(ddp, pre, x, y)
    for grad, direction, inverse in zip(grads, directions, inverses, strict=True):
        assert_bf16_preconditioned(direction, *exact_and_bound(inverse, grad), "eigen")
    pre.remove()
    return True


def test_a_distributed_strategy_preconditions_in_bf16() -> None:
    assert run_workers(ranks_precondition_in_bf16, 2, timeout=120) == [True, True]
