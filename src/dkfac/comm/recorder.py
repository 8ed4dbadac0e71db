"""Per-step accounting of communication and phase times, and a Chrome trace of recent steps.

The communicator records every collective here (strategies cannot bypass it), and when each
was in flight (:meth:`StepRecorder.in_flight`); the preconditioner and strategies time their
phases with :meth:`StepRecorder.phase`. :meth:`StepRecorder.overlap` compares the two: how
much of a phase's communication the training thread waited for, and how much was hidden.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dkfac.comm.intervals import exposure

#: Phases of a K-FAC step, in the order they happen.
PHASES: tuple[str, ...] = (
    "factor_compute",
    "factor_comm",
    "inverse_compute",
    "inverse_comm",
    "precondition",
    "grad_comm",
)


@dataclass
class CommCount:
    """Payload bytes on this rank, bytes this rank sends, and number of collective calls.

    ``wire_bytes`` is what a bandwidth-optimal algorithm sends per rank for the payload ``n``
    over ``P`` ranks: ``2(P-1)/P·n`` for allreduce, ``(P-1)/P·n`` for reduce, broadcast,
    reduce-scatter (``n``: the full input) and all-gather (``n``: the full output). It is how
    an allreduce and a reduce of the same tensor differ.
    """

    bytes: int = 0
    calls: int = 0
    wire_bytes: int = 0


@dataclass
class StepRecord:
    """What one step cost on this rank.

    ``events`` are the trace's spans (phases and other lanes); ``flights`` are, per phase,
    the ``(launch, completion)`` of each of its collectives waited for in this step. Times are
    seconds since the recorder started.
    """

    step: int
    comm: dict[tuple[str, str], CommCount] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, float, float]] = field(default_factory=list)
    flights: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


class StepRecorder:
    """Collects comm bytes/calls and phase wall times, one record per step.

    Args:
        keep_steps: how many finished steps the trace keeps.
        phases: the phase names :meth:`timings` always lists and the trace's first lanes
            (default: the K-FAC phases).
    """

    def __init__(self, keep_steps: int = 20, phases: tuple[str, ...] = PHASES) -> None:
        self.phases = phases
        self._current = StepRecord(step=0)
        self._finished: deque[StepRecord] = deque(maxlen=keep_steps)
        self._origin = time.perf_counter()

    def count(self, phase: str, op: str, nbytes: int, wire_bytes: int | None = None) -> None:
        """Record one collective of ``nbytes`` payload (``wire_bytes`` sent) in ``phase``."""
        entry = self._current.comm.setdefault((phase, op), CommCount())
        entry.bytes += nbytes
        entry.calls += 1
        entry.wire_bytes += nbytes if wire_bytes is None else wire_bytes

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as part of phase ``name`` of the current step.

        While a profiler runs, the block is also a ``dkfac/<name>`` range for
        ``torch.profiler`` (and its TensorBoard view). Otherwise no range is opened: a
        ``record_function`` costs two operator calls (~4 µs of host time), and the capture
        times every layer's statistics, twice per layer on a factor step (a tool that
        observes ``RecordFunction`` without the profiler, e.g. an execution-trace observer
        alone, no longer sees these ranges). Inside a region
        that ``torch.compile`` traces (the layers' hooks of a compiled model) nothing is
        timed: a clock read there would break the graph.
        """
        if torch.compiler.is_compiling():
            yield
            return
        start = time.perf_counter()
        try:
            if torch._C._autograd._profiler_enabled():
                with torch.profiler.record_function(f"dkfac/{name}"):
                    yield
            else:
                yield
        finally:
            end = time.perf_counter()
            seconds = self._current.seconds
            seconds[name] = seconds.get(name, 0.0) + (end - start)
            self._current.events.append((name, start - self._origin, end - self._origin))

    def now(self) -> float:
        """The recorder's clock (``time.perf_counter``), for spans timed outside :meth:`phase`."""
        return time.perf_counter()

    def span(self, lane: str, start: float, end: float) -> None:
        """Add a trace span on ``lane`` (clock: :meth:`now`) without counting it as phase time.

        For work that runs in the background, e.g. a collective from launch to completion.
        """
        self._current.events.append((lane, start - self._origin, end - self._origin))

    def in_flight(self, phase: str, launched: float, completed: float) -> None:
        """Record one collective of ``phase`` in flight from ``launched`` to ``completed``.

        Called by the training thread when it waits for the collective (clock: :meth:`now`);
        the span goes to the trace on lane ``"<phase> in flight"`` and into :meth:`overlap`.
        """
        self.span(f"{phase} in flight", launched, completed)
        spans = self._current.flights.setdefault(phase, [])
        spans.append((launched - self._origin, completed - self._origin))

    def finish_step(self, step: int) -> None:
        """Close the record of ``step`` and open the next one."""
        self._current.step = step
        self._finished.append(self._current)
        self._current = StepRecord(step=step + 1)

    def last(self) -> StepRecord | None:
        """The last finished step, if any."""
        return self._finished[-1] if self._finished else None

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """``{"phase/collective": {"bytes", "calls", "wire_bytes"}}`` of the last finished step."""
        record = self.last()
        if record is None:
            return {}
        return {
            f"{phase}/{op}": {"bytes": c.bytes, "calls": c.calls, "wire_bytes": c.wire_bytes}
            for (phase, op), c in sorted(record.comm.items())
        }

    def timings(self) -> dict[str, float]:
        """Seconds per phase of the last finished step (every phase listed, 0 if absent)."""
        record = self.last()
        seconds = {} if record is None else record.seconds
        return {name: seconds.get(name, 0.0) for name in self.phases} | {
            name: value for name, value in seconds.items() if name not in self.phases
        }

    def overlap(self) -> dict[str, dict[str, float]]:
        """Per phase with collectives in flight in the last finished step, how long, and seen how.

        ``"in_flight_s"``: time at least one of the phase's collectives was in flight (the
        union of their spans); ``"exposed_s"``: the part of it the training thread spent in
        that phase itself (inside :meth:`phase`: launching or waiting); ``"hidden_s"``: the
        rest, when the thread did other work (forward, backward) while the bytes moved.
        """
        record = self.last()
        if record is None:
            return {}
        return {
            phase: exposure(flights, [(s, e) for name, s, e in record.events if name == phase])
            for phase, flights in sorted(record.flights.items())
        }

    def export_trace(self, path: str | os.PathLike[str], rank: int = 0) -> None:
        """Write the kept steps as a Chrome trace (``chrome://tracing``, Perfetto).

        One lane (thread) per phase; times in microseconds since the recorder started.
        """
        lanes = {name: index for index, name in enumerate(self.phases)}
        spans: list[dict[str, Any]] = []
        for record in self._finished:
            for name, start, end in record.events:
                spans.append(
                    {
                        "name": name,
                        "ph": "X",
                        "pid": rank,
                        "tid": lanes.setdefault(name, len(lanes)),
                        "ts": start * 1e6,
                        "dur": (end - start) * 1e6,
                        "args": {"step": record.step},
                    }
                )
        names = [
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": index, "args": {"name": name}}
            for name, index in lanes.items()
        ]
        events = names + spans
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
