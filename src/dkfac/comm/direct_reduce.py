"""A reduce at two ranks as one send: the owner's uplink stays free for traffic the other way.

gloo's reduce is a reduce-scatter and a gather. At two ranks it moves as many bytes over the
sender's uplink as one send of the whole bucket, and half a bucket over the destination's
uplink as well, which a reduce the other way (PAD's other owner) needs. So at two ranks on
gloo, :meth:`~dkfac.comm.communicator.Communicator.reduce` sends each bucket whole and the
destination adds it to its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dkfac.comm.wire import FusionBucket


def reduces_by_sending(backend: str, size: int) -> bool:
    """Whether a reduce over ``size`` ranks on ``backend`` is one direct send, on its own lane.

    See :meth:`Communicator.reduce` and :meth:`Communicator.open_lanes`; the simulator
    (:mod:`dkfac.sim`) asks the same question of the clusters it predicts.
    """
    return backend == "gloo" and size == 2


class DirectReduce:
    """One reduce to ``dst`` over a two-rank ``group``, bucket by bucket.

    Args:
        rank: this process's global rank.
        dst: the destination's global rank.
        group: the two-rank process group (``None``: the world).
    """

    def __init__(self, rank: int, dst: int, group: Any) -> None:
        self.rank = rank
        self.dst = dst
        self.group = group
        self._owner = dist.get_group_rank(group, dst) if group is not None else dst
        self._received: dict[int, Tensor] = {}

    def send(self, bucket: FusionBucket) -> Any:
        """Start moving ``bucket``: the other rank sends it, ``dst`` receives it aside."""
        # all_to_all with one non-empty split: gloo's send, with a future to trace.
        splits = [0, 0]
        empty = bucket.flat.new_empty(0)
        if self.rank == self.dst:
            splits[1 - self._owner] = bucket.flat.numel()
            self._received[id(bucket)] = incoming = torch.empty_like(bucket.flat)
            return dist.all_to_all_single(
                incoming, empty, splits, [0, 0], group=self.group, async_op=True
            )
        splits[self._owner] = bucket.flat.numel()
        return dist.all_to_all_single(
            empty, bucket.flat, [0, 0], splits, group=self.group, async_op=True
        )

    def add_received(self, bucket: FusionBucket) -> bool:
        """After the send: ``dst`` adds what it received; whether to unpack the bucket."""
        if self.rank != self.dst:
            return False
        bucket.flat.add_(self._received.pop(id(bucket)))
        return True


def reduce_steps(
    rank: int, dst: int, group: Any, direct: bool
) -> tuple[Callable[[FusionBucket], Any], Callable[[FusionBucket], bool]]:
    """How each bucket of a reduce to ``dst`` starts, and, after it, whether it is unpacked.

    ``direct``: one send (:class:`DirectReduce`); otherwise the backend's reduce, after which
    only ``dst`` holds the sum.
    """
    if direct:
        reduce = DirectReduce(rank, dst, group)
        return reduce.send, reduce.add_received

    def start(bucket: FusionBucket) -> Any:
        return dist.reduce(bucket.flat, dst, group=group, async_op=True)

    return start, lambda bucket: rank == dst
