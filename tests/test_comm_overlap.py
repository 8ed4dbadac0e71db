"""When collectives are in flight, and how much of it the training thread waited for."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.comm.flight import follow
from dkfac.comm.handle import CollectiveHandle
from dkfac.comm.intervals import covered, covered_by_both, exposure, merge
from dkfac.comm.recorder import StepRecorder
from test_distributed import F64, STEPS, train, uneven_model
from test_pipelined import COST

# -- interval arithmetic ---------------------------------------------------------------------


def test_merge_joins_overlapping_nested_and_touching_intervals_and_drops_empty_ones() -> None:
    assert merge([]) == []
    assert merge([(5.0, 6.0), (1.0, 2.0)]) == [(1.0, 2.0), (5.0, 6.0)]  # disjoint, sorted
    assert merge([(1.0, 10.0), (2.0, 3.0)]) == [(1.0, 10.0)]  # nested
    assert merge([(1.0, 4.0), (3.0, 6.0), (5.5, 7.0)]) == [(1.0, 7.0)]  # a chain of overlaps
    assert merge([(1.0, 2.0), (2.0, 3.0)]) == [(1.0, 3.0)]  # touching
    assert merge([(1.0, 1.0), (3.0, 2.0)]) == []  # empty and reversed


@pytest.mark.parametrize(
    ("intervals", "length"),
    [
        ([], 0.0),
        ([(0.0, 1.0), (2.0, 4.0)], 3.0),  # disjoint: 1 + 2
        ([(0.0, 10.0), (2.0, 3.0), (4.0, 9.0)], 10.0),  # nested in the first
        ([(0.0, 4.0), (3.0, 6.0)], 6.0),  # overlapping by 1
        ([(2.0, 2.0)], 0.0),  # empty
    ],
)
def test_covered_is_the_length_of_the_union(
    intervals: list[tuple[float, float]], length: float
) -> None:
    assert covered(intervals) == pytest.approx(length)


@pytest.mark.parametrize(
    ("first", "second", "length"),
    [
        ([], [(0.0, 1.0)], 0.0),
        ([(0.0, 1.0)], [], 0.0),
        ([(0.0, 1.0)], [(2.0, 3.0)], 0.0),  # disjoint
        ([(0.0, 1.0)], [(1.0, 2.0)], 0.0),  # touching only
        ([(0.0, 10.0)], [(2.0, 3.0), (5.0, 7.0)], 3.0),  # second nested in first
        ([(2.0, 3.0)], [(0.0, 10.0)], 1.0),  # first nested in second
        ([(0.0, 4.0)], [(3.0, 6.0)], 1.0),  # overlapping
        # Overlaps within each list are counted once: [0, 5] against [2, 3] ∪ [4, 8].
        ([(0.0, 3.0), (1.0, 5.0)], [(2.0, 3.0), (2.5, 2.8), (4.0, 8.0)], 2.0),
        ([(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], [(0.5, 4.5)], 2.0),  # one spans three
    ],
)
def test_covered_by_both_is_the_length_of_the_intersection(
    first: list[tuple[float, float]], second: list[tuple[float, float]], length: float
) -> None:
    assert covered_by_both(first, second) == pytest.approx(length)
    assert covered_by_both(second, first) == pytest.approx(length)


@pytest.mark.parametrize(
    ("flights", "waits", "in_flight", "exposed"),
    [
        ([], [(0.0, 1.0)], 0.0, 0.0),  # nothing in flight
        ([(0.0, 2.0)], [], 2.0, 0.0),  # never waited for: all hidden
        ([(0.0, 2.0)], [(3.0, 4.0)], 2.0, 0.0),  # done before the wait
        ([(1.0, 2.0)], [(0.0, 3.0)], 1.0, 1.0),  # launched and waited for in one phase span
        # Launched from a hook at 0 (a launch span of 0.1), in flight under backward until
        # the wait from 5 to 6, completing at 5.5: exposed 0.1 + 0.5.
        ([(0.0, 5.5)], [(-0.1, 0.0), (0.0, 0.1), (5.0, 6.0)], 5.5, 0.6),
        # Two overlapping flights (union [0, 4]) and one alone ([6, 7]).
        ([(0.0, 3.0), (1.0, 4.0), (6.0, 7.0)], [(3.5, 6.5)], 5.0, 1.0),
    ],
)
def test_exposure_splits_the_time_in_flight_into_exposed_and_hidden(
    flights: list[tuple[float, float]],
    waits: list[tuple[float, float]],
    in_flight: float,
    exposed: float,
) -> None:
    result = exposure(flights, waits)
    assert result["in_flight_s"] == pytest.approx(in_flight)
    assert result["exposed_s"] == pytest.approx(exposed)
    assert result["hidden_s"] == pytest.approx(in_flight - exposed)


# -- the recorder and the handle, without a process group ------------------------------------


def test_recorder_overlap_counts_the_phase_s_own_spans_as_exposed() -> None:
    recorder = StepRecorder()
    assert recorder.overlap() == {}
    launched = recorder.now()
    with recorder.phase("factor_comm"):
        time.sleep(0.01)
    completed = recorder.now() + 0.02  # completes after the thread left the phase
    recorder.in_flight("factor_comm", launched, completed)
    with recorder.phase("precondition"):  # another phase's span is not this phase's wait
        pass
    recorder.finish_step(0)
    overlap = recorder.overlap()
    assert list(overlap) == ["factor_comm"]
    waited = recorder.timings()["factor_comm"]
    assert overlap["factor_comm"]["in_flight_s"] == pytest.approx(completed - launched)
    assert overlap["factor_comm"]["exposed_s"] == pytest.approx(waited)
    assert overlap["factor_comm"]["hidden_s"] == pytest.approx(completed - launched - waited)
    recorder.finish_step(1)  # a step without flights
    assert recorder.overlap() == {}


class FutureWork:
    """Stands for a backend's work: done when another thread completes its future."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def wait(self) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future[None]:
        return self.future


