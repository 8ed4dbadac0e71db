"""When each collective of a step runs: its process group's workers and the shared uplinks.

A collective starts once every member has issued it and a worker of its process group is
free: one group's collectives start in issue order, NCCL's one stream at a time, gloo's two
threads two at a time. It then waits its start-up latencies (:func:`~dkfac.sim.network.steps`)
and moves its bytes (:func:`~dkfac.sim.network.uplink_loads`). Collectives in flight at the
same time share each uplink they load fairly, as TCP flows (or NCCL channels) of different
process groups do: each of ``n`` transfers on an uplink gets ``1/n`` of its bandwidth, and a
transfer advances at the pace of its most crowded uplink. The schedule is simulated event by
event (a start, the end of a latency, a completion).

A step is run as one schedule (:meth:`LinkSchedule.run_stages`): each worker goes through the
same stages, issuing a stage's collectives after its compute before them and moving on once
the collectives it waits for are complete, so a worker whose groups finish early issues its
next collectives early, and transfers still in flight slow down those issued after them.
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
    done_at: float | None = None  # when it completed on the simulated links

    def issued_by_all(self) -> float:
        """When the last member issued it (infinity while one has not yet)."""
        times = [self.issued.get(member, float("nan")) for member in self.members]
        return float("inf") if any(t != t for t in times) else max(times)


@dataclass
class Stage:
    """One stage of every worker's step.

    Attributes:
        name: what the stage does (its time is reported under it).
        collectives: what it issues, in issue order; a member's issue time that is NaN is
            set to the moment that member has done ``before`` (others keep their own, e.g.
            a hook's).
        waits: what a worker waits for (those it is a member of) before ``after``.
        before: per worker, compute before issuing.
        after: per worker, compute once its waits are complete.
    """

    name: str
    collectives: Sequence[ScheduledCollective]
    waits: Sequence[ScheduledCollective]
    before: Sequence[float]
    after: Sequence[float]


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

    def run(self, collectives: Sequence[ScheduledCollective]) -> list[float]:
        """Add ``collectives`` (each lane's in the given order); return each one's completion.

        Simulates until all of them are complete (all members' issue times must be set);
        collectives added before and still in flight share the uplinks with them.
        """
        self._enqueue(collectives)
        while any(c.done_at is None for c in collectives):
            self._step()
        return [c.done_at for c in collectives if c.done_at is not None]

    def run_stages(self, stages: Sequence[Stage], start: Sequence[float]) -> list[list[float]]:
        """Run every worker through ``stages`` from its ``start``; each one's clock after each.

        Returns ``ends[s][worker]``: when the worker finished stage ``s`` (its waits complete
        and ``after`` done). All stages' collectives are queued up front, in stage order, so
        each lane keeps its issue order; a worker issues its share when it reaches the stage.
        """
        for stage in stages:
            self._enqueue(stage.collectives)
        workers = range(self.cluster.world_size)
        ends = [[0.0] * len(workers) for _ in stages]
        reached = [0] * len(workers)  # per worker, the stage it is in
        issue_at = [0.0] * len(workers)
        clock = list(start)

        def begin(worker: int) -> None:
            stage = stages[reached[worker]]
            issue_at[worker] = clock[worker] + stage.before[worker]
            for collective in stage.collectives:
                known = collective.issued.get(worker, float("nan"))
                if worker in collective.members and known != known:
                    collective.issued[worker] = issue_at[worker]

        def advance() -> bool:
            """Move every worker whose waits are complete on; whether one is still inside."""
            inside = False
            for worker in workers:
                while reached[worker] < len(stages):
                    stage = stages[reached[worker]]
                    mine = [c.done_at for c in stage.waits if worker in c.members]
                    if any(done is None for done in mine):
                        inside = True
                        break
                    finished = max([issue_at[worker], *(d for d in mine if d is not None)])
                    clock[worker] = finished + stage.after[worker]
                    ends[reached[worker]][worker] = clock[worker]
                    reached[worker] += 1
                    if reached[worker] < len(stages):
                        begin(worker)
            return inside

        if stages:
            for worker in workers:
                begin(worker)
        while advance():
            self._step()
        return ends

    def _enqueue(self, collectives: Sequence[ScheduledCollective]) -> None:
        for collective in collectives:
            self._queues.setdefault(collective.lane, deque()).append(collective)

    def _loads(self, collective: ScheduledCollective) -> list[float]:
        root = None if collective.root is None else collective.members.index(collective.root)
        return uplink_loads(collective.op, collective.nbytes, len(collective.members), root)

    def _start_ready(self) -> float:
        """Start every lane head that can start now; the next time a head could start."""
        upcoming = float("inf")
        for lane, queue in self._queues.items():
            while queue and self._running.get(lane, 0) < self.lane_workers:
                head = queue[0]
                issued = head.issued_by_all()
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
                flight.collective.done_at = self.now
                self._running[flight.collective.lane] -= 1
            else:
                still.append(flight)
        self._flights = still
