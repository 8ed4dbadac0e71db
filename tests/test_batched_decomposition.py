"""Equal-size factors decomposed in one batched call (``batch_up_to``; the
preconditioner's ``batched_decompositions``, off by default).

Oracles: each factor rebuilt in float64 from its eigenvectors and eigenvalues, the float64
damped inverse, and the one-factor-at-a-time path (same eigenvalues to float32 round-off; a
batched solver may order its arithmetic differently, so eigenvectors are compared through
the factor they rebuild).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature import decomposition as decomposition_module
from dkfac.curvature.batching import (
    CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM,
    batched_decompositions_up_to,
)
from dkfac.curvature.decomposition import FactorRequest, decompose_factors
from dkfac.curvature.kronecker_factor import fold_sums


def trained_layers(device: str = "cpu") -> list[Any]:
    torch.manual_seed(0)
    # Three 16-wide hidden layers: A of the last three and G of the first three are 17 and 16.
    model = nn.Sequential(
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )
    model = model.to(device)
    pre = dkfac.KFACPreconditioner(model, inv_update_steps=100)
    x, y = torch.randn(64, 16, device=device), torch.randint(0, 4, (64,), device=device)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return list(pre.layers)


def requests_of(layers: list[Any]) -> list[FactorRequest]:
    return [FactorRequest(layer, side) for layer in layers for side in ("a", "g")]


def test_batched_eigendecompositions_rebuild_the_factors_as_one_at_a_time_does() -> None:
    layers = trained_layers()
    alone = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_up_to=0)
    batched = decompose_factors(
        requests_of(layers), "eigen", torch.float32, batch_up_to=sys.maxsize
    )
    assert len(alone) == len(batched) == 8
    for one, many, request in zip(alone, batched, requests_of(layers), strict=True):
        assert one is not None and many is not None
        assert list(one.tensors) == list(many.tensors)
        factor = request.layer.factor(request.side).double()
        scale = factor.abs().max()
        for result in (one, many):
            q, values = (t.double() for t in result.tensors.values())
            rebuilt = q @ torch.diag(values) @ q.t()  # oracle: Q diag(λ) Qᵀ is the factor
            torch.testing.assert_close(rebuilt, factor, atol=1e-5 * scale, rtol=0)
        torch.testing.assert_close(
            one.tensors[f"l{request.side}"],
            many.tensors[f"l{request.side}"],
            atol=1e-6 * scale,
            rtol=1e-5,
        )


def test_a_batch_whose_solver_fails_is_solved_one_factor_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = trained_layers()
    alone = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_up_to=0)
    real_eigh = torch.linalg.eigh
    calls: list[int] = []

    def no_batches(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(matrix.dim())
        if matrix.dim() == 3:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", no_batches)
    batched = decompose_factors(
        requests_of(layers), "eigen", torch.float32, batch_up_to=sys.maxsize
    )
    assert 3 in calls  # a batch was tried
    for one, many in zip(alone, batched, strict=True):
        assert one is not None and many is not None
        assert all(torch.equal(t, many.tensors[n]) for n, t in one.tensors.items())


def test_batches_are_capped_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = trained_layers()
    sizes: list[int] = []
    real = decomposition_module.EigenFactor.compute_many

    def spy(matrices: Any, sides: Any, dtype: torch.dtype) -> Any:
        sizes.append(len(matrices))
        return real(matrices, sides, dtype)

    monkeypatch.setattr(decomposition_module.EigenFactor, "compute_many", spy)
    monkeypatch.setattr(decomposition_module, "BATCH_BYTES", 2 * 17 * 17 * 4)
    decompose_factors(requests_of(layers), "eigen", torch.float32, batch_up_to=sys.maxsize)
    assert max(sizes) == 2 and sum(sizes) == 8  # every factor in a batch of at most 2


@pytest.mark.parametrize(("up_to", "batched"), [(0, []), (3, []), (16, [4, 16]), (17, [4, 16, 17])])
def test_only_factors_up_to_the_limit_are_batched(
    up_to: int, batched: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four 17-wide A's, three 16-wide G's and a 4-wide one: each size batched (one call per
    # size) only up to the limit; every factor decomposed once either way.
    layers = trained_layers()
    widths: list[int] = []
    real = decomposition_module.EigenFactor.compute_many

    def spy(matrices: Any, sides: Any, dtype: torch.dtype) -> Any:
        widths.append(int(matrices[0].shape[0]))
        return real(matrices, sides, dtype)

    monkeypatch.setattr(decomposition_module.EigenFactor, "compute_many", spy)
    results = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_up_to=up_to)
    assert sorted(widths) == batched
    assert all(result is not None and bool(result.ok) for result in results)


@pytest.mark.parametrize(
    ("option", "device", "expected"),
    [
        (None, "cpu", 0),
        (None, "cuda", CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM),
        (True, "cpu", sys.maxsize),
        (False, "cuda", 0),
        (600, "cpu", 600),
    ],
)
def test_batched_decompositions_resolves_per_device(
    option: bool | int | None, device: str, expected: int
) -> None:
    assert CUDA_BATCHED_DECOMPOSITIONS_MAX_DIM == 512  # set from per-width H200 timings
    assert batched_decompositions_up_to(option, torch.device(device)) == expected


@pytest.mark.parametrize("value", [1, 0, 2.5, "yes"])
def test_batched_decompositions_refuses_what_is_not_a_switch_or_a_width(value: object) -> None:
    with pytest.raises(ValueError, match="expected None, True, False or an integer >= 2"):
        dkfac.KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), batched_decompositions=value)


@pytest.mark.parametrize("device", [on_cuda(CUDA_TEST_DEVICE.type)])
def test_whether_a_factor_decomposes_the_same_whatever_it_is_batched_with(device: str) -> None:
    """Whether a factor's batched result depends on its companions. On the CPU it does
    (LAPACK's kernels round differently at another memory alignment: seen here with one
    thread), which is one reason batching is off by default there and why a factor is batched
    only with factors of its own domain (who decomposes it: the same companions on every worker
    that does); a GPU session checks the GPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers = trained_layers(device)
        requests = requests_of(layers)
        together = decompose_factors(requests, "eigen", torch.float32, batch_up_to=sys.maxsize)
        same = []
        for index, request in enumerate(requests):
            (alone,) = decompose_factors([request], "eigen", torch.float32, batch_up_to=sys.maxsize)
            assert alone is not None and together[index] is not None
            same.append(
                all(torch.equal(t, together[index].tensors[n]) for n, t in alone.tensors.items())
            )
    finally:
        torch.set_num_threads(threads)
    assert all(same), same


