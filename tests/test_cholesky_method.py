"""``inverse_method="cholesky"``: the damped factors' Cholesky factors, applied by solves.

Oracles: float64 Cholesky factors and inverses of the damped factors (``torch.linalg``), the
dense product ``(G + s_G I)⁻¹ ∇ (A + s_A I)⁻¹``, and the wire's packing of a symmetric tensor.
Whole runs of every method against the float64 oracle are in ``test_oracle_numerics.py`` and
``test_layer_stacks.py`` (parametrised over ``INVERSE_METHODS``); distributed runs with
``"cholesky"`` (D-KFAC, KAISA, SPD, PAD, DP-KFAC) against the single-process run in
``test_distributed.py``, ``test_pipelined.py`` and ``test_dp.py``.
"""

from __future__ import annotations

import pytest
import torch

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.comm.wire import FusionBucket
from dkfac.curvature.factor_decomposition import (
    CholeskyRootFactor,
    check_inverses_finite,
    decompose_factor,
    factor_decomposition,
    factor_tensor_shapes,
)
from dkfac.curvature.inverse import CholeskyInverse, combine_factors, stack_inverses

F64 = torch.float64


def spd(d: int, seed: int, device: str = "cpu") -> torch.Tensor:
    m = torch.randn(d, d + 3, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (m @ m.t() / (d + 3)).to(device)


def damped(matrix: torch.Tensor, shift: float) -> torch.Tensor:
    return matrix + shift * torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cholesky_factor_is_kept_with_its_transpose_mirrored_above_it(
    dtype: torch.dtype, device: str
) -> None:
    # Lower triangle: the Cholesky factor of F + shift·I (float64 oracle); upper: its
    # transpose, so the tensor is exactly symmetric and row-major, and the wire's packing of
    # its upper triangle rebuilds it bit for bit on a receiver.
    matrix = spd(200, 3, device)
    shift = torch.tensor(0.05, dtype=F64, device=device)
    made = decompose_factor(matrix.to(dtype), "a", "cholesky", dtype, shift)
    assert isinstance(made, CholeskyRootFactor) and bool(made.ok)
    stored = made.tensors["a_chol"]
    assert stored.dtype == dtype and stored.is_contiguous() and torch.equal(stored, stored.mT)
    want = torch.linalg.cholesky(damped(matrix, 0.05))
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-13}[dtype]
    torch.testing.assert_close(stored.tril().double(), want, rtol=tolerance, atol=tolerance)
    bucket = FusionBucket([stored], [True], dtype)
    received = torch.zeros_like(stored)
    rebuilt = FusionBucket([received], [True], dtype)
    rebuilt.flat.copy_(bucket.flat)
    rebuilt.unpack()
    assert torch.equal(received, stored)
    assert factor_tensor_shapes("cholesky", "a", 200) == [("a_chol", (200, 200), True)]
    again = factor_decomposition("cholesky", "a", made.tensors, made.ok)
    assert isinstance(again, CholeskyRootFactor)


def test_equal_factors_decomposed_together_equal_each_ones_own() -> None:
    matrices = [spd(7, seed) for seed in range(3)]
    shifts = [torch.tensor(s, dtype=F64) for s in (0.1, 0.2, 0.3)]
    together = CholeskyRootFactor.compute_many(matrices, ["a", "g", "a"], F64, shifts)
    for matrix, side, shift, batched in zip(matrices, "aga", shifts, together, strict=True):
        alone = CholeskyRootFactor.compute(matrix, side, F64, shift)
        name = f"{side}_chol"
        torch.testing.assert_close(batched.tensors[name], alone.tensors[name], rtol=1e-14, atol=0)
        assert bool(batched.ok) and batched.tensors[name]._base is None  # its own memory


def test_a_failed_factorisation_is_not_ok_checked_alone_or_together() -> None:
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)
    zero = torch.tensor(0.0, dtype=F64)
    own = CholeskyRootFactor.compute(indefinite, "g", F64, zero)
    deferred = CholeskyRootFactor.compute(indefinite, "g", F64, zero, check_finite=False)
    infinite = CholeskyRootFactor(
        "g", {"g_chol": torch.full((2, 2), torch.inf)}, torch.tensor(True)
    )
    check_inverses_finite([deferred, infinite])
    assert not bool(own.ok) and not bool(deferred.ok) and not bool(infinite.ok)
    with pytest.raises(ValueError, match="unknown method 'lu'"):
        decompose_factor(indefinite, "g", "lu", F64, zero)
    with pytest.raises(ValueError, match=r"'cholesky'.*needs the Tikhonov shift"):
        decompose_factor(indefinite, "g", "cholesky", F64)


