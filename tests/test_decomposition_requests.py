"""What a rank asks to decompose at a decomposition step, and with whom it may be batched.

A factor every worker decomposes must end with the same bits on every worker (each
preconditions with it). Batched decompositions make a factor's result depend on its batch
by round-off, so its batch companions, and the float64 retry's shift, must not depend on
the rank. The plan below is the case where they could: layer 0's ``G`` is kept by rank 0
alone, so only rank 0 knows whether it exists yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

from dkfac.curvature import decomposition
from dkfac.strategies.decomposition_requests import (
    batching_domain,
    decomposes_now,
    factor_request,
)
from dkfac.strategies.plan import (
    EVERY_WORKER,
    DecompositionShare,
    FactorRoute,
    Placement,
)


@dataclass
class FakeLayer:
    """What the request functions read of a layer: its running factors."""

    factors: dict[str, Tensor | None] = field(default_factory=dict)

    def factor(self, side: str) -> Tensor | None:
        return self.factors.get(side)


def mixed_plan() -> Placement:
    """Two layers of equal shapes: ``A`` (5 wide) every worker decomposes in both; layer 0's
    ``G`` (3 wide) reduced to rank 0 and decomposed there, layer 1's everywhere."""
    routes = (
        FactorRoute(0, "a", 5, None, EVERY_WORKER),
        FactorRoute(0, "g", 3, 0, 0),
        FactorRoute(1, "a", 5, None, EVERY_WORKER),
        FactorRoute(1, "g", 3, None, EVERY_WORKER),
    )
    shares = (DecompositionShare(0, (((0, "g"),),), (0, 1)),)
    return Placement(2, "hooks", routes, shares, buckets=((0,), (1,), (2, 3)))


def layers_for(rank: int, plan: Placement, missing: set[tuple[int, str]]) -> list[Any]:
    """Each rank's view: the factors it keeps, except those in ``missing`` (none yet)."""
    layers = [FakeLayer(), FakeLayer()]
    for route in plan.factors:
        if plan.holds_factor(route, rank) and route.key not in missing:
            layers[route.layer].factors[route.side] = torch.eye(route.dim)
    return layers


def test_a_factor_whose_decomposition_depends_on_the_rank_is_decomposed_alone() -> None:
    plan = mixed_plan()
    assert batching_domain(plan, plan.route((0, "a"))) == ("alone", (0, "a"))
    assert batching_domain(plan, plan.route((1, "a"))) == EVERY_WORKER
    assert batching_domain(plan, plan.route((1, "g"))) == EVERY_WORKER
    assert batching_domain(plan, plan.route((0, "g"))) == 0


def batches_per_rank(
    missing: set[tuple[int, str]], monkeypatch: pytest.MonkeyPatch
) -> dict[int, dict[str, list[Any]]]:
    """Per rank, what the decomposition step's grouping (``decompose_factors``' first
    attempts, batching every width) hands to the batched solver ("batched": one list per
    call) and to the one-at-a-time one ("alone"): ``(factor, damping)`` each."""
    plan = mixed_plan()
    shifts = torch.full((2, 2), 0.01)
    calls: dict[str, list[Any]] = {}

    def batched(requests: Any, method: str, dtype: torch.dtype) -> list[None]:
        calls["batched"].append([(keys[id(r)], r.damping) for r in requests])
        return [None] * len(requests)

    def alone(request: Any, method: str, dtype: torch.dtype, **kwargs: Any) -> None:
        calls["alone"].append((keys[id(request)], request.damping))

    monkeypatch.setattr(decomposition, "_decompose_batch", batched)
    monkeypatch.setattr(decomposition, "_try_decompose", alone)
    result: dict[int, dict[str, list[Any]]] = {}
    for rank in range(2):
        layers = layers_for(rank, plan, missing)
        mine = [route for route in plan.factors if decomposes_now(plan, rank, layers, route)]
        requests = [factor_request(plan, layers, route, shifts, 1e-3) for route in mine]
        keys = {id(request): route.key for request, route in zip(requests, mine, strict=True)}
        calls = {"batched": [], "alone": []}
        decomposition._first_attempts(requests, "inverse", torch.float32, sys.maxsize)
        result[rank] = calls
    return result


def test_every_workers_batches_are_the_same_on_every_worker_before_a_factor_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 0's ``G`` does not exist yet (its backward has not run): rank 0, which keeps it,
    skips layer 0's ``A``; rank 1 cannot know and decomposes it. Before the domains depended
    on the plan, rank 1 batched it with layer 1's ``A`` and rank 0 did not: layer 1's ``A``
    then came out of two different batches, a round-off apart."""
    batches = batches_per_rank({(0, "g")}, monkeypatch)
    every_worker = [[((1, "a"), 1e-3)], [((1, "g"), 1e-3)]]
    assert batches[0]["batched"] == every_worker
    # Layer 0's A: skipped by rank 0; alone on rank 1, with no float64 shift recomputation.
    assert sorted(batches[1]["batched"]) == sorted([*every_worker, [((0, "a"), None)]])
    assert batches[0]["alone"] == batches[1]["alone"] == []


def test_with_every_factor_present_the_mixed_layer_still_decomposes_alone_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = batches_per_rank(set(), monkeypatch)
    every_worker = [[((0, "a"), None)], [((1, "a"), 1e-3)], [((1, "g"), 1e-3)]]
    # Rank 0 also decomposes layer 0's G, which it keeps with the layer's A: the shift can be
    # recomputed in float64 there.
    assert sorted(batches[0]["batched"]) == sorted([*every_worker, [((0, "g"), 1e-3)]])
    assert sorted(batches[1]["batched"]) == sorted(every_worker)
