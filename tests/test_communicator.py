"""The communicator on real gloo process groups: values, packing, buckets, accounting."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import PHASES, StepRecorder
from dkfac.comm.wire import FusionBucket


def symmetric(d: int, seed: int) -> torch.Tensor:
    m = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return m + m.t()


def collectives(rank: int, world_size: int) -> dict:
    recorder = StepRecorder()
    out: dict = {}
    # Allreduce, packed symmetric + plain, one bucket.
    comm = Communicator(recorder)
    a, v = symmetric(5, rank), torch.arange(3.0, dtype=torch.float64) * (rank + 1)
    comm.allreduce([a, v], phase="p", symmetric=[True, False], average=True).wait()
    out["allreduce"] = (a, v)
    # Every tensor alone: bucket cap 0.
    alone = Communicator(recorder, bucket_cap_mb=0)
    tensors = [torch.full((2,), float(rank), dtype=torch.float64) for _ in range(3)]
    alone.allreduce(tensors, phase="alone").wait()
    out["alone"] = tensors
    # Reduce onto rank 1 only.
    r = torch.ones(4, dtype=torch.float64) * (rank + 1)
    comm.reduce([r], 1, phase="reduce").wait()
    out["reduce"] = r
    # Broadcast from the last rank, symmetric packing.
    b = symmetric(4, 100) if rank == world_size - 1 else torch.zeros(4, 4, dtype=torch.float64)
    comm.broadcast([b], world_size - 1, phase="bcast", symmetric=[True]).wait()
    out["broadcast"] = b
    # bf16 transport: restored to float32, halved bytes.
    low = Communicator(recorder, comm_dtype=torch.bfloat16)
    x = torch.linspace(0, 1, 8) + rank
    low.allreduce([x], phase="bf16").wait()
    out["bf16"] = x
    # exact=True ignores comm_dtype: 257 has 9 significant bits, bf16 keeps 8.
    counts = torch.tensor([257.0 * (rank + 1)], dtype=torch.float64)
    low.allreduce([counts], phase="exact", exact=True).wait()
    out["exact"] = counts
    # Groups: one per pair of ranks, made identically everywhere.
    groups = comm.new_groups([[0, 1], list(range(world_size))])
    g = torch.tensor([float(rank)])
    if rank in (0, 1):
        comm.allreduce([g], phase="group", group=groups[(0, 1)]).wait()
    out["group"] = g
    # Element-wise maximum (how ranks agree on measured times).
    m = torch.tensor([float(rank), float(-rank)], dtype=torch.float64)
    comm.allreduce([m], phase="max", maximum=True).wait()
    out["max"] = m
    # A communicator with a group of its own: works, and close() destroys only that group.
    own = Communicator.with_own_group(recorder)
    o = torch.tensor([float(rank)])
    own.allreduce([o], phase="own").wait()
    made = own.group
    out["own"] = (o, own.owns_group, dist.get_process_group_ranks(made))
    own.close()
    own.close()  # idempotent
    try:
        dist.get_process_group_ranks(made)
        destroyed = False
    except KeyError:  # torch.distributed no longer knows the group
        destroyed = True
    out["own_closed"] = (own.group is None, own.owns_group, destroyed)
    borrowed = Communicator(recorder, group=dist.group.WORLD)
    borrowed.close()  # a group passed in belongs to the caller
    out["borrowed"] = (borrowed.group is dist.group.WORLD, borrowed.owns_group)
    # Reduce-scatter and all-gather (DeAR's halves of an allreduce).
    chunk = torch.zeros(2, dtype=torch.float64)
    comm.reduce_scatter(
        torch.arange(2.0 * world_size, dtype=torch.float64) + rank, chunk, phase="rs"
    ).wait()
    out["reduce_scatter"] = chunk
    gathered = torch.zeros(2 * world_size, dtype=torch.float64)
    comm.all_gather(torch.full((2,), float(rank), dtype=torch.float64), gathered, phase="ag").wait()
    out["all_gather"] = gathered
    recorder.finish_step(0)
    out["stats"] = recorder.comm_stats()
    return out


def test_collectives_values_packing_buckets_and_accounting() -> None:
    world = 3
    results = run_workers(collectives, world, timeout=90)
    a_mean = sum(symmetric(5, r) for r in range(world)) / world
    v_mean = torch.arange(3.0, dtype=torch.float64) * sum(r + 1 for r in range(world)) / world
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["allreduce"][0], a_mean)
        torch.testing.assert_close(out["allreduce"][1], v_mean)
        assert all(torch.equal(t, torch.full((2,), 3.0, dtype=torch.float64)) for t in out["alone"])
        expected_reduce = 6.0 if rank == 1 else float(rank + 1)
        assert torch.equal(out["reduce"], torch.full((4,), expected_reduce, dtype=torch.float64))
        assert torch.equal(out["broadcast"], symmetric(4, 100))
        assert out["bf16"].dtype == torch.float32
        exact = torch.linspace(0, 1, 8) * world + sum(range(world))
        torch.testing.assert_close(out["bf16"], exact, rtol=1e-2, atol=0)
        assert float(out["group"]) == (1.0 if rank in (0, 1) else float(rank))
        assert out["max"].tolist() == [world - 1.0, 0.0]
        assert out["exact"].item() == 257.0 * sum(r + 1 for r in range(world))
        own_sum, owned, ranks = out["own"]
        assert own_sum.item() == sum(range(world)) and owned and ranks == list(range(world))
        assert out["own_closed"] == (True, False, True)
        assert out["borrowed"] == (True, False)
        stats = out["stats"]

        def sent(payload: int, factor: int, ranks: int = world) -> int:
            # Ring allreduce: each rank sends 2(P-1)/P of the payload; reduce, broadcast,
            # reduce-scatter, all-gather: (P-1)/P.
            return factor * payload * (ranks - 1) // ranks

        assert stats["p/allreduce"] == {
            "bytes": 8 * (15 + 3),
            "calls": 1,
            "wire_bytes": sent(8 * 18, 2),
        }
        assert stats["alone/allreduce"] == {
            "bytes": 8 * 6,
            "calls": 3,
            "wire_bytes": 3 * sent(16, 2),
        }
        assert stats["reduce/reduce"] == {"bytes": 32, "calls": 1, "wire_bytes": sent(32, 1)}
        assert stats["bcast/broadcast"] == {"bytes": 8 * 10, "calls": 1, "wire_bytes": sent(80, 1)}
        assert stats["bf16/allreduce"] == {"bytes": 2 * 8, "calls": 1, "wire_bytes": sent(16, 2)}
        assert stats["exact/allreduce"] == {"bytes": 8, "calls": 1, "wire_bytes": sent(8, 2)}
        assert ("group/allreduce" in stats) == (rank in (0, 1))
        if rank in (0, 1):
            assert stats["group/allreduce"]["wire_bytes"] == sent(4, 2, ranks=2)
        summed = torch.arange(2.0 * world, dtype=torch.float64) * world + sum(range(world))
        torch.testing.assert_close(out["reduce_scatter"], summed[2 * rank : 2 * rank + 2])
        torch.testing.assert_close(
            out["all_gather"], torch.arange(world, dtype=torch.float64).repeat_interleave(2)
        )
        assert stats["rs/reduce_scatter"] == {
            "bytes": 8 * 2 * world,
            "calls": 1,
            "wire_bytes": sent(16 * world, 1),
        }
        assert stats["ag/all_gather"] == {
            "bytes": 8 * 2 * world,
            "calls": 1,
            "wire_bytes": sent(16 * world, 1),
        }


def test_fusion_bucket_packs_the_upper_triangle_and_restores_both() -> None:
    s = symmetric(6, 0)
    bucket = FusionBucket(
        [s.clone(), torch.ones(2, dtype=torch.float64)], [True, False], torch.float64
    )
    assert bucket.flat.numel() == 21 + 2
    target = [torch.zeros(6, 6, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    bucket.tensors = target
    bucket.unpack(scale=0.5)
    torch.testing.assert_close(target[0], s * 0.5)
    torch.testing.assert_close(target[1], torch.full((2,), 0.5, dtype=torch.float64))


def test_timings_and_trace_of_a_local_run(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pre = dkfac.KFACPreconditioner(model)
    for _ in range(3):
        model.zero_grad()
        F.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
        pre.step()
    timings = pre.timings()
    assert list(timings) == list(PHASES)
    for phase in ("factor_compute", "inverse_compute", "precondition"):
        assert timings[phase] > 0
    assert timings["factor_comm"] == 0 and pre.comm_stats() == {}
    path = tmp_path / "trace.json"
    pre.export_trace(path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"factor_compute", "precondition"}
    assert {e["args"]["step"] for e in spans} == {0, 1, 2}
    assert all(e["dur"] >= 0 for e in spans)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "kaisa", "grad_worker_fraction": 0.0},
        {"bucket_cap_mb": -1},
        {"comm_dtype": torch.int8},
    ],
)
def test_distributed_options_are_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=list(kwargs)[-1]):
        dkfac.KFACPreconditioner(nn.Linear(2, 2), **kwargs)


def group_churn(rank: int, world_size: int, cycles: int) -> int:
    # Each cycle makes a group and releases it with no collective in between (a strategy built
    # and removed, or a CostModelCache hit). A busy thread on every rank shifts the scheduling
    # so that one rank often leaves gloo's full-mesh handshake before its peer; without the
    # barrier in close() the first rank destroyed the group under its peer's handshake and the
    # peer failed in new_group with "Connection closed by peer" (make test under load).
    stop = threading.Event()

    def busy() -> None:
        x = torch.randn(64, 64)
        while not stop.is_set():
            x = torch.tanh(x @ x)

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        for _ in range(cycles):
            comm = Communicator.with_own_group(StepRecorder())
            comm.close()
            assert comm.group is None and not comm.owns_group
            comm.close()  # idempotent
    finally:
        stop.set()
        thread.join()
    return cycles


def test_groups_made_and_released_at_once_never_break_a_peer() -> None:
    assert run_workers(group_churn, 2, args=(100,), timeout=120) == [100, 100]


def group_timeouts(rank: int, world_size: int) -> list[float]:
    comm = Communicator.with_own_group(StepRecorder())
    groups = comm.new_groups([[0, 1]])
    seconds = [
        group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for group in (dist.group.WORLD, comm.group, groups[(0, 1)])
    ]
    comm.close()
    return seconds


def test_groups_dkfac_makes_have_the_default_groups_timeout() -> None:
    # torch gives a new group 30 minutes whatever init_process_group said; a lost peer must
    # fail dkfac's own groups (SPD/PAD, DeAR, KAISA's rows and columns) as soon as the world.
    results = run_workers(group_timeouts, 2, timeout=60)  # the harness's groups: 30 s
    assert results == [[30.0, 30.0, 30.0]] * 2


def reduces_both_ways(rank: int, world_size: int) -> dict:
    recorder = StepRecorder()
    comm = Communicator.with_own_group(recorder, comm_dtype=None)
    comm.open_lanes([1, 0, 1])  # destinations and sources alike
    comm.open_lanes([0])  # lanes already open are kept
    lanes = comm.subgroups
    # Both reduces in flight before either is waited for, as PAD's two owners' buckets are.
    to_zero = [symmetric(5, rank), torch.arange(3.0, dtype=torch.float64) * (rank + 1)]
    to_one = [torch.linspace(-1, 1, 7, dtype=torch.float64) * (rank + 2)]
    first = comm.reduce(to_zero, 0, phase="lanes", symmetric=[True, False], average=True)
    second = comm.reduce(to_one, 1, phase="lanes")
    first.wait()
    second.wait()
    # Broadcasts from both ranks in flight at once, each on its source's lane.
    mine = torch.full((3,), float(rank + 1))
    theirs = torch.full((3,), float(rank + 10))
    from_zero = comm.broadcast([mine if rank == 0 else theirs], 0, phase="lanes")
    from_one = comm.broadcast([mine if rank == 1 else theirs], 1, phase="lanes")
    from_zero.wait()
    from_one.wait()
    # bf16 transport through the direct send: the owner's sum is rounded once, like gloo's.
    low = Communicator(recorder, comm_dtype=torch.bfloat16)
    x = torch.linspace(0, 1, 8) + rank
    low.reduce([x], 1, phase="bf16").wait()
    recorder.finish_step(0)
    out = {
        "lanes": lanes,
        "to_zero": to_zero,
        "to_one": to_one,
        "bf16": x,
        "broadcasts": (mine, theirs),
        "stats": recorder.comm_stats(),
        "flights": recorder.overlap().get("lanes", {}),
    }
    comm.close()
    out["closed"] = comm.subgroups
    return out


def lanes_of_the_world(rank: int, world_size: int) -> dict:
    """The group each collective reaches torch.distributed on, for a world communicator."""
    comm = Communicator(StepRecorder(), comm_dtype=None)  # group None: the world's
    comm.open_lanes([1, 0])
    seen: list[tuple[str, object]] = []

    def spy(name: str) -> None:
        real = getattr(dist, name)

        def call(*args: object, group: object = None, **kwargs: object) -> object:
            seen.append((name, group))
            return real(*args, group=group, **kwargs)

        setattr(dist, name, call)

    for name in ("broadcast", "reduce", "all_to_all_single", "all_reduce"):
        spy(name)
    world = dist.group.WORLD  # what the runner passes for a share over all ranks
    from_zero = torch.full((4,), 1.0 + rank)
    from_one = torch.full((4,), 1.0 + rank)
    to_one = torch.full((4,), 1.0 + rank, dtype=torch.float64)
    handles = [
        comm.broadcast([from_zero], 0, phase="w", group=world),
        comm.broadcast([from_one], 1, phase="w", group=world),
        comm.reduce([to_one], 1, phase="w", group=world),
    ]
    for handle in handles:
        handle.wait()
    lanes = comm._lanes
    routes = [lanes.route(0), lanes.route(1)]
    calls = [(name, routes.index(g) if g in routes else "other") for name, g in seen]
    comm.close()
    return {"calls": calls, "values": (from_zero, from_one, to_one), "made": routes[1] is not None}


def test_a_world_communicator_routes_the_runners_world_group_onto_its_lanes() -> None:
    """The runner passes ``dist.group.WORLD`` for shares over all ranks (dkfac, kaisa, dp):
    those collectives must travel on their root's lane, not all on the world group."""
    for rank, out in enumerate(run_workers(lanes_of_the_world, 2, timeout=60)):
        assert out["made"]
        # Root 0 on the world group (lane 0), root 1 on its own group (lane 1); the reduce
        # to rank 1 is a direct send on rank 1's lane, never gloo's reduce.
        assert out["calls"] == [("broadcast", 0), ("broadcast", 1), ("all_to_all_single", 1)]
        from_zero, from_one, to_one = out["values"]
        assert torch.equal(from_zero, torch.full((4,), 1.0))
        assert torch.equal(from_one, torch.full((4,), 2.0))
        expected = torch.full((4,), 3.0 if rank == 1 else 1.0, dtype=torch.float64)
        assert torch.equal(to_one, expected)


