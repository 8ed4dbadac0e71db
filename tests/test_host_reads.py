"""What a K-FAC step waits for on a GPU: host reads per step, counted on every strategy.

A factor update that decomposes nothing reads nothing back (its counts fold on the device);
a decomposition step reads its flags once per phase. Counted with :class:`HostReadSpy` on
the CPU (the same calls wait for the GPU there); ``tests/test_cuda.py`` checks the same with
CUDA's own detector when a GPU is present.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.curvature.kronecker_factor import KroneckerFactor, fold_sums
from host_reads import HostReadSpy

STRATEGIES = ("dkfac", "kaisa", "spd", "pad", "dp")


def test_fold_sums_is_fold_where_counted_and_keeps_the_average_where_not() -> None:
    torch.manual_seed(0)
    decay = 0.9
    running = torch.randn(4, 4)
    totals = [torch.randn(4, 4) * 5, torch.randn(4, 4)]
    factors = [KroneckerFactor("a", 4, torch.float32) for _ in totals]
    for factor in factors:
        factor.running = running.clone()
    fold_sums(factors, totals, torch.tensor([3.0, 0.0], dtype=torch.float64), decay)
    # Oracle: the running-average formula in float64, then the uncounted factor untouched.
    expected = running.double() * decay + (totals[0].double() / 3) * (1 - decay)
    torch.testing.assert_close(factors[0].running.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(factors[1].running, running)
    # Bitwise the host path's fold(total / count) where counted.
    reference = KroneckerFactor("a", 4, torch.float32)
    reference.running = running.clone()
    reference.fold(totals[0] / 3.0, decay)
    assert torch.equal(factors[0].running, reference.running)
    # A counted batch with an Inf is dropped and counted, as fold drops and counts it; an
    # uncounted one (count 0) is neither.
    bad = [torch.full((4, 4), float("inf")), torch.full((4, 4), float("nan"))]
    before = [factor.value().clone() for factor in factors]
    factors[0].take_nonfinite_count(), factors[1].take_nonfinite_count()
    fold_sums(factors, bad, torch.tensor([2.0, 0.0], dtype=torch.float64), decay)
    assert all(torch.equal(f.value(), old) for f, old in zip(factors, before, strict=True))
    assert [int(f.take_nonfinite_count()) for f in factors] == [1, 0]
    # A first estimate (no running average yet) takes the host path: nothing for count 0.
    fresh = [KroneckerFactor("g", 4, torch.float32) for _ in totals]
    fold_sums(fresh, totals, torch.tensor([2.0, 0.0], dtype=torch.float64), decay)
    assert torch.equal(fresh[0].running, totals[0] / 2.0)
    assert fresh[1].running is None


def _reads_per_step(rank: int, world: int, stacked: bool) -> dict[str, list[list[tuple[str, str]]]]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 3, 8, 8, generator=generator)
    y = torch.randint(0, 10, (16,), generator=generator)
    result: dict[str, list[list[tuple[str, str]]]] = {}
    for strategy in STRATEGIES:
        model = nn.Sequential(  # two equal-shaped layers: stacked folds when ``stacked``
            nn.Conv2d(3, 8, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 3 * 3, 10),
            nn.Tanh(),
            nn.Linear(10, 10),
            nn.Tanh(),
            nn.Linear(10, 10),
        )
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = dkfac.KFACPreconditioner(
            ddp,
            strategy=strategy,
            factor_update_steps=2,
            inv_update_steps=4,
            lr=0.1,
            batched_factor_updates=stacked,
        )
        reads = []
        with pytest.MonkeyPatch.context() as patch:
            spy = HostReadSpy(patch)
            for _ in range(5):
                optimizer.zero_grad()
                loss = F.cross_entropy(ddp(x), y)
                spy.take()
                loss.backward()
                pre.step()
                reads.append(spy.take())
                optimizer.step()
        pre.remove()
        result[strategy] = reads
    return result


@pytest.mark.parametrize("stacked", [False, True])
def test_steps_without_decompositions_read_nothing_on_two_workers(stacked: bool) -> None:
    """Steps 1-3 (factors at 2, decompositions at 0 and 4) on two gloo workers, factors
    folded one at a time or stacked."""
    results: list[Any] = run_workers(_reads_per_step, world_size=2, args=(stacked,), timeout=180)
    for rank, by_strategy in enumerate(results):
        for strategy, reads in by_strategy.items():
            where = f"rank {rank}, {strategy}"
            assert reads[1] == [] and reads[3] == [], (where, reads)
            factor_step = {module for _, module in reads[2]}
            if strategy in ("spd", "pad"):
                # The hooks' pipeline agrees on late statistics (a layer used after its
                # hand-over) with its counts: one read per factor update.
                assert reads[2] == [("tolist", "dkfac.strategies.pipeline")], (where, reads[2])
            else:  # counts fold on the device
                assert factor_step == set(), (where, reads[2])
            decomposition = [module for _, module in reads[4]]
            assert decomposition.count("dkfac.curvature.decomposition") == 1, (where, reads[4])
            assert len(decomposition) <= (3 if strategy in ("spd", "pad") else 2), (where, reads[4])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fold_sums_divides_16_bit_sums_as_the_host_path_does(dtype: torch.dtype) -> None:
    """A count above float16's range (65504) must not turn the batch factor into zeros."""
    total = torch.full((2, 2), 1000.0, dtype=dtype)
    count = torch.tensor(131072.0, dtype=torch.float64)
    counted = KroneckerFactor("a", 2, dtype)
    counted.running = torch.ones(2, 2, dtype=dtype)
    fold_sums([counted], [total], count.reshape(1), 0.5)
    host = KroneckerFactor("a", 2, dtype)
    host.running = torch.ones(2, 2, dtype=dtype)
    host.fold(total / 131072.0, 0.5)
    assert torch.equal(counted.running, host.running)
    expected = 0.5 + 0.5 * 1000.0 / 131072.0  # oracle in float64
    torch.testing.assert_close(
        counted.running.double(),
        torch.full((2, 2), expected, dtype=torch.float64),
        rtol=1e-2,
        atol=0,
    )