def shifted_requests(layers: list[Any], shift: float = 0.05) -> list[FactorRequest]:
    return [
        FactorRequest(layer, side, torch.tensor(shift)) for layer in layers for side in ("a", "g")
    ]


def test_batched_cholesky_inverses_are_the_damped_inverses() -> None:
    """Oracle: the float64 inverse of ``F + shift·I``; the one-at-a-time path to round-off;
    each result exactly symmetric and row-major, as the one-at-a-time result is."""
    layers = trained_layers()
    requests = shifted_requests(layers)
    alone = decompose_factors(requests, "inverse", torch.float32, batch_up_to=0)
    batched = decompose_factors(requests, "inverse", torch.float32, batch_up_to=sys.maxsize)
    for one, many, request in zip(alone, batched, requests, strict=True):
        assert one is not None and many is not None and list(one.tensors) == list(many.tensors)
        (name,) = many.tensors
        factor = request.layer.factor(request.side).double()
        want = torch.linalg.inv(factor + 0.05 * torch.eye(factor.shape[0], dtype=torch.float64))
        scale = want.abs().max()
        got = many.tensors[name]
        assert got.is_contiguous() and torch.equal(got, got.t())
        assert got.untyped_storage().nbytes() == got.numel() * got.itemsize  # not the batch's
        torch.testing.assert_close(got.double(), want, atol=1e-4 * scale, rtol=0)
        torch.testing.assert_close(got, one.tensors[name], atol=1e-5 * scale, rtol=0)


