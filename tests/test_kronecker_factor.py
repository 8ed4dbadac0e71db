"""One factor as an object: its running average and validity, and each method's tensor layout.

Oracles: the running average's closed form and dense float64 linear algebra.
"""

from __future__ import annotations

import pytest
import torch

from dkfac.curvature.inverse import (
    CholeskyFactor,
    EigenFactor,
    decompose_factor,
    factor_decomposition,
    factor_tensor_shapes,
)
from dkfac.curvature.kronecker_factor import KroneckerFactor


def spd(d: int, seed: int) -> torch.Tensor:
    m = torch.randn(d, d + 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return m @ m.t() / (d + 3)


def test_a_factor_folds_batches_drops_nonfinite_ones_and_counts_them() -> None:
    factor = KroneckerFactor("g", 4, torch.float64)
    assert factor.running is None and factor.take_nonfinite_count() is None
    first, second = spd(4, 0), spd(4, 1)
    factor.fold(first, 0.9)
    assert torch.equal(factor.value(), first)  # the first estimate is the batch itself
    bad = second.clone()
    bad[0, 1] = float("nan")
    factor.fold(bad, 0.9)
    assert torch.equal(factor.value(), first)  # a NaN batch is not folded in
    factor.fold(second, 0.9)
    torch.testing.assert_close(factor.value(), 0.9 * first + 0.1 * second, rtol=0, atol=1e-15)
    assert int(factor.take_nonfinite_count()) == 1  # type: ignore[arg-type]
    assert factor.take_nonfinite_count() is None  # taken
    assert bool(factor.finite())
    assert float(factor.trace_mean(torch.float64)) == pytest.approx(
        float(torch.diagonal(factor.value()).mean())
    )
    assert torch.equal(factor.zeros(torch.device("cpu")), torch.zeros(4, 4, dtype=torch.float64))


def test_a_factor_without_an_average_says_so() -> None:
    with pytest.raises(RuntimeError, match="factor A has no running average"):
        KroneckerFactor("a", 3, torch.float32).value()


def test_each_method_owns_its_layout_and_its_arithmetic() -> None:
    assert factor_tensor_shapes("eigen", "a", 5) == [("qa", (5, 5), False), ("la", (5,), False)]
    assert factor_tensor_shapes("inverse", "g", 3) == [("g_inv", (3, 3), True)]
    matrix = spd(6, 2)
    eigen = decompose_factor(matrix, "g", "eigen", torch.float64)
    assert isinstance(eigen, EigenFactor) and bool(eigen.ok)
    q, values = eigen.tensors["qg"], eigen.tensors["lg"]
    torch.testing.assert_close(q @ torch.diag(values) @ q.t(), matrix, rtol=0, atol=1e-12)
    shift = torch.tensor(0.25, dtype=torch.float64)
    cholesky = decompose_factor(matrix, "a", "inverse", torch.float64, shift)
    assert isinstance(cholesky, CholeskyFactor) and bool(cholesky.ok)
    want = torch.linalg.inv(matrix + 0.25 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(cholesky.tensors["a_inv"], want, rtol=0, atol=1e-12)
    received = factor_decomposition("inverse", "a", cholesky.tensors, cholesky.ok)
    assert isinstance(received, CholeskyFactor) and received.side == "a"
    with pytest.raises(ValueError, match="needs the Tikhonov shift"):
        decompose_factor(matrix, "a", "inverse", torch.float64)
