"""One Kronecker factor of one layer on one worker: its window's statistics and running average.

A layer's curvature is ``A ⊗ G``; both factors live the same life: statistics accumulate over
a capture window (:class:`~dkfac.curvature.statistics.FactorStatistics`), the window's batch
factor is folded into a running average, and the average is decomposed. A
:class:`KroneckerFactor` is that life for one side (``"a"``: the layer's input, ``"g"``: the
gradient of its output), so a layer holds two of them instead of paired fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.factor_side import factor_shape
from dkfac.curvature.finite import all_finite
from dkfac.curvature.running_average import (
    divided,
    fold_order,
    running_average,
    running_averages,
)
from dkfac.curvature.staging import host_floats
from dkfac.curvature.statistics import FactorStatistics
from dkfac.curvature.tikhonov import trace_mean

#: Dropped-batch flags a factor keeps before summing them (reads are at decompositions).
_PENDING_FLAGS = 64

#: "A batch was dropped" (1) or not (0) for one factor at one fold: an int64 device tensor,
#: shared by the factors folded together, and the factor's entry in it, flattened.
DroppedFlag = tuple[Tensor, int]


class KroneckerFactor:
    """Statistics, running average and validity of one factor.

    Args:
        side: ``"a"`` or ``"g"``.
        dim: the factor's side length ``d`` (a :class:`~dkfac.curvature.factor_side.DiagonalSide`
            for a factor held as its diagonal, a ``d``-vector).
        dtype: the layer's factor dtype (of its zero factor; statistics are computed in it).

    Attributes:
        side: ``"a"`` or ``"g"``.
        dim: the factor's side length.
        dtype: the layer's factor dtype.
        statistics: the current capture window's statistics.
        running: the running average (``None`` before the first update; NaN when no finite
            estimate exists yet).
    """

    def __init__(self, side: str, dim: int, dtype: torch.dtype) -> None:
        self.side = side
        self.dim = dim
        self.dtype = dtype
        self.statistics = FactorStatistics(side)
        self.running: Tensor | None = None
        # Flags "a batch was dropped", read only at a decomposition: a count per fold would
        # take a launch per factor on every factor step, and a factor's own flag from a fold
        # of many a view each (it keeps the fold's shared tensor and its entry instead).
        self._nonfinite: list[DroppedFlag] = []

    def fold(self, batch: Tensor, decay: float) -> None:
        """Fold a batch factor into the running average (a non-finite one is counted, not used)."""
        batch_ok = all_finite(batch)
        self.count_nonfinite((~batch_ok).to(torch.int64), 0)
        self.running = running_average(self.running, batch, decay, batch_ok)

    def count_nonfinite(self, bad: Tensor, entry: int) -> None:
        """Keep the flag ``bad.reshape(-1)[entry]`` (1: this fold dropped its batch)."""
        self._nonfinite.append((bad, entry))
        if len(self._nonfinite) >= _PENDING_FLAGS:  # bounded between decompositions
            self._nonfinite = [(self._summed_flags(), 0)]

    def _summed_flags(self) -> Tensor:
        return torch.stack([bad.reshape(-1)[entry] for bad, entry in self._nonfinite]).sum()

    def take_nonfinite_flags(self) -> list[DroppedFlag]:
        """The dropped-batch flags kept since the last call: their sum is the count.

        The caller reads each flags tensor once for all the factors it reads (a decomposition:
        one synchronisation for every factor's, no launch or view per factor).
        """
        flags, self._nonfinite = self._nonfinite, []
        return flags

    def take_nonfinite_count(self) -> Tensor | None:
        """Device count of non-finite batches dropped since the last call (``None``: none seen)."""
        if not self._nonfinite:
            return None
        count = self._summed_flags()
        self._nonfinite = []
        return count

    def zeros(self, device: torch.device) -> Tensor:
        """A zero factor (what a worker without statistics contributes to a sum)."""
        return torch.zeros(factor_shape(self.dim), dtype=self.dtype, device=device)

    def value(self) -> Tensor:
        """The running average, which must exist."""
        if self.running is None:
            raise RuntimeError(f"factor {self.side.upper()} has no running average yet")
        return self.running

    def finite(self) -> Tensor:
        """Device boolean: the running average is finite (usable for a decomposition)."""
        return all_finite(self.value())

    def trace_mean(self, dtype: torch.dtype) -> Tensor:
        """``tr(F)/d`` of the running average in ``dtype`` (an input of the Tikhonov ``π``)."""
        return trace_mean(self.value(), dtype)


def _one_launch_each(runnings: Sequence[Tensor | None], batches: Sequence[Tensor]) -> bool:
    """Whether the factors can share launches (else they fold one at a time).

    Every average must exist, all on one device, each pair in one dtype (a state loaded with
    another ``factor_dtype`` folds promoted, as one at a time).
    """
    if any(running is None for running in runnings):
        return False
    pairs = zip(runnings, batches, strict=True)
    same = all(r is not None and r.dtype == b.dtype for r, b in pairs)
    return same and len({t.device for t in [*batches, *runnings] if t is not None}) == 1


def window_sums(
    factors: Sequence[KroneckerFactor], loss_reduction: str
) -> tuple[list[KroneckerFactor], list[Tensor], list[int]]:
    """The factors with statistics in this window, their sums and counts.

    Each batch factor is ``sum / count`` (:meth:`~.statistics.FactorStatistics.summed`). The
    scaling of ``G``'s sums (``N²``, mean loss) is one shared operation for all factors.
    """
    windows = [factor for factor in factors if factor.statistics.has_statistics]
    raws = [factor.statistics.raw_total() for factor in windows]
    scales = [factor.statistics.total_scale(loss_reduction) for factor in windows]
    scaled = [index for index, scale in enumerate(scales) if scale != 1]
    if scaled:
        products = torch._foreach_mul([raws[i] for i in scaled], [scales[i] for i in scaled])
        for index, product in zip(scaled, products, strict=True):
            raws[index] = product
    return windows, raws, [factor.statistics.count for factor in windows]


def fold_sums(
    factors: Sequence[KroneckerFactor],
    totals: Sequence[Tensor],
    counts: Tensor,
    decay: float,
    host_counts: Sequence[float] | None = None,
    stack_bytes: int = 0,
) -> None:
    """Fold each factor's batch ``totals[i] / counts[i]`` where ``counts[i] > 0``.

    Once every factor has an estimate this runs on the device with no host read (the steps
    that update factors but decompose nothing then never wait for the GPU), in shared
    launches (:func:`~dkfac.curvature.running_average.running_averages`, equal-shaped factors
    stacked up to ``stack_bytes``): a factor whose count is 0 keeps its average, as if nothing
    were folded, and the others fold exactly as ``fold(divided(total, count))`` would, bit
    for bit (:func:`~dkfac.curvature.running_average.divided`). The first estimates go one at
    a time and read the counts once, unless ``host_counts`` gives them.

    Args:
        factors: the factors.
        totals: their sums.
        counts: their float64 counts on the sums' device.
        decay: ``ε``.
        host_counts: the same counts on the host, when the caller has them.
        stack_bytes: see :func:`~dkfac.curvature.running_average.running_averages`.
    """
    if not factors:
        return
    runnings = [factor.running for factor in factors]
    if not _one_launch_each(runnings, totals):
        known = counts.tolist() if host_counts is None else host_counts
        for index, (factor, total) in enumerate(zip(factors, totals, strict=True)):
            if known[index] > 0:
                factor.fold(divided(total, counts[index]), decay)
        return
    present = counts > 0
    held = [running for running in runnings if running is not None]
    folded, batch_ok = running_averages(
        held, totals, decay, present, counts.clamp_min(1.0), stack_bytes
    )
    bad = (present & ~batch_ok).to(torch.int64)
    for index, (factor, running) in enumerate(zip(factors, folded, strict=True)):
        factor.count_nonfinite(bad, index)
        factor.running = running


def fold_counted(
    factors: Sequence[KroneckerFactor],
    totals: Sequence[Tensor],
    counts: Sequence[float],
    decay: float,
    stack_bytes: int = 0,
    idle: Sequence[KroneckerFactor] = (),
) -> None:
    """:func:`fold_sums` with the counts on the host (copied to the device, never read back).

    ``idle``: the other factors this worker holds (no batch this window). When stacking, those
    with an average are folded along with count 0 (each keeps its value): every row of a
    stack is then replaced at each fold and the old stack freed, where a factor left out
    would keep its whole old stack alive.
    """
    if stack_bytes > 0:
        kept = [factor for factor in idle if factor.running is not None]
        factors = [*factors, *kept]
        totals = [*totals, *(factor.value() for factor in kept)]
        counts = [*counts, *([0.0] * len(kept))]
        # In the stacks' order, arranged here on the host: no gathers on the device.
        order = fold_order(totals, stack_bytes)
        factors = [factors[index] for index in order]
        totals = [totals[index] for index in order]
        counts = [counts[index] for index in order]
    if factors:
        device_counts = host_floats(counts, totals[0].device)
        fold_sums(factors, totals, device_counts, decay, counts, stack_bytes)
