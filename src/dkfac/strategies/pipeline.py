"""Factor communication launched from the module hooks, in fused buckets (SPD/PAD-KFAC).

A :class:`FactorPipeline` owns the ready-ordered list of factor slots (one per factor: A of
each layer in forward order, G in reverse) and a bucket plan over it. The hooks hand it each
factor's summed statistic as soon as the window's expected statistics are in (the strategy
decides, see :meth:`PipelinedStrategy.statistic_added`); a bucket's
collective (allreduce, or reduce to the bucket's owner) is launched as soon as the bucket is
complete **and every earlier bucket has been launched**.

Why the collective order is the same on every rank: buckets are launched strictly in plan
order, and the plan is identical on every rank (computed from the same inputs, or from values
agreed by an allreduce). Hook order only decides *when* a bucket goes, never *which* goes
next. A factor that never becomes ready (a layer unused in this forward pass, on one rank or
on all) holds its bucket back until :meth:`finish` in ``step()``, which fills it with zeros
(zero rows/examples) and launches the rest in order; statistics that came after their factor
was handed over follow as exact corrections (:meth:`finish`). The pipeline's collectives run on a
process group of their own, so they never interleave with DDP's gradient allreduces on the
default group.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.handle import CollectiveHandle
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.factor_side import packed_factor_values, sent_symmetric
from dkfac.curvature.staging import host_floats
from dkfac.curvature.statistics import SummedFactor


@dataclass(frozen=True)
class FactorSlot:
    """One Kronecker factor in the ready order: layer index, side (``"a"``/``"g"``), dim."""

    layer: int
    side: str
    dim: int

    def packed_bytes(self, element_size: int) -> int:
        """Bytes of the factor on the wire (its upper triangle; a diagonal one whole)."""
        return packed_factor_values(self.dim) * element_size


def ready_order_of(dims: Sequence[tuple[int, int]]) -> list[FactorSlot]:
    """Slots of layers given as ``(d_A, d_G)``: every A in forward order, then G in reverse."""
    slots = [FactorSlot(i, "a", a_dim) for i, (a_dim, _) in enumerate(dims)]
    slots += [FactorSlot(i, "g", g_dim) for i, (_, g_dim) in reversed(list(enumerate(dims)))]
    return slots


@dataclass(frozen=True)
class ReceivedFactor:
    """A factor after communication: the summed statistic (valid where it was delivered)."""

    slot: FactorSlot
    total: Tensor
    count: float


class FactorPipeline:
    """Launches each complete bucket's collective from the hooks, in plan order.

    Args:
        comm: the communicator (on the strategy's own process group).
        recorder: phase timing and the trace.
        slots: the factor slots; bucket entries index this list.
        buckets: the plan: lists of slot indices, launched in this order.
        destinations: per bucket, the rank that receives a reduce, or ``None`` (allreduce).
    """

    def __init__(
        self,
        comm: Communicator,
        recorder: StepRecorder,
        slots: Sequence[FactorSlot],
        buckets: Sequence[Sequence[int]],
        destinations: Sequence[int | None],
    ) -> None:
        self.comm = comm
        self.recorder = recorder
        self.slots = list(slots)
        self._index = {(slot.layer, slot.side): i for i, slot in enumerate(self.slots)}
        self.profile: list[list[float]] = []
        self.set_plan(buckets, destinations)
        self._reset()

    def set_plan(
        self, buckets: Sequence[Sequence[int]], destinations: Sequence[int | None]
    ) -> None:
        """Replace the bucket plan (between steps; the same on every rank)."""
        covered = sorted(i for bucket in buckets for i in bucket)
        if covered != list(range(len(self.slots))) or len(destinations) != len(buckets):
            raise ValueError("a fusion plan must cover every factor slot exactly once")
        self.buckets = [list(bucket) for bucket in buckets]
        self.destinations = list(destinations)

    def _reset(self) -> None:
        self._totals: list[Tensor | None] = [None] * len(self.slots)
        self._counts = [0] * len(self.slots)
        self._ready_at = [float("nan")] * len(self.slots)
        self._origin: float | None = None
        self._next = 0
        self._handles: list[CollectiveHandle] = []

    def has(self, layer: int, side: str) -> bool:
        """Whether the factor was handed over in the current window."""
        return self._totals[self._index[(layer, side)]] is not None

    def ready(self, layer: int, side: str, total: Tensor, count: int) -> None:
        """Hand over one factor's summed statistic; launch every bucket that is now due."""
        now = time.perf_counter()
        if self._origin is None:
            self._origin = now
        slot = self._index[(layer, side)]
        self._totals[slot], self._counts[slot] = total, count
        self._ready_at[slot] = now - self._origin
        self._launch_due()

    def _launch_due(self) -> None:
        while self._next < len(self.buckets) and all(
            self._totals[i] is not None for i in self.buckets[self._next]
        ):
            bucket, destination = self.buckets[self._next], self.destinations[self._next]
            tensors = [self._totals[i] for i in bucket]
            with self.recorder.phase("factor_comm"):
                if destination is None:
                    handle = self.comm.allreduce(
                        tensors,  # type: ignore[arg-type]
                        phase="factor_comm",
                        symmetric=sent_symmetric(tensors),  # type: ignore[arg-type]
                    )
                else:
                    handle = self.comm.reduce(
                        tensors,  # type: ignore[arg-type]
                        destination,
                        phase="factor_comm",
                        symmetric=sent_symmetric(tensors),  # type: ignore[arg-type]
                    )
            self._handles.append(handle)
            self._next += 1

    def finish(
        self,
        zeros: Callable[[FactorSlot], Tensor],
        profile: bool,
        late: Sequence[SummedFactor | None] | None = None,
    ) -> list[ReceivedFactor]:
        """Launch what is left (zeros for factors never ready), wait, return every factor.

        Called from ``step()`` on every rank. Counts travel in one float64 allreduce (exact
        integers, whatever ``comm_dtype`` is), with one more value: how many ranks have
        ``late`` statistics (per slot, what arrived after the factor was handed over). When
        some rank has, the late sums follow in collectives of their own (allreduce, or reduce
        to the slot's destination) and are added to what was received, so the result is
        exactly the window's; otherwise nothing more is sent. With ``profile``, this
        window's ready times are kept for re-planning.
        """
        late = list(late) if late is not None else [None] * len(self.slots)
        for i, slot in enumerate(self.slots):
            if self._totals[i] is None:
                self._totals[i] = zeros(slot)
        self._launch_due()
        device = self._totals[0].device  # type: ignore[union-attr]
        counts = [
            c + (0 if extra is None else extra.count)
            for c, extra in zip(self._counts, late, strict=True)
        ]
        has_late = any(extra is not None for extra in late)
        counts_tensor = host_floats([*counts, float(has_late)], device)
        with self.recorder.phase("factor_comm"):
            count_handle = self.comm.allreduce([counts_tensor], phase="factor_comm", exact=True)
            for handle in self._handles:
                handle.wait()
            count_handle.wait()
        if profile:
            ended = time.perf_counter() - (self._origin or time.perf_counter())
            # A factor never handed over by the hooks counts as ready when step() sent it.
            self.profile.append([ended if math.isnan(t) else t for t in self._ready_at])
        *totals, ranks_with_late = counts_tensor.tolist()
        if ranks_with_late > 0:
            self._add_late(zeros, late)
        received = [
            ReceivedFactor(slot, total, count)  # type: ignore[arg-type]
            for slot, total, count in zip(self.slots, self._totals, totals, strict=True)
        ]
        self._reset()
        return received

    def _add_late(
        self, zeros: Callable[[FactorSlot], Tensor], late: Sequence[SummedFactor | None]
    ) -> None:
        """Agree which slots have late statistics somewhere, send them, add them in."""
        device = self._totals[0].device  # type: ignore[union-attr]
        flags = torch.tensor(
            [0.0 if extra is None else 1.0 for extra in late], dtype=torch.float64, device=device
        )
        with self.recorder.phase("factor_comm"):
            self.comm.allreduce([flags], phase="factor_comm", maximum=True, exact=True).wait()
            flagged = [i for i, flag in enumerate(flags.tolist()) if flag > 0]
            destination_of = {
                i: self.destinations[k] for k, b in enumerate(self.buckets) for i in b
            }
            corrections = {
                i: zeros(self.slots[i]) if late[i] is None else late[i].total.clone()  # type: ignore[union-attr]
                for i in flagged
            }
            # One collective per destination (allreduce first, then owners ascending): the
            # same order on every rank, since the flags and the plan are the same everywhere.
            destinations = sorted(
                {destination_of[i] for i in flagged}, key=lambda d: -1 if d is None else d
            )
            for destination in destinations:
                slots = [i for i in flagged if destination_of[i] == destination]
                tensors = [corrections[i] for i in slots]
                symmetric = sent_symmetric(tensors)
                if destination is None:
                    handle = self.comm.allreduce(tensors, phase="factor_comm", symmetric=symmetric)
                else:
                    handle = self.comm.reduce(
                        tensors, destination, phase="factor_comm", symmetric=symmetric
                    )
                handle.wait()
        for i in flagged:  # valid where the slot's result is (everywhere, or its destination)
            self._totals[i] = self._totals[i] + corrections[i]  # type: ignore[operator]

    def median_ready_times(self) -> list[float]:
        """Per slot, the median ready time over the profiled windows (seconds from the first)."""
        return [statistics.median(column) for column in zip(*self.profile, strict=True)]
