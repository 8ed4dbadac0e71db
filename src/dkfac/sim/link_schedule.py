"""When each collective of a step runs: its members, its process group's workers, the uplinks.

A collective starts once every member has issued it, a worker of its process group is free
(collectives of one group start in issue order; gloo runs two at a time, NCCL one) and the
uplinks it loads (:func:`~dkfac.sim.network.uplink_loads`) are free; it then holds them for
its duration (:meth:`~dkfac.sim.network.LinkModel.seconds`). Among the groups' next
collectives, the one that can start first goes first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dkfac.sim.network import uplink_loads
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


class LinkSchedule:
    """Uplinks and process groups of the cluster, with when each is next free."""

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster
        self.uplink_free = [0.0] * cluster.world_size
        # Per process group, when each of the backend's workers on it is next free: gloo runs
        # a group's collectives on two threads (two can be in flight), NCCL on one stream.
        self.lane_free: dict[tuple[object, ...], list[float]] = {}
        self.lane_workers = 2 if cluster.backend == "gloo" else 1
        self.sent = [0.0] * cluster.world_size

    def run(self, collectives: Sequence[ScheduledCollective]) -> list[float]:
        """Schedule ``collectives`` (each lane's in order); return each one's completion."""
        lanes: dict[tuple[object, ...], deque[int]] = {}
        for index, collective in enumerate(collectives):
            lanes.setdefault(collective.lane, deque()).append(index)
        done = [0.0] * len(collectives)
        while any(lanes.values()):
            best: tuple[float, int] | None = None
            for queue in lanes.values():
                if queue:
                    start = self._earliest_start(collectives[queue[0]])
                    if best is None or start < best[0]:
                        best = (start, queue[0])
            assert best is not None
            start, index = best
            lanes[collectives[index].lane].popleft()
            done[index] = self._occupy(collectives[index], start)
        return done

    def _loads(self, collective: ScheduledCollective) -> list[float]:
        root = None if collective.root is None else collective.members.index(collective.root)
        return uplink_loads(collective.op, collective.nbytes, len(collective.members), root)

    def _earliest_start(self, collective: ScheduledCollective) -> float:
        busy = [
            self.uplink_free[member]
            for member, load in zip(collective.members, self._loads(collective), strict=True)
            if load > 0
        ]
        workers = self.lane_free.setdefault(collective.lane, [0.0] * self.lane_workers)
        return max(max(collective.issued.values()), min(workers), *busy)

    def _occupy(self, collective: ScheduledCollective, start: float) -> float:
        link = self.cluster.link
        loads = self._loads(collective)
        end = start + link.seconds(
            collective.op,
            collective.nbytes,
            len(collective.members),
            None if collective.root is None else collective.members.index(collective.root),
        )
        workers = self.lane_free[collective.lane]
        workers[workers.index(min(workers))] = end
        for member, load in zip(collective.members, loads, strict=True):
            self.sent[member] += load
            if load > 0:
                self.uplink_free[member] = end
        return end
