"""Saving and restoring a :class:`~dkfac.KFACPreconditioner`: steps, factors, decompositions."""

from __future__ import annotations

from typing import Any

from dkfac.adaptive import AdaptiveStep
from dkfac.capture import StatisticsCapture
from dkfac.config import KFACConfig
from dkfac.curvature.layer import LayerCurvature
from dkfac.layer_usage import LayerUsage
from dkfac.saved_state import needs_decomposition, pack_state, restore_state
from dkfac.strategies import Strategy
from dkfac.update_intervals import UpdateIntervals


class PreconditionerState:
    """``state_dict``/``load_state_dict`` of the preconditioner (a base class of it)."""

    config: KFACConfig
    _steps: int
    _layers: list[LayerCurvature]
    _adaptive: AdaptiveStep | None
    _usage: LayerUsage
    _capture: StatisticsCapture
    _force_inverse: bool
    _strategy: Strategy
    _intervals: UpdateIntervals

    def _is_factor_step(self, step: int) -> bool:
        return self._intervals.is_factor_step(step)

    def state_dict(self) -> dict[str, Any]:
        """Steps, running factors and decompositions: enough to continue bitwise identically.

        Intervals still being measured (``"auto"``) are measured again after a load, and may
        come out differently.
        """
        state = pack_state(self._steps, self.config.inverse_method, self._layers)
        state["layer_usage"] = self._usage.state()
        if self._adaptive is not None:
            state["adaptive"] = self._adaptive.state()
        if self.config.inv_budget is not None:
            state["intervals"] = self._intervals.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same model architecture).

        Raises:
            ValueError: the state does not match this preconditioner's layers, or has no
                adaptive state for an adaptive preconditioner.
        """
        blocks = {layer.name: layer.block for layer in self._layers}
        if self._adaptive is not None:
            self._adaptive.check_state(
                state.get("adaptive") if isinstance(state, dict) else None, blocks
            )
        self._usage.check_state(state.get("layer_usage") if isinstance(state, dict) else None)
        if self.config.inv_budget is not None:
            self._intervals.check_state(state.get("intervals") if isinstance(state, dict) else None)
        self._steps = restore_state(state, self._layers, self.config.inverse_method)
        if self._adaptive is not None:
            self._adaptive.load(state["adaptive"], blocks)
        self._usage.load(state.get("layer_usage"))  # which layers pass through, decided
        if self.config.inv_budget is not None:  # a state without a choice measures again
            self._intervals.load(state.get("intervals"))
        self._capture.discard_window()  # the restored step starts a window of its own
        self._capture.capturing = self._is_factor_step(self._steps)
        # Before after_load, which drops what the plan does not give this rank: the answer
        # must be the same on every rank (it decides a collective decomposition step).
        self._force_inverse = needs_decomposition(self._layers)
        self._strategy.after_load(self._layers)
