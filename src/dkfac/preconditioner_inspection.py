"""What a :class:`~dkfac.KFACPreconditioner` shows of itself: factors, health, timings, plan."""

from __future__ import annotations

import copy
import os

import torch.distributed as dist
from torch import Tensor, nn

from dkfac.adaptive import AdaptiveReport, AdaptiveStep
from dkfac.capture import StatisticsCapture
from dkfac.comm import StepRecorder
from dkfac.config import KFACConfig
from dkfac.curvature.layer import LayerCurvature
from dkfac.health import Health
from dkfac.layer_discovery import LayerWatch
from dkfac.layer_table import SkippedModule, format_layer_table
from dkfac.layer_usage import LayerUsage
from dkfac.strategies import Strategy
from dkfac.strategies.chooser import StrategyChoice
from dkfac.strategies.plan_report import PlanReport
from dkfac.update_intervals import UpdateIntervals


class PreconditionerInspection:
    """The read-only views of the preconditioner (a base class of it; holds no state itself)."""

    config: KFACConfig
    _model: nn.Module
    _watch: LayerWatch
    _layers: list[LayerCurvature]
    _skipped: list[SkippedModule]
    _strategy: Strategy
    _choice: StrategyChoice | None
    _recorder: StepRecorder
    _usage: LayerUsage
    _capture: StatisticsCapture
    _steps: int
    _skipped_steps: int
    _adaptive: AdaptiveStep | None
    _intervals: UpdateIntervals

    @property
    def steps(self) -> int:
        """Number of completed ``step()`` calls."""
        return self._steps

    @property
    def adaptive_report(self) -> AdaptiveReport | None:
        """What adaptive K-FAC chose at the last step (``None``: not adaptive, or no step yet)."""
        return None if self._adaptive is None else self._adaptive.last

    @property
    def profiling(self) -> bool:
        """Whether spd/pad still profile this cluster to re-plan (benchmarks: time after)."""
        return self._strategy.profiling

    @property
    def chosen_intervals(self) -> tuple[int | None, int] | None:
        """``(factor, decomposition)`` intervals the budgets chose (``"auto"``).

        Agreed by every worker (``None`` for a fixed factor interval; the decompositions run
        at multiples of both); ``None`` while they measure, or without budgets.
        """
        return self._intervals.chosen

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer name: (A, G)}`` running factors held by this worker.

        A factor held as its diagonal (an embedding's ``A``) is that diagonal, a vector.
        """
        held = [layer for layer in self._layers if self._strategy.holds_factors(layer)]
        return {
            layer.name: (layer.factors["a"].value(), layer.factors["g"].value()) for layer in held
        }

    def health(self) -> Health:
        """Numerical trouble so far, on this worker.

        Steps skipped for non-finite gradients, statistics left out for a held tensor changed
        in place, and per layer how often batch factors, running factors and decompositions
        failed (counted where the layer is decomposed).
        """
        return Health(
            skipped_steps=self._skipped_steps,
            refused_statistics=self._capture.refusals.left_out,
            layers={layer.name: layer.health() for layer in self._layers},
        )

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls of the last step per ``"phase/collective"`` (payload on this rank)."""
        return self._recorder.comm_stats()

    def timings(self) -> dict[str, float]:
        """Wall seconds of each phase of the last step on this rank.

        Phases: factor_compute (in the hooks), factor_comm, inverse_compute, inverse_comm,
        precondition, grad_comm. On CUDA, times are host times of asynchronous launches.
        """
        return self._recorder.timings()

    def comm_overlap(self) -> dict[str, dict[str, float]]:
        """Per phase of the last step: ``in_flight_s`` = ``exposed_s`` (waited) + ``hidden_s``."""
        return self._recorder.overlap()

    def export_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace (JSON) of the recent steps, one lane per phase."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._recorder.export_trace(path, rank=rank)

    def plan(self) -> PlanReport:
        """The strategy's placement as plain data (a typed dict, :class:`PlanReport`).

        ``"factors"``: one entry per factor with its owner(s); ``"buckets"``: the fused
        collectives in launch order with predicted times (``"spd"``/``"pad"``), plus the cost
        model behind them. ``"local"`` has no placement (empty lists). A chosen strategy
        (``strategy=dkfac.AutoOptions(...)``) adds ``"chosen"``: the ranking and why.
        """
        plan = self._strategy.plan()
        if self._choice is not None:
            plan["chosen"] = copy.deepcopy(self._choice.report)  # the caller may edit it
        return plan

    @property
    def layers(self) -> list[LayerCurvature]:
        """The preconditioned layers, in registration (module) order."""
        return list(self._layers)

    @property
    def skipped(self) -> list[SkippedModule]:
        """Modules with parameters that are not preconditioned, and why."""
        return list(self._skipped)

    def __repr__(self) -> str:
        header = (
            f"KFACPreconditioner(strategy={self._strategy.name!r}, "
            f"inverse_method={self.config.inverse_method!r}, steps={self._steps}, "
            f"layers={len(self._layers)}, skipped={len(self._skipped)})"
        )
        lines = format_layer_table(
            self._model,
            dict(zip(self._watch.paths, self._layers, strict=True)),
            self._skipped,
            self._strategy.plan(),
            silent=self._usage.silent,
            broadcast=self._usage.broadcast,
        )
        return "\n".join([header, *lines])
