"""The steps that update factors and decompositions: fixed, or chosen from the run's own times.

How often to update the factors and decompose them trades each update's cost against stale
curvature, and the costs differ by orders of magnitude between models. On this project's
CPU at full batch, one decomposition of the digits CNN's factors takes about 6 ms of a 75 ms
step, of the deep autoencoder's about 110 ms of a 200 ms step; a factor update (statistics
and running averages) about 40 ms of the autoencoder's 160 ms step (docs/benchmarks.md, "The
update intervals from the step's time"). No fixed pair suits both models.

``inv_update_steps="auto"`` (and ``factor_update_steps="auto"``, which needs it), or an
:class:`IntervalBudget` each, measure the costs on the run and choose the intervals once:

1. Until the choice, decompositions run at every factor update (fast early, while the
   factors change most); an ``"auto"`` factor interval is 2 meanwhile, so that steps with
   and without a factor update can be compared.
2. Every step after the first is timed between the ends of consecutive ``step()`` calls
   (wall clock; on an accelerator the device is synchronised at each step's end and around
   its decompositions, only while measuring), and so are the decompositions. The first
   decomposition is not used: it pays one-off costs (allocations, solver handles).
3. After ``measured_decompositions`` more (and a step with and one without a factor update,
   for an ``"auto"`` factor interval), with ``s`` the fastest step that updated no factor
   and made no decomposition (any step, without its decomposition, if every step updates
   factors), ``d`` the fastest decomposition and ``f`` the fastest factor step's time
   (without its decomposition) minus ``s``, each budget's interval is ``⌈cost / (share·s)⌉``
   within ``[1, most]``: ``d`` for decompositions, ``f`` for factors. The fastest, so that an
   evaluation or a checkpoint between two steps, or a first step still allocating, does not
   count as training.
4. The workers agree on the largest of each (one maximum-allreduce), so all update at the
   same steps; the decomposition interval is then rounded up to a multiple of the factor
   interval (down where up would pass ``most``; at each step, for a callable factor
   interval).

Steps that a GradScaler skipped (they fold no factor) and steps while SPD or PAD still
profile the cluster are not measured, so the choice waits for steps that are. Strategies
that decide at construction from the intervals (PAD's ``share="auto"``,
``strategy=dkfac.AutoOptions(...)``) see ``(1, 1)`` there: give PAD its ``share`` when the
intervals are ``"auto"``.

The choice is a measurement: two runs of one seed may choose differently. It is saved in
``state_dict`` (a resumed run keeps it), logged, and read from ``pre.chosen_intervals``;
give numbers where runs must repeat bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dkfac.validation import check_float, check_int

logger = logging.getLogger(__name__)

#: The interval value that stands for :class:`IntervalBudget` with its defaults.
AUTO = "auto"
#: An ``"auto"`` factor interval while it is measured: steps with and without an update.
MEASURING_FACTOR_STEPS = 2


@dataclass(frozen=True)
class IntervalBudget:
    """An interval chosen so its updates take about ``share`` of a step (see the module).

    Attributes:
        share: the updates' share of a step's time, amortised over the interval, in
            ``(0, 1]``.
        measured_decompositions: decompositions timed (after the first) before choosing.
        most: the longest interval chosen (a bound on staleness), ``>= 1``.
    """

    share: float = 0.1
    measured_decompositions: int = 2
    most: int = 100

    def __post_init__(self) -> None:
        check_float(
            "IntervalBudget.share",
            self.share,
            low=0.0,
            high=1.0,
            low_open=True,
            allowed="a number in (0, 1]",
        )
        check_int("IntervalBudget.measured_decompositions", self.measured_decompositions)
        check_int("IntervalBudget.most", self.most)

    def interval(self, cost_s: float, step_s: float) -> int:
        """``⌈cost_s / (share·step_s)⌉`` within ``[1, most]``."""
        if step_s <= 0:
            return self.most if cost_s > 0 else 1
        return max(1, min(self.most, math.ceil(cost_s / (self.share * step_s))))


def multiple_of(inverse: int, factor: int, most: int) -> int:
    """``inverse`` rounded up to a multiple of ``factor``.

    Rounded down instead where up would pass ``most`` (but not below ``factor``).
    """
    rounded = math.ceil(inverse / factor) * factor
    return rounded if rounded <= most else max(factor, most // factor * factor)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


@dataclass
class StepTimes:
    """What the budgets are chosen from, in seconds (one worker's measurements).

    Attributes:
        decompositions: each timed decomposition (the first excluded).
        factor_steps: steps that updated factors, each without its decomposition.
        plain_steps: steps that updated no factor (none made a decomposition).
    """

    decompositions: list[float] = field(default_factory=list)
    factor_steps: list[float] = field(default_factory=list)
    plain_steps: list[float] = field(default_factory=list)

    def step_s(self) -> float:
        """The fastest step without factor update or decomposition, else the fastest step."""
        return min(self.plain_steps or self.factor_steps)

    def factor_update_s(self) -> float:
        """The fastest factor step's extra time over the fastest plain step (``>= 0``)."""
        return max(0.0, min(self.factor_steps) - min(self.plain_steps))


@dataclass(frozen=True)
class IntervalSettings:
    """The two intervals as configured: a schedule of the step, or a budget.

    Attributes:
        factor_steps: ``factor_update_steps`` at a step (its schedule; 1 for a budget).
        inv_steps: ``inv_update_steps`` at a step (its schedule; unused with a budget).
        factor_budget: the factor interval's budget, if ``"auto"``.
        inv_budget: the decomposition interval's budget, if ``"auto"``.
        fixed_factor_steps: the factor interval if it is a constant, else ``None``.
        check: ``check(factor_steps, inv_steps, step)`` refuses a decomposition interval that
            is not a multiple of the factor interval.
    """

    factor_steps: Callable[[int], int]
    inv_steps: Callable[[int], int]
    factor_budget: IntervalBudget | None
    inv_budget: IntervalBudget | None
    fixed_factor_steps: int | None
    check: Callable[[int, int, int], None]


@dataclass
class UpdateIntervals:
    """Which K-FAC steps update factors and decompositions; measures and chooses for budgets.

    Attributes:
        settings: the configured intervals.
        device: where the preconditioner's work runs (synchronised while measuring).
        clock: seconds, monotonic (``time.perf_counter``; tests give their own).
        chosen: ``(factor, decomposition)`` intervals the budgets chose, agreed by every
            worker (a fixed factor interval: ``None`` in its place); ``None`` until then.
        times: the measurements so far.
    """

    settings: IntervalSettings
    device: torch.device
    clock: Callable[[], float] = time.perf_counter
    chosen: tuple[int | None, int] | None = None
    times: StepTimes = field(default_factory=StepTimes)
    _decompositions: int = 0
    _decomposition_s: float = 0.0
    _last_end: float | None = None
    _measured_decomposition: bool = False

    @property
    def measuring(self) -> bool:
        """Whether a budget is still measuring."""
        return self.settings.inv_budget is not None and self.chosen is None

    def factor_steps(self, step: int) -> int:
        """Steps between factor updates at K-FAC step ``step``."""
        if self.settings.factor_budget is None:
            return self.settings.factor_steps(step)
        if self.chosen is None:
            return MEASURING_FACTOR_STEPS
        factor = self.chosen[0]
        assert factor is not None
        return factor

    def intervals_at(self, step: int) -> tuple[int, int]:
        """``(factor, decomposition)`` intervals at ``step``, checked together.

        Raises:
            ValueError: a callable interval returned a value that is not allowed.
        """
        factor = self.factor_steps(step)
        if self.settings.inv_budget is None:
            inverse = self.settings.inv_steps(step)
            self.settings.check(factor, inverse, step)
        elif self.chosen is None:
            inverse = factor  # decompose at every factor update until the choice
        else:
            assert self.settings.inv_budget is not None
            inverse = multiple_of(self.chosen[1], factor, self.settings.inv_budget.most)
        return factor, inverse

    def updates_at(self, step: int) -> tuple[bool, bool]:
        """Whether K-FAC step ``step`` updates factors, and decompositions.

        Raises:
            ValueError: as :meth:`intervals_at`.
        """
        factor, inverse = self.intervals_at(step)
        return step % factor == 0, step % inverse == 0

    def is_factor_step(self, step: int) -> bool:
        """Whether K-FAC step ``step`` updates factors (its forward captures statistics)."""
        return step % self.factor_steps(step) == 0

    @contextlib.contextmanager
    def timed_decomposition(self) -> Iterator[None]:
        """Time the decompositions run inside (only while measuring)."""
        if not self.measuring:
            yield
            return
        _synchronize(self.device)
        start = self.clock()
        yield
        _synchronize(self.device)
        self._decomposition_s = self.clock() - start
        self._measured_decomposition = self._decompositions > 0  # the first: one-off costs
        self._decompositions += 1

    def step_finished(
        self,
        factor_step: bool,
        agree: Callable[[Sequence[int], torch.device], list[int]],
        *,
        record: bool = True,
    ) -> bool:
        """Record the step that just finished; choose once enough is measured.

        Args:
            factor_step: whether it updated factors.
            agree: ``agree(values, device)``: the element-wise largest over every worker (a
                collective: it is called at the same step on every worker, as the steps and
                decompositions it counts are the same on every worker).
            record: whether the step counts (``False``: a step the GradScaler skipped, which
                folded no factor, or one while SPD/PAD still profile; the same on every
                worker).

        Returns:
            Whether the intervals were chosen now (later steps may update at other steps).
        """
        if not self.measuring:
            return False
        _synchronize(self.device)
        end = self.clock()
        if record and self._last_end is not None:
            elapsed = max(0.0, end - self._last_end - self._decomposition_s)
            (self.times.factor_steps if factor_step else self.times.plain_steps).append(elapsed)
        if record and self._measured_decomposition:
            self.times.decompositions.append(self._decomposition_s)
        self._last_end, self._decomposition_s = end, 0.0
        self._measured_decomposition = False
        if not self._measured_enough():
            return False
        self.chosen = self._choose(agree)
        return True

    def _measured_enough(self) -> bool:
        inv_budget = self.settings.inv_budget
        assert inv_budget is not None
        if len(self.times.decompositions) < inv_budget.measured_decompositions:
            return False
        if self.settings.factor_budget is None:
            return bool(self.times.factor_steps or self.times.plain_steps)
        return bool(self.times.factor_steps and self.times.plain_steps)

    def _choose(
        self, agree: Callable[[Sequence[int], torch.device], list[int]]
    ) -> tuple[int | None, int]:
        inv_budget, factor_budget = self.settings.inv_budget, self.settings.factor_budget
        assert inv_budget is not None
        step_s, decomposition_s = self.times.step_s(), min(self.times.decompositions)
        own = [inv_budget.interval(decomposition_s, step_s)]
        factor_s = 0.0
        if factor_budget is not None:
            factor_s = self.times.factor_update_s()
            own.append(factor_budget.interval(factor_s, step_s))
        agreed = agree(own, self.device)
        factor = agreed[1] if factor_budget is not None else None
        # The interval that runs: a multiple of a known factor interval (a callable one is
        # rounded at each step).
        known = factor if factor is not None else self.settings.fixed_factor_steps
        inverse = agreed[0] if known is None else multiple_of(agreed[0], known, inv_budget.most)
        logger.info(
            "K-FAC intervals chosen: decompositions every %d steps%s (this worker: a step "
            "%.1f ms, a decomposition %.1f ms%s, its own choice %s; the largest of all workers, "
            "the decompositions' rounded to a multiple of the factor interval)",
            inverse,
            "" if factor is None else f", factor updates every {factor}",
            step_s * 1e3,
            decomposition_s * 1e3,
            "" if factor is None else f", a factor update {factor_s * 1e3:.1f} ms",
            own,
        )
        return factor, inverse

    def state(self) -> dict[str, Any]:
        """What ``state_dict`` keeps: the choice (measurements restart after a load)."""
        return {"chosen": None if self.chosen is None else list(self.chosen)}

    def load(self, state: object) -> None:
        """Restore :meth:`state`; a missing or unchosen state measures again from scratch.

        Raises:
            ValueError: the saved choice does not fit these settings.
        """
        chosen = state.get("chosen") if isinstance(state, dict) else None
        self.chosen = None if chosen is None else self._checked(chosen)
        self.times, self._decompositions = StepTimes(), 0
        self._decomposition_s, self._last_end = 0.0, None
        self._measured_decomposition = False

    def check_state(self, state: object) -> None:
        """Refuse a state :meth:`load` would refuse, before anything is restored.

        Raises:
            ValueError: as :meth:`load`.
        """
        chosen = state.get("chosen") if isinstance(state, dict) else None
        if chosen is not None:
            self._checked(chosen)

    def _checked(self, chosen: object) -> tuple[int | None, int]:
        if not isinstance(chosen, (list, tuple)) or len(chosen) != 2:
            raise ValueError(
                f"saved intervals={chosen!r} are not allowed: expected [factor, decomposition]"
            )
        factor, inverse = chosen
        if (factor is None) != (self.settings.factor_budget is None):
            kind = "'auto'" if self.settings.factor_budget is not None else "fixed"
            raise ValueError(
                f"saved factor interval={factor!r} is not allowed: this preconditioner's "
                f"factor_update_steps is {kind}"
            )
        factor = None if factor is None else check_int("saved factor interval", factor)
        return factor, check_int("saved decomposition interval", inverse)
