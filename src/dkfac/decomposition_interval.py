"""``inv_update_steps="auto"``: decompose as often as a share of the step's time allows.

How often to decompose trades two costs that differ by orders of magnitude between models: a
decomposition (``Σ d³`` over the factors, paid by the busiest worker) and a training step. On
this project's CPU at full batch, one decomposition of the digits CNN's factors takes about
6 ms of a 75 ms step; of the deep autoencoder's, about 110 ms of a 200 ms step
(docs/benchmarks.md, "The decomposition interval from the step's time"). No fixed interval
suits both: every step costs the first little and adds half a step to the second's; every
tenth step makes the first's directions stale for almost nothing.

:class:`DecompositionBudget` measures both costs on the run and chooses the interval:

1. Until the choice, decompositions run at every factor update (fast early, while the
   factors change most).
2. Every step after the first is timed between the ends of consecutive ``step()`` calls
   (wall clock; on an accelerator the device is synchronised at each step's end and around
   its decomposition, only while measuring), and so is each decomposition. The first
   decomposition is not used: it pays one-off costs (allocations, solver handles).
3. After ``measured_decompositions`` more, a worker's interval is ``⌈d / (share·s)⌉`` within
   ``[1, most]``: ``d`` its fastest decomposition, ``s`` its fastest step without the step's
   decomposition (the fastest, so that an evaluation or a checkpoint between two steps, or a
   first step still allocating, does not count as training). The workers agree on the
   largest (one maximum-allreduce), so all decompose at the same steps.
4. From then on decompositions run every that many steps, rounded up to a multiple of the
   factor interval at each step.

The choice is a measurement: two runs of one seed may choose differently. It is saved in
``state_dict`` (a resumed run keeps it), logged, and read from ``pre.decomposition_interval``;
give an int where runs must repeat bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dkfac.validation import check_float, check_int

logger = logging.getLogger(__name__)

#: ``inv_update_steps`` that stands for :class:`DecompositionBudget` with its defaults.
AUTO = "auto"


@dataclass(frozen=True)
class DecompositionBudget:
    """Decompositions chosen to take about ``share`` of the training time (see the module).

    Attributes:
        share: the decompositions' share of a step's time, amortised over the interval, in
            ``(0, 1]``.
        measured_decompositions: decompositions timed (after the first) before choosing.
        most: the longest interval chosen (staleness bound), ``>= 1``.
    """

    share: float = 0.1
    measured_decompositions: int = 2
    most: int = 100

    def __post_init__(self) -> None:
        check_float(
            "DecompositionBudget.share",
            self.share,
            low=0.0,
            high=1.0,
            low_open=True,
            allowed="a number in (0, 1]",
        )
        check_int("DecompositionBudget.measured_decompositions", self.measured_decompositions)
        check_int("DecompositionBudget.most", self.most)

    def interval(self, decomposition_s: float, step_s: float) -> int:
        """``⌈decomposition_s / (share·step_s)⌉`` within ``[1, most]``."""
        if step_s <= 0:
            return self.most if decomposition_s > 0 else 1
        return max(1, min(self.most, math.ceil(decomposition_s / (self.share * step_s))))


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


@dataclass
class DecompositionInterval:
    """The interval a :class:`DecompositionBudget` chooses on one worker, and its measurements.

    Attributes:
        budget: the rule.
        device: where the preconditioner's work runs (synchronised while measuring).
        clock: seconds, monotonic (``time.perf_counter``; tests give their own).
        chosen: the agreed interval, ``None`` until chosen.
        decomposition_s: the decompositions timed so far (the first excluded).
        step_s: the step times so far, each without its decomposition.
    """

    budget: DecompositionBudget
    device: torch.device
    clock: Callable[[], float] = time.perf_counter
    chosen: int | None = None
    decomposition_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    _decompositions: int = 0
    _this_step_s: float = 0.0
    _last_end: float | None = None

    @property
    def measuring(self) -> bool:
        """Whether the interval is still being measured."""
        return self.chosen is None

    def inv_steps(self, factor_steps: int) -> int:
        """Steps between decompositions now, given the factor interval ``factor_steps``.

        The choice rounded up to a multiple of ``factor_steps``; ``factor_steps`` before it.
        """
        if self.chosen is None:
            return factor_steps
        return math.ceil(self.chosen / factor_steps) * factor_steps

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
        elapsed = self.clock() - start
        if self._decompositions > 0:  # the first pays one-off costs
            self.decomposition_s.append(elapsed)
        self._decompositions += 1
        self._this_step_s = elapsed

    def step_finished(self, agree: Callable[[int, torch.device], int]) -> None:
        """Record the step that just finished; choose once enough is measured.

        Args:
            agree: ``agree(value, device)``, the largest of every worker's value (a collective:
                called at the same step on every worker, as the decompositions it counts are
                the same on every worker).
        """
        if not self.measuring:
            return
        _synchronize(self.device)
        end = self.clock()
        if self._last_end is not None:
            self.step_s.append(max(0.0, end - self._last_end - self._this_step_s))
        self._last_end, self._this_step_s = end, 0.0
        if len(self.decomposition_s) < self.budget.measured_decompositions:
            return
        decomposition_s, step_s = min(self.decomposition_s), min(self.step_s)
        own = self.budget.interval(decomposition_s, step_s)
        self.chosen = agree(own, self.device)
        logger.info(
            "decompositions every %d steps (this worker: a decomposition %.1f ms, a step %.1f "
            "ms without it, share %.2f -> %d; the largest of all workers)",
            self.chosen,
            decomposition_s * 1e3,
            step_s * 1e3,
            self.budget.share,
            own,
        )

    def state(self) -> dict[str, Any]:
        """What ``state_dict`` keeps: the choice (measurements restart after a load)."""
        return {"chosen": self.chosen}

    def load(self, state: object) -> None:
        """Restore :meth:`state`; a missing or unchosen state measures again from scratch.

        Raises:
            ValueError: ``chosen`` is neither ``None`` nor an integer >= 1.
        """
        chosen = state.get("chosen") if isinstance(state, dict) else None
        if chosen is not None:
            check_int("saved decomposition interval", chosen)
        self.chosen = chosen
        self.decomposition_s, self.step_s = [], []
        self._decompositions, self._this_step_s, self._last_end = 0, 0.0, None


def timed_decomposition(
    interval: DecompositionInterval | None,
) -> contextlib.AbstractContextManager[None]:
    """:meth:`DecompositionInterval.timed_decomposition`, or nothing without a budget."""
    return contextlib.nullcontext() if interval is None else interval.timed_decomposition()
