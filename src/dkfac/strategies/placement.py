"""Placement planners: which worker does which piece of work.

Pure, deterministic functions of their arguments: every rank computes the same plan with no
communication. Ties are always broken by the lower index (item or worker).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def _check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is not allowed: expected an integer >= 1")


def _check_costs(costs: Sequence[float]) -> None:
    for index, cost in enumerate(costs):
        if not cost >= 0:  # also rejects NaN
            raise ValueError(f"costs[{index}]={cost!r} is not allowed: expected a number >= 0")


def round_robin(items: int, workers: int) -> list[int]:
    """Item ``i`` goes to worker ``i mod workers``."""
    _check_workers(workers)
    return [index % workers for index in range(items)]


def longest_processing_time(costs: Sequence[float], workers: int) -> list[int]:
    """Greedy LPT: items in decreasing cost, each to the currently least-loaded worker.

    Args:
        costs: cost of each item (e.g. ``d³`` for a decomposition).
        workers: number of workers.

    Returns:
        The worker of each item, in item order.
    """
    _check_workers(workers)
    _check_costs(costs)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, worker) for worker in range(workers)]
    owner = [0] * len(costs)
    for item in order:
        load, worker = heapq.heappop(loads)
        owner[item] = worker
        heapq.heappush(loads, (load + costs[item], worker))
    return owner


def worker_loads(owners: Sequence[int], costs: Sequence[float], workers: int) -> list[float]:
    """Total cost per worker of an assignment."""
    loads = [0.0] * workers
    for owner, cost in zip(owners, costs, strict=True):
        loads[owner] += cost
    return loads


def plan_contiguous_partition(costs: Sequence[float], workers: int) -> list[int]:
    """Optimal split of an ordered list into at most ``workers`` contiguous blocks.

    Minimises the largest block cost (the "linear partition" problem) by dynamic programming
    over prefix sums, O(workers · n²). Ties are broken deterministically (fewest blocks, then
    the earliest cut found); block ``k`` goes to worker ``k``.

    Returns:
        The worker (block index) of each item, non-decreasing along the list.
    """
    _check_workers(workers)
    _check_costs(costs)
    n = len(costs)
    if n == 0:
        return []
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    blocks = min(workers, n)
    # best[k][i]: minimal largest block cost splitting items[:i] into k blocks.
    best = [[inf] * (n + 1) for _ in range(blocks + 1)]
    cut = [[0] * (n + 1) for _ in range(blocks + 1)]
    best[0][0] = 0.0
    for k in range(1, blocks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    target = min(best[k][n] for k in range(1, blocks + 1))
    k = min(k for k in range(1, blocks + 1) if best[k][n] == target)
    owner = [0] * n
    end = n
    while k > 0:
        start = cut[k][end]
        for i in range(start, end):
            owner[i] = k - 1
        end, k = start, k - 1
    return owner


def largest_block_cost(owners: Sequence[int], costs: Sequence[float]) -> float:
    """The cost of the most loaded block/worker of an assignment."""
    loads: dict[int, float] = {}
    for owner, cost in zip(owners, costs, strict=True):
        loads[owner] = loads.get(owner, 0.0) + cost
    return max(loads.values(), default=0.0)
