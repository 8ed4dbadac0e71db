"""Lanes: a process group per collective root, so different roots' collectives overlap.

gloo runs one group's collectives on two worker threads in the order they were issued. Two
roots' reduces or broadcasts on one group (the two directions of every link at two ranks)
therefore overlap only when the threads happen to take them so: two 20 MB broadcasts from
ranks 0 and 1 at 100 Mbit/s measured 1.70, 1.88 and 3.33 s, one alone 1.67 s. With a group
per root, each root's collectives queue only behind its own.

Lanes are opened only where they pay and stay cheap: over the whole world at two ranks on
gloo (:func:`~dkfac.comm.direct_reduce.reduces_by_sending`). P groups of P ranks would
multiply gloo's connections; NCCL orders a group's collectives on one stream anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

#: A process group (``torch.distributed.ProcessGroup``, ``None`` for the world), or what the
#: simulator names one by.
Group = TypeVar("Group")


class Lanes(Generic[Group]):
    """Which process group carries a collective rooted at each rank.

    Args:
        own: the communicator's group, the first root's lane.
    """

    def __init__(self, own: Group) -> None:
        self.own = own
        self._by_root: dict[int, Group] = {}

    def open(self, roots: Iterable[int], new_group: Callable[[], Group]) -> list[Group]:
        """Give every root without a lane one; returns the groups made (the caller frees them).

        The lowest new root takes the own group when no lane exists yet; each further root
        gets ``new_group()``. Every rank must pass the same roots (group creation is
        collective); roots are visited in ascending order.
        """
        made: list[Group] = []
        for root in sorted(set(roots) - set(self._by_root)):
            lane = self.own
            if self._by_root:
                lane = new_group()
                made.append(lane)
            self._by_root[root] = lane
        return made

    def route(self, root: int) -> Group:
        """The group for a collective of the own group rooted at ``root``."""
        return self._by_root.get(root, self.own)

    def __len__(self) -> int:
        return len(self._by_root)
