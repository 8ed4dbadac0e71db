"""Placement planners against brute force on small random instances."""

from __future__ import annotations

import itertools
import random

import pytest

from dkfac.strategies.placement import (
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


def resnet50_factor_dims() -> list[int]:
    """Factor widths of torchvision's ResNet-50 in ready order: A forward, then G reversed."""
    layers = [(3 * 7 * 7, 64)]  # conv1: (d_A, d_G); convs have no bias
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            layers += [(channels, width), (9 * width, width), (width, 4 * width)]
            if block == 0:
                layers.append((channels, 4 * width))  # downsample, run after conv3
            channels = 4 * width
    layers.append((2048 + 1, 1000))  # fc with bias
    return [a for a, _ in layers] + [g for _, g in reversed(layers)]


def bottleneck_by_search(costs: list[float], workers: int) -> float:
    """Optimal largest block, independently of the DP: the smallest candidate (a contiguous
    sum) for which greedy left-to-right packing needs at most ``workers`` blocks."""
    candidates = sorted(
        {sum(costs[i:j]) for i in range(len(costs)) for j in range(i + 1, len(costs) + 1)}
    )

    def blocks_needed(limit: float) -> int:
        count, load = 1, 0.0
        for cost in costs:
            if cost > limit:
                return len(costs) + 1
            if load + cost > limit:
                count, load = count + 1, 0.0
            load += cost
        return count

    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if blocks_needed(candidates[middle]) <= workers:
            high = middle
        else:
            low = middle + 1
    return candidates[low]


def test_contiguous_partition_of_the_real_resnet50_factor_list() -> None:
    dims = resnet50_factor_dims()
    assert len(dims) == 2 * 54 and max(dims) == 4608
    costs = [float(d) ** 3 for d in dims]  # decomposition ~ d³, in units of one multiply-add
    for workers in (2, 4, 8, 64):
        owners = plan_contiguous_partition(costs, workers)
        assert owners == sorted(owners)
        assert largest_block_cost(owners, costs) == bottleneck_by_search(costs, workers)
    # By hand: the three 4608-wide A factors are the 3x3 convs of the last stage, layers 44,
    # 48 and 51 (after conv1 and 3+4+6 blocks of 3 convs plus 3 downsamples). They cost
    # 4608³ each and nothing else comes close (the 2304-wide ones are 8x cheaper), so with
    # 64 workers the optimum is one of them alone: 4608³.
    assert [i for i, d in enumerate(dims) if d == 4608] == [44, 48, 51]
    assert largest_block_cost(plan_contiguous_partition(costs, 64), costs) == 4608.0**3
    # With 2 workers the cut must separate them: the best block holds at least two of the
    # three (2·4608³) plus everything around them on its side of the cut.
    assert largest_block_cost(plan_contiguous_partition(costs, 2), costs) >= 2 * 4608.0**3