class NoFutureWork:
    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[None]:
        raise RuntimeError("this backend does not support futures")


def test_a_handle_records_each_collective_from_launch_to_its_future_s_completion() -> None:
    recorder = StepRecorder()
    works = [FutureWork(), FutureWork()]
    launched = recorder.now()
    pending = [(w, lambda: None, follow(w, torch.zeros(1), recorder, "x", launched)) for w in works]
    handle = CollectiveHandle(pending)
    finisher = threading.Timer(0.02, lambda: [w.future.set_result(None) for w in works])
    finisher.start()
    entered = recorder.now()
    with recorder.phase("x"):
        handle.wait()
    finisher.join()
    handle.wait()  # idempotent: nothing recorded twice
    recorder.finish_step(0)
    record = recorder.last()
    assert record is not None
    flights = record.flights["x"]
    assert len(flights) == 2
    assert all(end >= start + 0.01 for start, end in flights)
    assert [name for name, _, _ in record.events].count("x in flight") == 2
    # Hidden: only the flight before the wait began (setting up the handle and the timer,
    # which a loaded machine can stretch to milliseconds); the rest was waited for.
    hidden = recorder.overlap()["x"]["hidden_s"]
    assert hidden == pytest.approx(entered - launched, abs=2e-3)


def test_work_without_a_host_future_is_not_recorded() -> None:
    recorder = StepRecorder()
    now = recorder.now()
    assert follow(None, torch.zeros(1), recorder, "x", now) is None
    assert follow(NoFutureWork(), torch.zeros(1), recorder, "x", now) is None
    assert follow(object(), torch.zeros(1), recorder, "x", now) is None
    # Device memory: the future completes when the collective is enqueued, not when it ends.
    assert follow(FutureWork(), torch.zeros(1, device="meta"), recorder, "x", now) is None
    CollectiveHandle([(NoFutureWork(), lambda: None, None)]).wait()
    recorder.finish_step(0)
    assert recorder.overlap() == {}


# -- SPD and D-KFAC on gloo --------------------------------------------------------------------


def overlap_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out = {}
    for strategy in ("spd", "dkfac"):
        model = uneven_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        cost = {"cost_model": COST} if strategy == "spd" else {}
        # bucket_cap_mb=0: every factor in a collective of its own, SPD's sent from its hook.
        pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, bucket_cap_mb=0, **cost, **F64)
        train(ddp, pre, world_size, rank)
        path = Path(directory) / f"{strategy}-{rank}.json"
        pre.export_trace(path)
        out[strategy] = {"overlap": pre.comm_overlap(), "comm": pre.comm_stats(), "trace": path}
        pre.remove()
    return out


def test_factor_collectives_are_recorded_in_flight_and_split_into_exposed_and_hidden(
    tmp_path: Path,
) -> None:
    results = run_workers(overlap_run, 2, args=(str(tmp_path),), timeout=120)
    for rank, result in enumerate(results):
        for strategy in ("spd", "dkfac"):
            run = result[strategy]
            events = json.loads(run["trace"].read_text())["traceEvents"]
            last = [e for e in events if e["ph"] == "X" and e["args"]["step"] == STEPS - 1]
            flights = [e for e in last if e["name"] == "factor_comm in flight"]
            # One span per factor collective of the step (buckets, counts, agreements).
            calls = sum(c["calls"] for key, c in run["comm"].items() if key.startswith("factor"))
            assert len(flights) == calls > 0, (strategy, rank)
            assert all(e["dur"] >= 0 for e in flights)
            seen = run["overlap"]["factor_comm"]
            assert seen["hidden_s"] + seen["exposed_s"] == pytest.approx(seen["in_flight_s"])
            assert 0 <= seen["exposed_s"] <= seen["in_flight_s"]
            assert max(e["dur"] for e in flights) * 1e-6 <= seen["in_flight_s"] * (1 + 1e-9)
            assert seen["in_flight_s"] <= sum(e["dur"] for e in flights) * 1e-6 * (1 + 1e-9)
        # D-KFAC launches and waits for its factor allreduce inside step()'s factor_comm
        # phase: the thread waits for the whole flight, nothing is hidden.
        seen = result["dkfac"]["overlap"]["factor_comm"]
        assert seen["hidden_s"] == pytest.approx(0.0, abs=1e-6), seen