@pytest.mark.parametrize("a_diagonal", [False, True])
@pytest.mark.parametrize("g_diagonal", [False, True])
def test_solves_give_the_damped_inverses_product_row_major(
    a_diagonal: bool, g_diagonal: bool
) -> None:
    # (G + s_G I)⁻¹ ∇ (A + s_A I)⁻¹ from dense float64 solves; a diagonal factor held as its
    # vector. Row-major like a product's result (KL sums then add in one order on every worker).
    a = torch.rand(6, dtype=F64) + 0.5 if a_diagonal else spd(6, 1)
    g = torch.rand(4, dtype=F64) + 0.5 if g_diagonal else spd(4, 2)
    shift_a, shift_g = torch.tensor(0.3, dtype=F64), torch.tensor(0.07, dtype=F64)
    inverse = combine_factors(
        "cholesky",
        decompose_factor(a, "a", "cholesky", F64, shift_a),
        decompose_factor(g, "g", "cholesky", F64, shift_g),
    )
    assert isinstance(inverse, CholeskyInverse)
    grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(9), dtype=F64)
    dense_a = torch.diag(a) if a_diagonal else a
    dense_g = torch.diag(g) if g_diagonal else g
    left = torch.linalg.solve(damped(dense_g, 0.07), grad)
    want = torch.linalg.solve(damped(dense_a, 0.3), left.mT).mT
    got = inverse.precondition(grad, damping=123.0)  # the damping was fixed when decomposed
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # Stacked with another layer's inverse: each matrix of the stack as its own.
    other = combine_factors(
        "cholesky",
        decompose_factor(a * 2, "a", "cholesky", F64, shift_a),
        decompose_factor(g * 3, "g", "cholesky", F64, shift_g),
    )
    stacked = stack_inverses([inverse, other])
    both = stacked.precondition(torch.stack([grad, -grad]), damping=0.0)
    assert both.is_contiguous()
    torch.testing.assert_close(both[0], got, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(both[1], other.precondition(-grad, 0.0), rtol=1e-13, atol=1e-15)


def test_bfloat16_preconditioning_is_refused_with_solves() -> None:
    inverse = CholeskyInverse({"a_chol": torch.eye(3), "g_inv": torch.ones(2)})
    with pytest.raises(ValueError, match="no bfloat16 kernel"):
        inverse.precondition(torch.ones(2, 3), 0.0, "bf16")
    with pytest.raises(ValueError, match="one of a_chol/a_inv and one of g_chol/g_inv"):
        CholeskyInverse({"a_chol": torch.eye(3), "a_inv": torch.ones(3), "g_inv": torch.ones(2)})
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="precondition_precision='bf16' is not allowed with"):
        dkfac.KFACPreconditioner(model, inverse_method="cholesky", precondition_precision="bf16")


def test_a_run_with_solves_equals_one_with_inverses_to_round_off() -> None:
    # Same factors and shifts, the same preconditioner: the parameters after a few steps of
    # both methods agree to float64 round-off, and the solves never form an inverse.
    results = {}
    for method in ("inverse", "cholesky"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        ).double()
        pre = dkfac.KFACPreconditioner(
            model, inverse_method=method, factor_dtype=F64, inv_dtype=F64, lr=0.1
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(16, 5, generator=torch.Generator().manual_seed(step), dtype=F64)
            optimizer.zero_grad()
            model(x).square().mean().backward()
            pre.step()
            optimizer.step()
        names = {name for layer in pre.layers for name in layer.inverse.tensors()}  # type: ignore[union-attr]
        assert names == ({"a_chol", "g_chol"} if method == "cholesky" else {"a_inv", "g_inv"})
        results[method] = [p.detach().clone() for p in model.parameters()]
    for ours, theirs in zip(results["cholesky"], results["inverse"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
