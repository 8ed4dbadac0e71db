"""The one door to ``torch.distributed``: fused, packed, accounted, asynchronous collectives.

Strategies never call ``torch.distributed`` themselves: they hand lists of tensors to a
:class:`Communicator`, which

* fuses them into flat buffers of at most ``bucket_cap_mb``
  (:class:`~dkfac.comm.wire.FusionBucket`), one collective per bucket;
* sends only the upper triangle of tensors marked symmetric (``d(d+1)/2`` values);
* optionally transports in a lower precision (``comm_dtype``) and restores the working dtype
  (``exact=True`` keeps a collective in its own dtype: counts, agreed values);
* records bytes and calls per (phase, collective) in the :class:`StepRecorder`, and, on
  ``wait()``, when each collective was in flight (launch to completion,
  :mod:`dkfac.comm.flight`);
* returns a :class:`CollectiveHandle` at once; results land in the given tensors on ``wait()``.

Every rank must issue the same collectives in the same order (the usual ``torch.distributed``
contract); the strategies guarantee it by iterating over layers and owners in a fixed order.

Process groups are made here too (:meth:`Communicator.new_groups`, ``with_own_group``,
``open_lanes``), released by :meth:`Communicator.close`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from dkfac.comm.direct_reduce import reduce_steps, reduces_by_sending
from dkfac.comm.flight import Flight, follow
from dkfac.comm.groups import default_group_timeout
from dkfac.comm.handle import CollectiveHandle, Pending
from dkfac.comm.lanes import Lanes
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.wire import (
    FusedPayload,
    FusionBucket,
    plan_fusion,
    record_collective,
)

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps mypy independent of torch stubs


class Communicator:
    """Asynchronous fused collectives over a process group, with accounting.

    Args:
        recorder: where bytes and calls are counted.
        bucket_cap_mb: largest fused buffer in MiB (``0`` sends each tensor alone).
        comm_dtype: transport dtype (e.g. ``torch.bfloat16``); ``None`` keeps each tensor's.
        group: the process group of all participants (default: the world). A group passed
            here belongs to the caller: :meth:`close` leaves it alone.
    """

    #: Whether collectives run; :class:`~dkfac.comm.recording.RecordingCommunicator` only
    #: counts them.
    sends: ClassVar[bool] = True

    def __init__(
        self,
        recorder: StepRecorder,
        *,
        bucket_cap_mb: float = 25.0,
        comm_dtype: torch.dtype | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.recorder = recorder
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.comm_dtype = comm_dtype
        self.group = group
        self.rank, self.world_size = self._membership(group)
        self._owns_group = False
        self._subgroups: list[ProcessGroup] = []  # made by new_groups, with this rank in them
        self._lanes: Lanes[ProcessGroup | None] = Lanes(group)  # root -> its group

    def _membership(self, group: ProcessGroup | None) -> tuple[int, int]:
        """This process's global rank and the size of ``group`` (``None``: the world)."""
        return dist.get_rank(), dist.get_world_size(group)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of :attr:`group`, in group order."""
        if self.group is None:
            return tuple(range(self.world_size))
        return tuple(dist.get_process_group_ranks(self.group))

    @property
    def backend(self) -> str:
        """The backend of :attr:`group` (``"gloo"``, ``"nccl"``)."""
        return str(dist.get_backend(self.group))

    # -- groups ----------------------------------------------------------------------------
    @classmethod
    def with_own_group(
        cls,
        recorder: StepRecorder,
        *,
        bucket_cap_mb: float = 25.0,
        comm_dtype: torch.dtype | None = None,
    ) -> Communicator:
        """A communicator on a new process group of all ranks, which it owns.

        Collectives launched from autograd hooks need a group of their own: DDP allreduces
        gradients on the default group from its own hooks, and two streams of collectives on
        one group could interleave differently on different ranks. Every rank must call it,
        in the same order as its other group creations; :meth:`close` destroys the group.
        """
        group = dist.new_group(list(range(dist.get_world_size())), timeout=default_group_timeout())
        comm = cls(recorder, bucket_cap_mb=bucket_cap_mb, comm_dtype=comm_dtype, group=group)
        comm._owns_group = True
        return comm

    @property
    def owns_group(self) -> bool:
        """Whether :meth:`close` destroys :attr:`group` (made by :meth:`with_own_group`)."""
        return self._owns_group

    @property
    def subgroups(self) -> int:
        """Groups made by :meth:`new_groups` that this rank belongs to and :meth:`close` frees."""
        return len(self._subgroups)

    def close(self) -> None:
        """Destroy the groups this communicator made (idempotent; other groups: nothing).

        Afterwards :attr:`group` is ``None`` if it was its own. Every rank calls it, like the
        group creation. Each group is destroyed only after a barrier on it: a rank that
        returns from ``new_group`` may still have a peer inside it (gloo's full-mesh
        handshake finishes on each side separately), and destroying the group then closes
        the sockets under that peer's handshake ("Connection closed by peer" in
        ``new_group``). The barrier also waits for this rank's pending work on the group.
        Groups are visited in the same order on every rank, so the barriers cannot deadlock.

        Raises:
            RuntimeError: a barrier failed (a peer is gone); every group is released first.
        """
        groups, self._subgroups = self._subgroups, []
        if self._owns_group and self.group is not None:
            groups.append(self.group)
            self.group = None
        self._lanes = Lanes(self.group)
        self._owns_group = False
        failure: BaseException | None = None
        for group in groups:
            try:
                dist.barrier(group=group)
            except RuntimeError as error:  # a peer is gone: release the rest, then report
                failure = failure or error
            dist.destroy_process_group(group)
        if failure is not None:
            raise failure

    def new_groups(self, layouts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Any]:
        """Create one process group per rank list, on every rank, in the given order.

        ``torch.distributed.new_group`` must be called by all ranks for every group in the
        same order; callers pass the same ``layouts`` on every rank. Single-rank lists get no
        group (``None``): there is nothing to communicate. The communicator's own ranks get its
        own group (the world's when it has none), not a new one.
        """
        groups: dict[tuple[int, ...], Any] = {}
        for ranks in layouts:
            key = tuple(ranks)
            if len(key) <= 1:
                groups[key] = None
            elif key == self.ranks:
                groups[key] = self.group if self.group is not None else dist.group.WORLD
            else:
                groups[key] = dist.new_group(list(key), timeout=default_group_timeout())
                if self.rank in key:  # elsewhere torch returns a non-member placeholder
                    self._subgroups.append(groups[key])
        return groups

    # -- buckets ---------------------------------------------------------------------------
    def fusion_plan(
        self, tensors: Sequence[Tensor], symmetric: Sequence[bool], *, exact: bool = False
    ) -> list[FusedPayload]:
        """How ``tensors`` are fused: at most ``bucket_cap_mb`` per collective, in order.

        Buckets travel in ``comm_dtype`` unless ``exact``, then in their tensors' own dtype.
        """
        return plan_fusion(
            [tuple(t.shape) for t in tensors],
            [t.dtype for t in tensors],
            list(symmetric),
            self.bucket_cap_bytes,
            None if exact else self.comm_dtype,
        )

    # -- collectives -----------------------------------------------------------------------
    def allreduce(
        self,
        tensors: Sequence[Tensor],
        *,
        phase: str,
        symmetric: Sequence[bool] | None = None,
        average: bool = False,
        maximum: bool = False,
        group: ProcessGroup | None = None,
        exact: bool = False,
    ) -> CollectiveHandle:
        """Sum (average, or element-wise maximum) ``tensors`` over ``group``, in place.

        ``exact`` sends the tensors in their own dtype whatever ``comm_dtype`` says: for
        values that must not be rounded (float64 row/example counts, times all ranks agree on).
        """
        size = self.group_size(group)
        scale = 1.0 / size if average else None
        op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
        return self._launch(
            "allreduce",
            tensors,
            symmetric,
            phase,
            lambda b: dist.all_reduce(b.flat, op=op, group=group or self.group, async_op=True),
            scale,
            group=group,
            exact=exact,
        )

    def reduce(
        self,
        tensors: Sequence[Tensor],
        dst: int,
        *,
        phase: str,
        symmetric: Sequence[bool] | None = None,
        average: bool = False,
        group: ProcessGroup | None = None,
    ) -> CollectiveHandle:
        """Sum (or average) ``tensors`` onto global rank ``dst`` only (others: unchanged).

        On the own group it travels on ``dst``'s lane (:meth:`open_lanes`); at two ranks on
        gloo it is one send per bucket, added at ``dst``; elsewhere the backend's reduce.
        """
        size = self.group_size(group)
        scale = 1.0 / size if average else None
        target = self._lane(dst, group)
        start, unpack = reduce_steps(self.rank, dst, target, self._sends_directly(target))
        scale = scale if self.rank == dst else None
        return self._launch(
            "reduce", tensors, symmetric, phase, start, scale, unpack, group=group, root=dst
        )

    def _sends_directly(self, group: ProcessGroup | None) -> bool:
        """Whether a reduce on ``group`` is one send (:mod:`dkfac.comm.direct_reduce`)."""
        backend = str(dist.get_backend(group)) if self.sends else self.backend
        return self.sends and reduces_by_sending(backend, self.group_size(group))

    def _lane(self, root: int, group: ProcessGroup | None) -> ProcessGroup | None:
        """The group a collective rooted at ``root`` travels on: its lane on the own group."""
        world = self.group is None and group is dist.group.WORLD
        own = group is None or group is self.group or world
        return self._lanes.route(root) if own else group

    def open_lanes(self, roots: Iterable[int]) -> None:
        """Let reduces to, and broadcasts from, different ``roots`` travel at the same time.

        Each root gets a process group of the own ranks (:class:`~dkfac.comm.lanes.Lanes`),
        only over the whole world at two ranks on gloo. Collective, like ``new_group``;
        :meth:`close` destroys them.
        """
        if self._sends_directly(self.group) and self.world_size == dist.get_world_size():
            ranks = list(self.ranks)
            timeout = default_group_timeout()
            made = self._lanes.open(roots, lambda: dist.new_group(ranks, timeout=timeout))
            self._subgroups.extend(made)

    def broadcast(
        self,
        tensors: Sequence[Tensor],
        src: int,
        *,
        phase: str,
        symmetric: Sequence[bool] | None = None,
        group: ProcessGroup | None = None,
    ) -> CollectiveHandle:
        """Copy ``tensors`` of global rank ``src`` into the same tensors on every rank.

        When the transport dtype rounds them (``comm_dtype``), ``src`` keeps the rounded
        values too, so every rank ends with bitwise the same tensors. It travels on ``src``'s
        lane (:meth:`open_lanes`) on the own group.
        """
        target = self._lane(src, group)
        return self._launch(
            "broadcast",
            tensors,
            symmetric,
            phase,
            lambda b: dist.broadcast(b.flat, src, group=target, async_op=True),
            None,
            unpack=lambda b: self.rank != src or b.rounds,
            group=group,
            root=src,
        )

    def all_gather(
        self, chunk: Tensor, output: Tensor, *, phase: str, group: ProcessGroup | None = None
    ) -> CollectiveHandle:
        """Gather equal ``chunk``s of every rank into ``output`` (rank-major, flat)."""
        # all_gather_single replaces all_gather_into_tensor in newer torch (same signature).
        self._count(phase, "all_gather", output.numel() * output.element_size(), group)
        if not self.sends:
            return CollectiveHandle([])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        launched = self.recorder.now()
        work = gather(output, chunk, group=group or self.group, async_op=True)
        return CollectiveHandle([(work, lambda: None, self._follow(work, output, phase, launched))])

    def reduce_scatter(
        self, flat: Tensor, chunk: Tensor, *, phase: str, group: ProcessGroup | None = None
    ) -> CollectiveHandle:
        """Sum ``flat`` over ranks; rank ``r`` receives the ``r``-th equal slice in ``chunk``.

        On gloo the sum is an all-to-all (rank ``r`` receives every rank's ``r``-th slice)
        followed by a local sum on ``wait()``: the same ``(P-1)/P`` of ``flat`` on the wire,
        but measured 2-4x faster than gloo's own reduce-scatter on loopback (1-32 MiB, P = 2
        and 4), which does not pipeline its ring. Other backends use their native collective.
        """
        target = group or self.group
        self._count(phase, "reduce_scatter", flat.numel() * flat.element_size(), group)
        if not self.sends:
            return CollectiveHandle([])
        if dist.get_backend(target) == "gloo":
            ranks = dist.get_world_size(target)
            received = torch.empty_like(flat)
            launched = self.recorder.now()
            work = dist.all_to_all_single(received, flat, group=target, async_op=True)

            def finish() -> None:
                torch.sum(received.view(ranks, -1), dim=0, out=chunk.view(-1))

            return CollectiveHandle([(work, finish, self._follow(work, flat, phase, launched))])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        launched = self.recorder.now()
        work = scatter(chunk, flat, group=target, async_op=True)
        return CollectiveHandle([(work, lambda: None, self._follow(work, flat, phase, launched))])

    def group_size(self, group: ProcessGroup | None) -> int:
        """Number of ranks in ``group`` (``None``: the communicator's own group)."""
        return dist.get_world_size(group) if group is not None else self.world_size

    def _count(
        self,
        phase: str,
        op: str,
        nbytes: int,
        group: ProcessGroup | None,
        root: int | None = None,
    ) -> None:
        """Count one collective (``root``: a reduce's destination, a broadcast's source)."""
        record_collective(self.recorder, phase, op, nbytes, self.group_size(group))

    def _follow(self, work: Any, buffer: Tensor, phase: str, launched: float) -> Flight | None:
        return follow(work, buffer, self.recorder, phase, launched)

    def _launch(
        self,
        op: str,
        tensors: Sequence[Tensor],
        symmetric: Sequence[bool] | None,
        phase: str,
        start: Callable[[FusionBucket], Any],
        scale: float | None,
        unpack: Callable[[FusionBucket], bool] = lambda bucket: True,
        group: ProcessGroup | None = None,
        exact: bool = False,
        root: int | None = None,
    ) -> CollectiveHandle:
        """Start ``op`` on each bucket; on ``wait()`` write back the buckets ``unpack`` says.

        ``unpack`` runs on ``wait()`` after the bucket's collective: it may complete the
        bucket's result first (a direct reduce adds what it received) and says whether the
        bucket is written back into its tensors.

        Every bucket is counted; it is packed and sent only when :attr:`sends` is true.
        """
        pending: list[Pending] = []
        flags = list(symmetric) if symmetric is not None else [False] * len(tensors)
        for payload in self.fusion_plan(tensors, flags, exact=exact):
            self._count(phase, op, payload.nbytes, group, root)
            if not self.sends:
                continue
            part = slice(payload.start, payload.end)
            bucket = FusionBucket(list(tensors[part]), flags[part], payload.dtype)
            launched = self.recorder.now()  # after packing: the flight is the transfer only
            work = start(bucket)

            def finish(bucket: FusionBucket = bucket) -> None:
                if unpack(bucket):
                    bucket.unpack(scale)

            pending.append((work, finish, self._follow(work, bucket.flat, phase, launched)))
        return CollectiveHandle(pending)