def test_a_batched_cholesky_that_fails_for_one_factor_fails_for_it_alone() -> None:
    """One factor made indefinite (its shift cannot rescue it, in float64 either): only its
    result is ``None``; the others of its batch are the damped inverses."""
    layers = trained_layers()
    requests = shifted_requests(layers, shift=1e-3)
    bad = requests[2]  # A of the second layer: 17 x 17, in a batch with the other A's
    assert bad.side == "a"
    running = bad.layer.factor("a")
    bad.layer.set_factor("a", running - 10.0 * torch.eye(running.shape[0]))
    with pytest.warns(RuntimeWarning, match="decomposition failed"):
        results = decompose_factors(requests, "inverse", torch.float32, batch_up_to=sys.maxsize)
    assert results[2] is None
    assert all(result is not None for i, result in enumerate(results) if i != 2)
    assert bad.layer.health().failed_decompositions == 1
    # The others succeeded in their batch: none was redone in float64.
    assert all(layer.health().retried_in_float64 == 0 for layer in layers)
    assert all(r.tensors[f"{r.side}_inv"].dtype == torch.float32 for r in results if r is not None)


def test_factors_of_different_domains_are_never_batched_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = trained_layers()
    sizes: list[int] = []
    real = decomposition_module.CholeskyFactor.compute_many

    def spy(matrices: Any, sides: Any, dtype: torch.dtype, shifts: Any) -> Any:
        sizes.append(len(matrices))
        return real(matrices, sides, dtype, shifts)

    monkeypatch.setattr(decomposition_module.CholeskyFactor, "compute_many", spy)
    # The four A's (17 x 17) in two domains of two; the G's: 16 x 16 three times, 4 x 4 once.
    requests = [
        FactorRequest(r.layer, r.side, r.shift, domain=(index // 2) % 2 if r.side == "a" else -1)
        for index, r in enumerate(shifted_requests(layers))
    ]
    decompose_factors(requests, "inverse", torch.float32, batch_up_to=sys.maxsize)
    assert sorted(sizes) == [1, 2, 2, 3]


@pytest.mark.parametrize("batch_up_to", [0, sys.maxsize])
def test_a_decomposition_counts_each_factors_own_dropped_batches(batch_up_to: int) -> None:
    """Three folds of all eight factors together (one shared flags tensor each) and one of a
    factor alone drop the batches marked NaN; the decomposition reads every flag in one go
    and counts each layer's own: the layers' counts differ, so an entry read for another
    factor's would show."""
    layers = trained_layers()
    factors = [layer.factors[side] for layer in layers for side in ("a", "g")]
    nan_at = [{0, 3}, {3, 5}, {5, 6, 7}]  # per fold, the factors whose batch is NaN
    for marked in nan_at:
        totals = [factor.value().clone() for factor in factors]
        for index in marked:
            totals[index][0, 0] = float("nan")
        fold_sums(factors, totals, torch.ones(8, dtype=torch.float64), 0.9, stack_bytes=1 << 20)
    alone = factors[7].value().clone()
    alone[1, 1] = float("inf")
    factors[7].fold(alone, 0.9)
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        decompose_factors(requests_of(layers), "eigen", torch.float32, batch_up_to=batch_up_to)
    dropped = [0] * 8
    for marked in nan_at:
        for index in marked:
            dropped[index] += 1
    dropped[7] += 1
    want = [dropped[2 * i] + dropped[2 * i + 1] for i in range(4)]
    assert want == [1, 2, 2, 3]
    assert [layer.health().nonfinite_batches for layer in layers] == want
    assert all(factor.take_nonfinite_count() is None for factor in factors)  # all taken