def test_reduces_at_two_ranks_are_direct_sends_on_one_lane_per_destination() -> None:
    results = run_workers(reduces_both_ways, 2, timeout=60)
    a_mean = (symmetric(5, 0) + symmetric(5, 1)) / 2  # float64 oracle
    v_mean = torch.arange(3.0, dtype=torch.float64) * 3 / 2
    w_sum = torch.linspace(-1, 1, 7, dtype=torch.float64) * 5
    for rank, out in enumerate(results):
        assert out["lanes"] == 1  # a second group for destination 1; 0 uses the comm's own
        assert out["closed"] == 0
        if rank == 0:
            torch.testing.assert_close(out["to_zero"][0], a_mean, rtol=0, atol=1e-15)
            torch.testing.assert_close(out["to_zero"][1], v_mean, rtol=0, atol=0)
            assert torch.equal(out["to_one"][0], torch.linspace(-1, 1, 7, dtype=torch.float64) * 2)
            assert torch.equal(out["bf16"], torch.linspace(0, 1, 8))
        else:  # the non-owner's tensors are left as they were
            assert torch.equal(out["to_zero"][0], symmetric(5, 1))
            torch.testing.assert_close(out["to_one"][0], w_sum, rtol=0, atol=1e-15)
            exact = torch.linspace(0, 1, 8) * 2 + 1
            torch.testing.assert_close(out["bf16"], exact, rtol=1e-2, atol=0)
            assert out["bf16"].dtype == torch.float32
        # Rank 0's own tensor went out; rank 1's came in (and the other way round on rank 1).
        mine, theirs = out["broadcasts"]
        assert torch.equal(mine, torch.full((3,), float(rank + 1)))
        assert torch.equal(theirs, torch.full((3,), float(2 - rank)))
        stats = out["stats"]
        assert stats["lanes/reduce"]["calls"] == 2
        assert stats["lanes/reduce"]["bytes"] == 8 * (15 + 3 + 7)
        # Each direct send has a future: its flight is traced like gloo's collectives.
        assert out["flights"].get("in_flight_s", 0.0) > 0.0
