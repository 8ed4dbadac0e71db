"""When each collective of a step runs: its process group's workers and the shared uplinks.

A collective starts once every member has issued it and a worker of its process group is
free: one group's collectives start in issue order, NCCL's one stream at a time, gloo's two
threads two at a time. It then waits its start-up latencies (:func:`~dkfac.sim.network.steps`)
and moves its bytes (:func:`~dkfac.sim.network.uplink_loads`). Collectives in flight at the
same time share each uplink they load fairly, as TCP flows (or NCCL channels) of different
process groups do: each of ``n`` transfers on an uplink gets ``1/n`` of its bandwidth, and a
transfer advances at the pace of its most crowded uplink. The schedule is simulated event by
event (a start, the end of a latency, a completion), and it keeps its state between calls, so
transfers still in flight when a later stage issues its collectives slow them down.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dkfac.sim.network import steps, uplink_loads
from dkfac.sim.run import SimulatedCluster


@dataclass
class ScheduledCollective:
    """One collective of the step, matched across its members (the same on every one)."""

    op: str
    nbytes: int
    members: tuple[int, ...]
    root: int | None
    lane: tuple[object, ...]
    issued: dict[int, float] = field(default_factory=dict)  # member -> when it issued it


@dataclass
class _Flight:
    """A started collective: its latency left, then the share of its bytes left to move."""

    collective: ScheduledCollective
    loads: list[float]
    latency_left: float
    left: float = 1.0


class LinkSchedule:
    """The cluster's uplinks and process groups, simulated up to :attr:`now`."""

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster
        self.now = 0.0
        self.lane_workers = 2 if cluster.backend == "gloo" else 1
        self.sent = [0.0] * cluster.world_size
        self._queues: dict[tuple[object, ...], deque[ScheduledCollective]] = {}
        self._running: dict[tuple[object, ...], int] = {}
        self._flights: list[_Flight] = []
        self._done: dict[int, float] = {}

    def run(self, collectives: Sequence[ScheduledCollective]) -> list[float]:
        """Add ``collectives`` (each lane's in the given order); return each one's completion.

        Simulates until all of them are complete; collectives added before and still in
        flight share the uplinks with them, and whatever is still in flight afterwards
        carries over to the next call.
        """
        for collective in collectives:
            self._queues.setdefault(collective.lane, deque()).append(collective)
        while any(id(c) not in self._done for c in collectives):
            self._step()
        return [self._done[id(c)] for c in collectives]

    def _loads(self, collective: ScheduledCollective) -> list[float]:
        root = None if collective.root is None else collective.members.index(collective.root)
        return uplink_loads(collective.op, collective.nbytes, len(collective.members), root)

    def _start_ready(self) -> float:
        """Start every lane head that can start now; the next time a head could start."""
        upcoming = float("inf")
        for lane, queue in self._queues.items():
            while queue and self._running.get(lane, 0) < self.lane_workers:
                head = queue[0]
                issued = max(head.issued.values())
                if issued > self.now:
                    upcoming = min(upcoming, issued)
                    break
                queue.popleft()
                self._running[lane] = self._running.get(lane, 0) + 1
                size = len(head.members)
                latency = steps(head.op, size) * self.cluster.link.step_latency_s
                loads = self._loads(head)
                for member, load in zip(head.members, loads, strict=True):
                    self.sent[member] += load
                self._flights.append(_Flight(head, loads, latency, 1.0 if max(loads) > 0 else 0.0))
        return upcoming

    def _rates(self) -> list[float]:
        """Per flight, the share of its bytes it moves per second (0 while in its latency)."""
        sharing = [0] * self.cluster.world_size
        moving = [f for f in self._flights if f.latency_left <= 0 and f.left > 0]
        for flight in moving:
            for member, load in zip(flight.collective.members, flight.loads, strict=True):
                if load > 0:
                    sharing[member] += 1
        rates = []
        bandwidth = self.cluster.link.bytes_per_s
        for flight in self._flights:
            if flight.latency_left > 0 or flight.left <= 0:
                rates.append(0.0)
                continue
            rates.append(
                min(
                    bandwidth / sharing[member] / load
                    for member, load in zip(flight.collective.members, flight.loads, strict=True)
                    if load > 0
                )
            )
        return rates

    def _step(self) -> None:
        """Advance to the next event: a start, the end of a latency, a completion."""
        upcoming = self._start_ready()
        rates = self._rates()
        events = []  # per flight, when its latency or its transfer ends at the present rates
        for flight, rate in zip(self._flights, rates, strict=True):
            if flight.latency_left > 0:
                events.append(self.now + flight.latency_left)
            elif flight.left <= 0:
                events.append(self.now)
            else:
                events.append(self.now + flight.left / rate if rate > 0 else float("inf"))
        horizon = min([upcoming, *events])
        if horizon == float("inf"):
            raise RuntimeError("simulated collectives wait on each other: nothing can start")
        elapsed = horizon - self.now
        self.now = horizon
        still: list[_Flight] = []
        for flight, rate, event in zip(self._flights, rates, events, strict=True):
            reached = event <= horizon  # exactly: no rounding can leave a sliver behind
            if flight.latency_left > 0:
                flight.latency_left = 0.0 if reached else flight.latency_left - elapsed
            elif reached:
                flight.left = 0.0
            else:
                flight.left -= rate * elapsed
            if flight.latency_left <= 0 and flight.left <= 0:
                self._done[id(flight.collective)] = self.now
                self._running[flight.collective.lane] -= 1
            else:
                still.append(flight)
        self._flights = still
