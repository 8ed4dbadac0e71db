"""Placement planners against brute force on small random instances."""

from __future__ import annotations

import itertools
import random

import pytest

from dkfac.distributed.placement import (
    largest_block_cost,
    longest_processing_time,
    plan_contiguous_partition,
    round_robin,
    worker_loads,
)


def brute_force_contiguous(costs: list[float], workers: int) -> float:
    """Smallest largest-block cost over every way to cut the list into <= workers blocks."""
    n = len(costs)
    best = float("inf")
    for blocks in range(1, min(workers, n) + 1):
        for cuts in itertools.combinations(range(1, n), blocks - 1):
            bounds = [0, *cuts, n]
            best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_contiguous_partition_is_optimal_and_contiguous(seed: int) -> None:
    rng = random.Random(seed)
    costs = [float(rng.randint(0, 50)) for _ in range(rng.randint(1, 9))]
    workers = rng.randint(1, 5)
    owners = plan_contiguous_partition(costs, workers)
    assert owners == sorted(owners) and owners[0] == 0
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(owners))
    assert max(owners) < workers
    assert largest_block_cost(owners, costs) == brute_force_contiguous(costs, workers)


def test_contiguous_partition_of_a_resnet50_shaped_list() -> None:
    # Decomposition cost d³ of ResNet-50's factors in ready order is dominated by the few
    # 4608-wide (3x3x512) A factors; with 4 workers each must sit in a block of its own.
    # By hand: the first block starts at item 0, so it holds the six small items and, unless
    # two large items are to share a block (>= 200), the first large one: 106 is optimal,
    # reached by [6x1, 100] [1, 1, 1, 100] [100, 1, 1, 1, 1] [100].
    costs = [1.0] * 6 + [100.0] + [1.0] * 3 + [100.0, 100.0] + [1.0] * 4 + [100.0]
    owners = plan_contiguous_partition(costs, 4)
    assert largest_block_cost(owners, costs) == brute_force_contiguous(costs, 4) == 106.0


def brute_force_lpt(costs: list[float], workers: int) -> list[int]:
    """LPT written as its definition: sort by cost desc (index asc), least loaded (lowest id)."""
    loads = [0.0] * workers
    owner = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(workers), key=lambda w: (loads[w], w))
        owner[item] = target
        loads[target] += costs[item]
    return owner


@pytest.mark.parametrize("seed", range(40))
def test_lpt_matches_its_definition_and_the_4_3_bound(seed: int) -> None:
    rng = random.Random(seed)
    costs = [float(rng.randint(1, 1000)) for _ in range(rng.randint(1, 8))]
    workers = rng.randint(1, 4)
    owners = longest_processing_time(costs, workers)
    assert owners == brute_force_lpt(costs, workers)
    optimum = min(
        max(worker_loads(list(assign), costs, workers))
        for assign in itertools.product(range(workers), repeat=len(costs))
    )
    assert max(worker_loads(owners, costs, workers)) <= (4 / 3) * optimum + 1e-9


def test_round_robin_and_determinism() -> None:
    assert round_robin(5, 2) == [0, 1, 0, 1, 0]
    costs = [3.0, 3.0, 2.0, 2.0]
    assert longest_processing_time(costs, 2) == longest_processing_time(list(costs), 2)


@pytest.mark.parametrize(
    "call",
    [
        lambda: round_robin(3, 0),
        lambda: longest_processing_time([1.0, -1.0], 2),
        lambda: plan_contiguous_partition([float("nan")], 2),
    ],
)
def test_bad_planner_input_raises(call) -> None:
    with pytest.raises(ValueError, match="is not allowed"):
        call()
