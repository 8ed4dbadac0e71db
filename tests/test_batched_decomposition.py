"""Equal-size factors eigendecomposed in one batched call (``batch_equal_sizes``, off by default).

Oracles: each factor rebuilt in float64 from its eigenvectors and eigenvalues, and the
one-factor-at-a-time path (same eigenvalues to float32 round-off; a batched solver may order
its arithmetic differently, so eigenvectors are compared through the factor they rebuild).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature import decomposition as decomposition_module
from dkfac.curvature.decomposition import FactorRequest, decompose_factors


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
    pre = dkfac.KFACPreconditioner(model, inv_update_steps=100)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return list(pre.layers)


def requests_of(layers: list[Any]) -> list[FactorRequest]:
    return [FactorRequest(layer, side) for layer in layers for side in ("a", "g")]


def test_batched_eigendecompositions_rebuild_the_factors_as_one_at_a_time_does() -> None:
    layers = trained_layers()
    alone = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_equal_sizes=False)
    batched = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_equal_sizes=True)
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
    alone = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_equal_sizes=False)
    real_eigh = torch.linalg.eigh
    calls: list[int] = []

    def no_batches(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(matrix.dim())
        if matrix.dim() == 3:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", no_batches)
    batched = decompose_factors(requests_of(layers), "eigen", torch.float32, batch_equal_sizes=True)
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
    decompose_factors(requests_of(layers), "eigen", torch.float32, batch_equal_sizes=True)
    assert max(sizes) == 2 and sum(sizes) == 8  # every factor in a batch of at most 2


@pytest.mark.parametrize("device", [on_cuda(CUDA_TEST_DEVICE.type)])
def test_whether_a_factor_decomposes_the_same_whatever_it_is_batched_with(device: str) -> None:
    """Workers that decompose a factor redundantly (SPD's small ones) batch it with different
    companions; its result must not depend on them for batching to be safe. Not so on the
    CPU (LAPACK's kernels round differently at another memory alignment: seen here with one
    thread), which is why batching is off by default; a GPU session checks the GPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers = trained_layers(device)
        requests = requests_of(layers)
        together = decompose_factors(requests, "eigen", torch.float32, batch_equal_sizes=True)
        same = []
        for index, request in enumerate(requests):
            (alone,) = decompose_factors([request], "eigen", torch.float32, batch_equal_sizes=True)
            assert alone is not None and together[index] is not None
            same.append(
                all(torch.equal(t, together[index].tensors[n]) for n, t in alone.tensors.items())
            )
    finally:
        torch.set_num_threads(threads)
    assert all(same), same
