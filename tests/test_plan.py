"""Placements as data (who keeps, decomposes and receives what) and the recording communicator.

The runner that executes placements is checked end to end by the equivalence tests
(test_distributed, test_dp, test_pipelined: every strategy against the single-process run on
the global batch) and by the dry run's byte counts (test_accounting); here the plans' own
rules are checked against hand-worked cases.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.recording import RecordingCommunicator
from dkfac.curvature.layer_stacks import LayerStacks
from dkfac.strategies.dp import dp_placement, plan_layer_owners
from dkfac.strategies.factor_placement import choose_share
from dkfac.strategies.gradient_shares import GradientShares
from dkfac.strategies.kaisa import kaisa_placement
from dkfac.strategies.kaisa import plan_layer_owners as kaisa_owners
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.placement import plan_contiguous_partition
from dkfac.strategies.plan import (
    EVERY_WORKER,
    DecompositionShare,
    FactorRoute,
    GradientShare,
    Placement,
    gradient_shares,
    layer_owner_routes,
)
from dkfac.strategies.spd import SPDStrategy
from test_distributed import build, reference_run, train, tri
from test_pipelined import COST

DIMS = [(5, 8), (9, 64), (65, 3), (4, 4), (33, 17)]


def test_kaisa_rows_hold_decompositions_and_columns_receive_gradients() -> None:
    world, grad_workers = 4, 2  # rows [0, 1] and [2, 3]; columns [0, 2] and [1, 3]
    owners = kaisa_owners(DIMS, world)
    plan = kaisa_placement(DIMS, world, grad_workers)
    assert plan.exchange == "step"
    for layer, owner in enumerate(owners):
        row = {owner - owner % 2, owner - owner % 2 + 1}
        for rank in range(world):
            assert plan.holds_inverse(layer, rank) == (rank in row)
            assert plan.captures(layer, rank)  # every rank adds to the allreduced factors
            for side in "ag":
                route = plan.route((layer, side))
                assert plan.holds_factor(route, rank)
                assert plan.decomposes(route, rank) == (rank == owner)
    # One decomposition share per owner, inside its row; one gradient share per source and
    # column: the row member of that column.
    assert {(s.source, s.group) for s in plan.decompositions} == {
        (o, (o - o % 2, o - o % 2 + 1)) for o in owners
    }
    for share in plan.gradients:
        assert share.group in ((0, 2), (1, 3)) and share.source in share.group
        for layer in share.layers:
            assert share.source // 2 == owners[layer] // 2
    assert plan.group_layouts()[:2] == [(0, 1), (2, 3)]


def test_kaisa_extremes_share_only_what_moves() -> None:
    world = 4
    comm_opt = kaisa_placement(DIMS, world, world)  # D-KFAC: decompositions to all, no grads
    assert comm_opt.gradients == () and comm_opt.group_layouts() == [(0, 1, 2, 3)]
    assert all(comm_opt.holds_inverse(layer, rank) for layer in range(5) for rank in range(4))
    mem_opt = kaisa_placement(DIMS, world, 1)  # only owners hold; gradients to all
    owners = kaisa_owners(DIMS, world)
    assert mem_opt.decompositions == ()
    for layer, owner in enumerate(owners):
        assert [mem_opt.holds_inverse(layer, r) for r in range(4)] == [r == owner for r in range(4)]
    assert {share.source for share in mem_opt.gradients} == set(owners)


def test_dp_owners_capture_keep_and_decompose_alone() -> None:
    world = 3
    owners = plan_layer_owners(DIMS, world)
    plan = dp_placement(DIMS, world)
    for layer, owner in enumerate(owners):
        for rank in range(world):
            mine = rank == owner
            assert plan.captures(layer, rank) == mine
            assert plan.holds_inverse(layer, rank) == mine
            assert all(plan.holds_factor(plan.route((layer, s)), rank) == mine for s in "ag")
    assert plan.decomposition_work(owners[1]) >= 9**3 + 64**3
    assert not plan.exchanges_traces()  # an owner holds both of its factors
    assert plan.describe([f"l{i}" for i in range(5)])[0]["reduced_to"] == (
        "none (owner's shard only)"
    )


def test_factors_reduced_to_owners_are_captured_everywhere_and_need_traces() -> None:
    # PAD's shape: each factor reduced to the rank that decomposes it; A and G of layer 0 on
    # different ranks, so the Tikhonov π needs the traces from both.
    routes = (
        FactorRoute(0, "a", 5, 0, 0),
        FactorRoute(0, "g", 8, 1, 1),
    )
    shares = (
        DecompositionShare(0, (((0, "a"),),), (0, 1)),
        DecompositionShare(1, (((0, "g"),),), (0, 1)),
    )
    plan = Placement(2, "hooks", routes, shares, buckets=((0,), (1,)))
    assert plan.captures(0, 0) and plan.captures(0, 1)  # both contribute to each reduce
    assert plan.holds_factor(routes[0], 0) and not plan.holds_factor(routes[0], 1)
    assert plan.holds_inverse(0, 0) and plan.holds_inverse(0, 1)
    assert plan.exchanges_traces()
    everywhere = Placement(
        2,
        "hooks",
        (FactorRoute(0, "a", 5, None, EVERY_WORKER), FactorRoute(0, "g", 8, None, EVERY_WORKER)),
        buckets=((0, 1),),
    )
    assert not everywhere.exchanges_traces()
    assert everywhere.decomposition_work(1) == 5**3 + 8**3


#: Two layers, (d_A, d_G) = (3, 2) and (5, 4), and what PAD's share="auto" weighs for them.
TWO_LAYERS = [(3, 2), (5, 4)]


@pytest.mark.parametrize(
    ("method", "steps", "decomposition_bytes", "mode"),
    [
        # Eigen: Q and λ per factor, 9+3 + 4+2 + 25+5 + 16+4 = 68 float32 values = 272 bytes
        # per decomposition step; the gradients 2·3 + 4·5 = 26 values = 104 bytes every step.
        ("eigen", 1, 272.0, "gradients"),
        ("eigen", 2, 136.0, "gradients"),
        ("eigen", 100, 2.72, "decompositions"),
        # Inverse: packed upper triangles, 6 + 3 + 15 + 10 = 34 values = 136 bytes.
        ("inverse", 1, 136.0, "gradients"),
        ("inverse", 2, 68.0, "decompositions"),
        ("inverse", 100, 1.36, "decompositions"),
    ],
)
def test_pad_auto_shares_what_moves_fewer_bytes_per_step(
    method: str, steps: int, decomposition_bytes: float, mode: str
) -> None:
    choice = choose_share(
        "auto",
        TWO_LAYERS,
        inverse_method=method,
        inv_dtype=torch.float32,
        grad_dtype=torch.float32,
        inv_update_steps=steps,
    )
    assert choice.report() == {
        "requested": "auto",
        "mode": mode,
        "inv_update_steps": steps,
        "decomposition_bytes_per_step": pytest.approx(decomposition_bytes),
        "gradient_bytes_per_step": 104,
    }
    # The element sizes enter: float64 gradients (208 bytes) lose to eigen's 272 / 2.
    wide = choose_share(
        "auto",
        TWO_LAYERS,
        inverse_method="eigen",
        inv_dtype=torch.float32,
        grad_dtype=torch.float64,
        inv_update_steps=2,
    )
    assert (wide.mode, wide.gradient_bytes_per_step) == ("decompositions", 208)
    # A mode given is kept whatever the bytes say; a tie keeps the decompositions.
    for given in ("decompositions", "gradients"):
        kept = choose_share(
            given,
            TWO_LAYERS,
            inverse_method=method,
            inv_dtype=torch.float32,
            grad_dtype=torch.float32,
            inv_update_steps=steps,
        )
        assert (kept.requested, kept.mode) == (given, given)
    tie = choose_share(
        "auto",
        [(2, 2)],  # eigen: 2·(4 + 2) = 12 values every 3 steps, 4 a step; the gradient 4
        inverse_method="eigen",
        inv_dtype=torch.float32,
        grad_dtype=torch.float32,
        inv_update_steps=3,
    )
    assert (tie.mode, tie.decomposition_bytes_per_step, tie.gradient_bytes_per_step) == (
        "decompositions",
        16.0,
        16,
    )


def test_pad_sharing_gradients_gives_each_layer_one_owner_and_broadcasts_gradients() -> None:
    # DIMS' layers in forward order, both factors of each to its owner (contiguous blocks of
    # layers): owners decompose, hold and precondition, and send their layers' gradients.
    world = 3
    share = choose_share(
        "gradients",
        DIMS,
        inverse_method="eigen",
        inv_dtype=torch.float32,
        grad_dtype=torch.float32,
        inv_update_steps=1,
    )
    factor_placement = PADStrategy.place_factors(
        DIMS,
        world,
        COST,
        inverse_method="eigen",
        inv_dtype=torch.float32,
        factor_dtype=torch.float32,
        cap_bytes=2**20,
        share=share,
    )
    plan = factor_placement.placement()
    owners = [plan.route((layer, "a")).reduced_to for layer in range(len(DIMS))]
    assert owners == sorted(owners) and set(owners) == set(range(world))
    assert plan.decompositions == () and not plan.exchanges_traces()
    assert plan.gradients == gradient_shares(owners, (0, 1, 2))
    for layer, owner in enumerate(owners):
        for side in "ag":
            assert plan.route((layer, side)).reduced_to == owner
            assert plan.route((layer, side)).decomposed_by == owner
        for rank in range(world):
            assert plan.holds_inverse(layer, rank) == (rank == owner)
    # Fusion buckets never mix destinations: by owner the ready order rises through the A
    # factors (forward order) and falls back through the G factors.
    assert [route.reduced_to for route in plan.factors] == owners + owners[::-1]
    assert all(len({plan.factors[i].reduced_to for i in bucket}) == 1 for bucket in plan.buckets)
    # The owners are the optimal contiguous partition of the layers' predicted costs.
    beta = COST.collective.beta
    costs = [
        COST.decomposition.seconds(a)
        + COST.decomposition.seconds(g)
        + beta * 4 * (tri(a) + tri(g) + a * g)
        for a, g in DIMS
    ]
    assert owners == plan_contiguous_partition(costs, world)
    with pytest.raises(ValueError, match="strategy='spd' shares decompositions"):
        SPDStrategy.place_factors(
            DIMS,
            world,
            COST,
            inverse_method="eigen",
            inv_dtype=torch.float32,
            factor_dtype=torch.float32,
            cap_bytes=2**20,
            share=share,
        )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Placement(1, "none", (FactorRoute(0, "a", 3, None, 0),)), "both factors"),
        (
            lambda: Placement(2, "none", layer_owner_routes([(3, 4)], [2])),
            "decomposed by no rank",
        ),
        (
            lambda: Placement(2, "step", layer_owner_routes([(3, 4)], [0], reduced_to=1)),
            "allreduced",
        ),
        (
            lambda: Placement(2, "none", layer_owner_routes([(3, 4)], [EVERY_WORKER])),
            "never exchanged",
        ),
        (
            lambda: Placement(
                2,
                "step",
                layer_owner_routes([(3, 4)], [0]),
                (DecompositionShare(1, (((0, "a"), (0, "g")),), (0, 1)),),
            ),
            "did not decompose",
        ),
    ],
)
def test_inconsistent_placements_are_refused(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


def test_a_gradient_share_of_one_rank_is_not_planned() -> None:
    plan = kaisa_placement(DIMS, 2, 2)
    assert all(len(share.group) > 1 for share in plan.gradients)
    assert plan.gradients == ()
    assert gradient_shares([0, 0, 0], (0,)) == ()
    assert gradient_shares([1, 0, 1], (0, 1)) == (
        GradientShare(0, (1,), (0, 1)),
        GradientShare(1, (0, 2), (0, 1)),
    )


def test_the_recording_communicator_counts_what_the_real_one_counts() -> None:
    # The hand counts test_communicator asserts on a real 3-rank gloo run, from meta tensors.
    world = 3

    def sent(payload: int, factor: int, ranks: int = world) -> int:
        return factor * payload * (ranks - 1) // ranks

    for rank in range(world):
        recorder = StepRecorder()
        comm = RecordingCommunicator(recorder, world, rank)
        meta = torch.device("meta")
        a = torch.empty(5, 5, dtype=torch.float64, device=meta)
        v = torch.empty(3, dtype=torch.float64, device=meta)
        comm.allreduce([a, v], phase="p", symmetric=[True, False], average=True).wait()
        alone = RecordingCommunicator(recorder, world, rank, bucket_cap_mb=0)
        parts = [torch.empty(2, dtype=torch.float64, device=meta) for _ in range(3)]
        alone.allreduce(parts, phase="alone").wait()
        comm.reduce([torch.empty(4, dtype=torch.float64, device=meta)], 1, phase="reduce")
        b = torch.empty(4, 4, dtype=torch.float64, device=meta)
        comm.broadcast([b], world - 1, phase="bcast", symmetric=[True]).wait()
        low = RecordingCommunicator(recorder, world, rank, comm_dtype=torch.bfloat16)
        low.allreduce([torch.empty(8, device=meta)], phase="bf16").wait()
        counts = torch.empty(1, dtype=torch.float64, device=meta)
        low.allreduce([counts], phase="exact", exact=True).wait()
        groups = comm.new_groups([[0, 1], list(range(world)), [rank]])
        assert groups[(rank,)] is None
        comm.allreduce([torch.empty(1, device=meta)], phase="group", group=groups[(0, 1)])
        recorder.finish_step(0)
        stats = recorder.comm_stats()
        assert stats["p/allreduce"] == {"bytes": 8 * 18, "calls": 1, "wire_bytes": sent(144, 2)}
        assert stats["alone/allreduce"] == {"bytes": 48, "calls": 3, "wire_bytes": 3 * sent(16, 2)}
        assert stats["reduce/reduce"] == {"bytes": 32, "calls": 1, "wire_bytes": sent(32, 1)}
        assert stats["bcast/broadcast"] == {"bytes": 80, "calls": 1, "wire_bytes": sent(80, 1)}
        assert stats["bf16/allreduce"] == {"bytes": 16, "calls": 1, "wire_bytes": sent(16, 2)}
        assert stats["exact/allreduce"] == {"bytes": 8, "calls": 1, "wire_bytes": sent(8, 2)}
        assert stats["group/allreduce"]["wire_bytes"] == sent(4, 2, ranks=2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (  # PAD-like: reduced to rank 1, decomposed by rank 0
            lambda: Placement(
                2,
                "hooks",
                (FactorRoute(0, "a", 3, 1, 0), FactorRoute(0, "g", 4, 1, 1)),
                buckets=((0, 1),),
            ),
            "decomposed where it is not kept",
        ),
        (
            lambda: Placement(
                2,
                "none",
                layer_owner_routes([(3, 4)], [0]),
                gradients=(GradientShare(1, (0,), (0, 1)),),
            ),
            "without its inverse",
        ),
        (
            lambda: Placement(
                2, "hooks", layer_owner_routes([(3, 4)], [EVERY_WORKER]), buckets=((0,),)
            ),
            "cover every factor",
        ),
        (
            lambda: Placement(
                2,
                "hooks",
                (FactorRoute(0, "a", 3, 0, 0), FactorRoute(0, "g", 4, None, EVERY_WORKER)),
                buckets=((0, 1),),
            ),
            "one destination",
        ),
        (
            lambda: Placement(1, "none", layer_owner_routes([(3, 4)], [0]), buckets=((0, 1),)),
            "no fusion buckets",
        ),
    ],
)
def test_placements_that_cannot_run_are_refused(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


def one_worker_runs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[Any]:
    out = []
    for config in configs:
        model, options = build(config)
        ddp = nn.parallel.DistributedDataParallel(model)
        extra = {"cost_model": COST} if config["strategy"] in ("spd", "pad") else {}
        pre = dkfac.KFACPreconditioner(ddp, lr=0.1, **extra, **options)
        train(ddp, pre, world_size, rank)
        out.append(([p.detach().clone() for p in model.parameters()], pre.comm_stats()))
        pre.remove()
    return out


def test_one_worker_of_a_distributed_strategy_sends_nothing_that_moves_and_equals_local() -> None:
    # At P = 1 there is nobody to share a decomposition or a gradient with: no broadcast is
    # issued, so a rounding transport (bf16) cannot touch DP-KFAC's numbers, which equal
    # strategy="local" in the same one-worker DDP run to the bit; the others allreduce factors
    # with themselves only. (DDP itself changes the last bit against a plain model.)
    configs = [
        {"strategy": "local", "inverse_method": "eigen"},
        {"strategy": "local", "inverse_method": "inverse"},
        {"strategy": "dp", "inverse_method": "eigen", "comm_dtype": torch.bfloat16},
        *({"strategy": s, "inverse_method": "inverse"} for s in ("dkfac", "spd", "pad")),
    ]
    (results,) = run_workers(one_worker_runs, 1, args=(configs,), timeout=180)
    local = {"eigen": results[0][0], "inverse": results[1][0]}
    want_eigen, _ = reference_run(configs[0], 1)  # and local equals the plain model's run
    for got, want in zip(local["eigen"], want_eigen, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for config, (params, stats) in zip(configs[2:], results[2:], strict=True):
        assert not [key for key in stats if "broadcast" in key], config
        for got, expected in zip(params, local[config["inverse_method"]], strict=True):
            if config["strategy"] == "dp":
                assert torch.equal(got, expected), config
            else:  # the factor allreduce repacks symmetric factors (upper triangle)
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=str(config))


def test_a_ranks_gradient_route_follows_the_placement_and_the_layers_with_gradients() -> None:
    """What a rank preconditions and which shares it joins, kept between plain steps: for
    each call, the plan's own answers (inverse holders, gradient shares), recomputed; a new
    placement or another set of layers is never answered from the previous call."""
    stacks = LayerStacks()
    world = 4
    first, second = kaisa_placement(DIMS, world, 2), kaisa_placement(DIMS, world, 1)
    calls = [
        (first, list(range(len(DIMS)))),
        (first, list(range(len(DIMS)))),
        (first, [0, 2]),  # a layer without a gradient this step
        (second, [0, 2]),
        (replace(second, buckets=()), [0, 2]),  # re-planned: a new placement object
        (first, list(range(len(DIMS)))),
    ]
    for rank in range(world):
        shares = GradientShares(rank, StepRecorder(), stacks, lambda: None, {})  # type: ignore[arg-type,return-value]
        previous: tuple[Any, list[int], Any] | None = None
        for placement, indices in calls:
            route = shares.route(placement, indices)
            holders = [placement.inverse_holders(i) for i in indices]
            held = tuple(p for p, ranks in enumerate(holders) if rank in ranks)
            assert route.held == held
            assert route.domains == tuple(holders[p] for p in held)
            want = [
                (share, tuple(indices.index(i) for i in share.layers if i in indices))
                for share in placement.gradients
                if rank in share.group
            ]
            assert route.shares == tuple((s, p) for s, p in want if p)
            if previous is not None:  # kept exactly when the placement and layers repeat
                repeated = previous[0] is placement and previous[1] == indices
                assert (route is previous[2]) == repeated
            previous = (placement, indices, route)
    assert any(kaisa_placement(DIMS, world, 2).gradients)  # shares to route, not only holders
