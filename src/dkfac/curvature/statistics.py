"""One Kronecker factor's statistics over a capture window, and handing them over early.

A capture window is everything between two factor updates: ``accumulation_steps`` forward and
backward passes, in each of which a layer may run any number of times (a shared layer, a loop,
tied branches). :class:`FactorStatistics` keeps the raw sums of one factor over the window and
its count (docs/math.md, "Layers used several times"):

* ``A``: ``Σ a aᵀ`` over every row of every call, counted in rows (``A = Σ a aᵀ / R``).
* ``G``: ``Σ dy dyᵀ`` over every row of every backward call, counted in **examples**, and an
  example is counted once per forward pass of the model, however many times the layer ran in
  it (the largest batch among the layer's calls in that pass). This is K-FAC's "expand"
  treatment of weight sharing: with ``R`` uses per example, ``A`` averages the ``N·R`` rows
  and ``G = (1/N) Σ_{n,r} g gᵀ`` with ``g = N·dy`` the per-example gradient of a mean loss.

The sums that add up across workers (:class:`SummedFactor`) are ``(Σ a aᵀ, R)`` for ``A`` and
``(N²·Σ dy dyᵀ, N)`` (mean loss) or ``(Σ dy dyᵀ, N)`` (sum loss) for ``G``.

With ``statistics_fraction`` ``f < 1`` a call's statistics come from its first ``k = ⌈f·N⌉``
examples only (:func:`kept_examples`); their sums are weighted by ``N/k`` and counted as the
whole call (:func:`whole_call_estimate`), so each call's sum estimates the whole call's and the
bookkeeping below is the whole batch's.

Pipelined strategies send a factor from the hook that completes it, before ``step()``. When
a statistic arrives after that (the layer ran once more than the window had shown so far),
:meth:`FactorStatistics.late` gives exactly what must be added to the sum already sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from dkfac.curvature.blocks import FactorStatistic


def kept_examples(examples: int, fraction: float) -> int:
    """How many of a call's ``examples`` (its first, along dim 0) feed the statistics.

    ``⌈fraction · examples⌉``, at least one; all of them at ``fraction`` 1.
    """
    if fraction >= 1.0:
        return examples
    # Rounded before the ceiling: 0.1 * 30 is 3.0000000000000004 in floating point.
    return max(1, math.ceil(round(fraction * examples, 9)))


def whole_call_estimate(
    statistic: FactorStatistic, examples: int, kept: int
) -> tuple[FactorStatistic, float]:
    """A statistic of a call's first ``kept`` examples as the estimate of all ``examples``.

    Returns the statistic with the whole call's counts (its rows times ``examples / kept``,
    ``examples``) and the weight of its sum, ``examples / kept``: each call's sum then
    estimates the whole call's without bias, whatever share of it was kept, and every count
    (a window's examples, a pass's, a worker's) is what the whole batch gives.

    Raises:
        RuntimeError: the kept part's rows are not a whole number of rows per example.
    """
    if kept == examples:
        return statistic, 1.0
    rows, remainder = divmod(statistic.rows * examples, kept)
    if remainder or statistic.examples != kept:
        raise RuntimeError(
            f"statistics_fraction: {statistic.rows} rows of {statistic.examples} examples "
            f"from the first {kept} of {examples}: a layer needs the same rows per example"
        )
    return statistic._replace(rows=rows, examples=examples), examples / kept


@dataclass(frozen=True)
class SummedFactor:
    """A factor's statistics as they add up over workers: ``total / count`` is the factor.

    Attributes:
        total: ``Σ a aᵀ`` (``A``), ``N²·Σ dy dyᵀ`` (``G``, mean loss) or ``Σ dy dyᵀ`` (sum).
        count: rows (``A``) or examples (``G``).
    """

    total: Tensor
    count: int


@dataclass(frozen=True)
class _Sent:
    """What a hand-over sent: the raw sum then (kept for ``G`` of a mean loss) and counts."""

    raw: Tensor | None
    rows: int
    examples: int
    scaled_by: int  # the examples whose square scaled it (G of a mean loss)


class FactorStatistics:
    """Raw sums of one factor (``side`` ``"a"`` or ``"g"``) over the current window.

    Attributes:
        side: ``"a"`` (counted in rows) or ``"g"`` (counted in examples).
        updates: statistics added in the window (one per call of the layer's forward for
            ``A``, per backward call for ``G``).
        lost: statistics of the window left out (:meth:`lose`), one per call.

    ``G``'s scale under a mean loss counts every example its gradients are divided by: those
    of passes with a statistic, a lost one (:meth:`lose`) or none (:meth:`sat_out`).
    """

    def __init__(self, side: str) -> None:
        if side not in ("a", "g"):
            raise ValueError(f"side={side!r} is not allowed: expected 'a' or 'g'")
        self.side = side
        self.updates = self.lost = 0
        self._total: Tensor | None = None  # since the hand-over (the whole window before it)
        self._rows = 0  # rows in _total
        self._examples: dict[int, int] = {}  # per forward pass of the window: its examples
        # Per pass counted in G's scale only: a lost statistic's (pending_statistics) or one
        # the layer sat out (:meth:`sat_out`): its examples, not in the count.
        self._scale_only: dict[int, int] = {}
        self._sent: _Sent | None = None

    # -- adding --------------------------------------------------------------------------
    def add(self, statistic: FactorStatistic, pass_id: int, scale: Tensor | float = 1.0) -> None:
        """Add one call's statistic, made in forward pass ``pass_id``, times ``scale``."""
        total = statistic.total
        if not (isinstance(scale, float) and scale == 1.0):
            total = total * scale
        # In place only into a tensor this object made: the first statistic is the block's own.
        self._total = total if self._total is None else self._total.add_(total)
        self._rows += statistic.rows
        self._examples[pass_id] = max(self._examples.get(pass_id, 0), statistic.examples)
        self.updates += 1

    def lose(self, pass_id: int, examples: int) -> None:
        """A statistic of forward pass ``pass_id`` over ``examples`` was left out.

        ``G`` of a mean loss is ``(1/N) Σ g gᵀ`` of its own examples with ``g = W·dy``, ``W``
        the examples of the passes the loss was the mean over: those are still counted in
        its scale, not in ``N`` (with ``accumulation_steps = k``, a pass's loss divided by ``k``).
        """
        self.sat_out(pass_id, examples)
        self.lost += 1

    def sat_out(self, pass_id: int, examples: int) -> None:
        """The window's forward pass ``pass_id`` over ``examples`` gave this factor nothing.

        A layer that sits out some of the micro-batches of an accumulated window (a branch
        taken in some, a task's head) still has its gradients divided by every micro-batch's
        examples: ``G`` of a mean loss counts them in its scale, as :meth:`lose` does, so it
        is the average of per-example ``g gᵀ`` over the examples the layer saw (as when a
        worker of several has no gradient for it) and not that times ``(seen/all)²``.
        """
        self._scale_only[pass_id] = max(self._scale_only.get(pass_id, 0), examples)

    def scaled_passes(self) -> Mapping[int, int]:
        """Examples per forward pass counted in ``G``'s scale (added, lost or sat out)."""
        if not self._scale_only:
            return self._examples  # read only: no copy per layer at every factor step
        passes = self._examples.keys() | self._scale_only.keys()
        return {p: max(self._examples.get(p, 0), self._scale_only.get(p, 0)) for p in passes}

    @property
    def has_statistics(self) -> bool:
        """Whether anything was added in this window."""
        return self.updates > 0

    @property
    def rows(self) -> int:
        """Rows of the window."""
        return self._rows + (self._sent.rows if self._sent is not None else 0)

    @property
    def examples(self) -> int:
        """Examples of the window: once per forward pass (the largest batch of its calls)."""
        return sum(self._examples.values())

    @property
    def passes(self) -> int:
        """Forward passes of the window in which this factor got a statistic."""
        return len(self._examples)

    @property
    def count(self) -> int:
        """What the factor is normalised by: rows (``A``) or examples (``G``)."""
        return self.rows if self.side == "a" else self.examples

    # -- the window's sums ---------------------------------------------------------------
    def raw_total(self) -> Tensor:
        """``Σ a aᵀ`` or ``Σ dy dyᵀ`` of the whole window (nothing handed over)."""
        if self._sent is not None or self._total is None:
            raise RuntimeError(f"factor {self.side.upper()}: no complete window to read")
        return self._total

    def summed(self, loss_reduction: str) -> SummedFactor:
        """The window's :class:`SummedFactor` (nothing handed over)."""
        return self._summed(self.raw_total(), self.examples, self._rows, loss_reduction)

    def total_scale(self, loss_reduction: str) -> int:
        """What :meth:`summed` multiplies the raw sum by: ``N²`` (``G``, mean loss), else 1.

        ``N`` counts the examples of passes whose statistic was lost (:meth:`lose`) or that
        the layer sat out (:meth:`sat_out`) too.
        """
        return self._scale(loss_reduction)

    def _scaled_by(self) -> int:
        """The examples of every pass with a statistic, a lost one or none (once per pass)."""
        if not self._scale_only:  # every factor step's case: no set built
            return self.examples
        return sum(self.scaled_passes().values())

    def _scale(self, loss_reduction: str) -> int:
        if self.side == "g" and loss_reduction == "mean":
            return self._scaled_by() ** 2
        return 1

    def _summed(self, raw: Tensor, examples: int, rows: int, loss_reduction: str) -> SummedFactor:
        scale = self._scale(loss_reduction)
        total = raw if scale == 1 else raw * scale
        return SummedFactor(total, rows if self.side == "a" else examples)

    # -- handing over early --------------------------------------------------------------
    @property
    def handed_over(self) -> bool:
        """Whether :meth:`hand_over` ran in this window."""
        return self._sent is not None

    def hand_over(self, loss_reduction: str) -> SummedFactor:
        """The window's sums so far, for a collective; later statistics are kept apart.

        The returned tensor belongs to the caller (a collective may write its result into
        it). Statistics added afterwards go into a new sum that :meth:`late` turns into the
        exact correction.
        """
        raw = self.raw_total()
        examples, rows = self.examples, self._rows
        summed = self._summed(raw, examples, rows, loss_reduction)
        # G of a mean loss: the raw sum is still needed if more examples arrive (N changes
        # the scale of everything already sent); the sent tensor is a scaled copy, or, scaled
        # by 1 (one example), the raw sum itself, which the collective overwrites.
        keep = None
        if self.side == "g" and loss_reduction == "mean":
            keep = raw if summed.total is not raw else raw.clone()
        self._sent = _Sent(keep, rows, examples, self._scaled_by())
        self._total, self._rows = None, 0
        return summed

    def late(self, loss_reduction: str) -> SummedFactor | None:
        """What to add to the handed-over sums to get the window's, or ``None`` if nothing.

        ``A`` and ``G`` of a sum loss add up: the late sums themselves. ``G`` of a mean loss
        is ``N²·Σ``: with ``N₀`` examples and sum ``S₀`` sent, and ``S₁`` late, the window's
        value is ``N²(S₀ + S₁)``, so the correction is ``(N² − N₀²)·S₀ + N²·S₁`` (``N``
        counting the examples of lost statistics and passes sat out too).
        """
        sent = self._sent
        if sent is None:
            return None
        examples, scaled_by = self.examples, self._scaled_by()
        if self._total is None and (examples, scaled_by) == (sent.examples, sent.scaled_by):
            return None
        if self.side == "a":
            if self._total is None:  # only a lost statistic: A's sums are not scaled
                return None
            return SummedFactor(self._total, self._rows)
        added = examples - sent.examples
        if loss_reduction != "mean":
            if self._total is None:
                return None
            return SummedFactor(self._total, added)
        assert sent.raw is not None
        square = scaled_by * scaled_by
        correction = sent.raw * (square - sent.scaled_by * sent.scaled_by)
        if self._total is not None:
            correction = correction + self._total * square
        return SummedFactor(correction, added)

    def clear(self) -> None:
        """Forget the window."""
        self.updates, self.lost, self._total, self._rows, self._sent = 0, 0, None, 0, None
        self._examples, self._scale_only = {}, {}
