"""A communicator without a process group: it fuses, packs and counts, and sends nothing.

The dry run (:mod:`dkfac.strategies.accounting`) runs the strategies' own runner against it
for every rank of a world that does not exist: each collective is split into buckets by the
real communicator's fusion rule and counted in its :class:`StepRecorder` exactly as a real
run counts it (payload, calls, wire bytes), and is complete at once (all-gathers and
reduce-scatters too). Tensors are only read for their shapes and dtypes (``device="meta"``
tensors serve), so no data moves and results are whatever the tensors held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dkfac.comm.communicator import Communicator, ProcessGroup
from dkfac.comm.recorder import StepRecorder


@dataclass(frozen=True)
class IssuedCollective:
    """One fused collective a :class:`RecordingCommunicator` was asked for, in issue order.

    Attributes:
        phase: the phase it is counted in.
        op: ``"allreduce"``, ``"reduce"``, ``"broadcast"``, ``"reduce_scatter"`` or
            ``"all_gather"``.
        nbytes: payload of the bucket.
        group: the ranks of its process group; ``None``: the communicator's world.
        root: a reduce's destination or a broadcast's source (global rank), else ``None``.
        issued_at: the communicator's :attr:`RecordingCommunicator.clock` when it was issued.
    """

    phase: str
    op: str
    nbytes: int
    group: tuple[int, ...] | None
    root: int | None
    issued_at: float


class RecordingCommunicator(Communicator):
    """Rank ``rank`` of a world of ``world_size``, counting collectives instead of running them.

    Process groups are their rank tuples (:meth:`new_groups`), so a collective's size is known.

    Args:
        recorder: where bytes and calls are counted.
        world_size: number of ranks of the pretended world.
        rank: the rank this communicator speaks for.
        bucket_cap_mb: largest fused buffer in MiB, as :class:`Communicator`.
        comm_dtype: transport dtype, as :class:`Communicator`.
        issued: where each fused collective is appended as an :class:`IssuedCollective`
            (``None``: only counted), stamped with :attr:`clock`, which the caller sets.
    """

    sends = False

    def __init__(
        self,
        recorder: StepRecorder,
        world_size: int,
        rank: int,
        *,
        bucket_cap_mb: float = 25.0,
        comm_dtype: torch.dtype | None = None,
        issued: list[IssuedCollective] | None = None,
    ) -> None:
        self._pretended = (rank, world_size)
        self.issued = issued
        self.clock = 0.0
        super().__init__(recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype)

    def _count(
        self,
        phase: str,
        op: str,
        nbytes: int,
        group: ProcessGroup | None,
        root: int | None = None,
    ) -> None:
        """Count as the real communicator does; keep the collective when :attr:`issued` is set."""
        super()._count(phase, op, nbytes, group, root)
        if self.issued is not None:
            ranks = group if isinstance(group, tuple) else None
            self.issued.append(IssuedCollective(phase, op, nbytes, ranks, root, self.clock))

    def _membership(self, group: ProcessGroup | None) -> tuple[int, int]:
        """The pretended rank and world size."""
        return self._pretended

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the pretended world."""
        return tuple(range(self.world_size))

    @property
    def backend(self) -> str:
        """No backend: nothing is sent."""
        return "recording"

    def new_groups(self, layouts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Any]:
        """Each layout stands for itself (single-rank ones: ``None``, as for real)."""
        return {tuple(ranks): tuple(ranks) if len(ranks) > 1 else None for ranks in layouts}

    def close(self) -> None:
        """Nothing to release."""

    def group_size(self, group: ProcessGroup | None) -> int:
        """The length of a layout made by :meth:`new_groups` (``None``: the world)."""
        return len(group) if isinstance(group, tuple) else self.world_size
