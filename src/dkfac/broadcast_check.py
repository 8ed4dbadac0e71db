"""Finding layers looked up once and broadcast over the batch (an embedding's position ids).

A layer whose block needs one input row per example along dim 0
(:attr:`~dkfac.curvature.blocks.KroneckerBlock.needs_examples_in_dim0`, an embedding) has no
exact factor when its input was made once and broadcast over the batch: Hugging Face's
position ids ``(1, T)``, nanoGPT's ``arange(T)``. Its output gradient is then the examples'
sum. The layer cannot tell, but the forward pass can: the model's own input (the first tensor
with a dim 0 among its arguments, searched through dicts, lists, tuples and dataclasses) has
the batch's ``N`` examples, and such a layer's input another dim 0.

Per factor window, :class:`BroadcastCheck` keeps ``N`` and each checked layer's input dim 0
per forward pass; :class:`~dkfac.layer_usage.LayerUsage` ORs the evidence over the workers,
and every worker decides alike: broadcast at the first window that shows another dim 0,
one row per example after :data:`PER_EXAMPLE_WINDOWS` windows that could tell and did not.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dkfac.curvature.layer import LayerCurvature
from dkfac.nested_tensors import nested_tensors

logger = logging.getLogger(__name__)

#: Windows that could tell and showed one row per example before a layer is trusted: one
#: window where the ids' length happened to equal the batch size must not decide it.
PER_EXAMPLE_WINDOWS = 3
#: Windows that ran a checked layer without telling anything before a warning says so.
UNDECIDED_WINDOWS = 8


def batch_rows(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Dim 0 of the first tensor with a dim 0 among a call's arguments (depth first)."""
    for tensor in nested_tensors([*args, *kwargs.values()], depth_first=True):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


class BroadcastCheck:
    """The evidence of one factor window and the decisions taken so far.

    Args:
        layers: every preconditioned layer (only those whose block needs one row per example
            are checked), in the same order on every worker.
        warn: ``warn(key, message)``, once per key.
    """

    def __init__(self, layers: Sequence[LayerCurvature], warn: Callable[[str, str], None]) -> None:
        self._checked = [layer for layer in layers if layer.block.needs_examples_in_dim0]
        self._names = {layer.name for layer in self._checked}
        self._warn = warn
        self._model_rows: dict[int, int] = {}
        self._rows: dict[int, dict[str, int]] = {}
        self.broadcast: set[str] = set()
        self.per_example: set[str] = set()
        self._agreeing: dict[str, int] = {}  # windows that told "one row per example"
        self._silent_windows: dict[str, int] = {}  # windows that ran it and told nothing

    # -- recording ---------------------------------------------------------------------------
    def pass_started(self, pass_id: int, rows: int) -> None:
        """The model's forward pass ``pass_id`` started on a batch of ``rows`` examples."""
        self._model_rows[pass_id] = rows

    def layer_ran(self, name: str, pass_id: int, rows: int) -> None:
        """A training call of layer ``name`` in pass ``pass_id`` had ``rows`` along dim 0."""
        if name in self._names:
            seen = self._rows.setdefault(pass_id, {})
            seen[name] = min(seen.get(name, rows), rows)

    def clear_window(self) -> None:
        """Forget the window's evidence."""
        self._model_rows.clear()
        self._rows.clear()

    # -- deciding ----------------------------------------------------------------------------
    def undecided(self) -> list[LayerCurvature]:
        """The checked layers not decided yet, in layer order."""
        decided = self.broadcast | self.per_example
        return [layer for layer in self._checked if layer.name not in decided]

    def evidence(self, layers: Sequence[LayerCurvature]) -> list[bool]:
        """Per layer, ``(ran, could tell, showed another dim 0)`` of this window, flattened."""
        flags: list[bool] = []
        for layer in layers:
            ran = informative = broadcast = False
            for pass_id, seen in self._rows.items():
                if layer.name not in seen:
                    continue
                ran = True
                examples = self._model_rows.get(pass_id)
                if examples is None:  # outside the model's forward, or a recomputation
                    continue
                mismatch = seen[layer.name] != examples
                # With one example a broadcast sums one gradient: exact, and nothing told.
                informative = informative or mismatch or examples > 1
                broadcast = broadcast or mismatch
            flags += [ran, informative, broadcast]
        return flags

    def decide(self, layers: Sequence[LayerCurvature], agreed: Sequence[bool]) -> None:
        """Take the decisions the workers' OR-ed :meth:`evidence` of ``layers`` supports."""
        for index, layer in enumerate(layers):
            ran, informative, broadcast = agreed[3 * index : 3 * index + 3]
            name = layer.name
            if broadcast:
                self.broadcast.add(name)
                layer.forget()  # what it captured before it could be told is not a factor
                self._warn(f"broadcast:{name}", _broadcast_message(layer))
            elif informative:
                self._agreeing[name] = self._agreeing.get(name, 0) + 1
                if self._agreeing[name] >= PER_EXAMPLE_WINDOWS:
                    self.per_example.add(name)
            elif ran:
                self._silent_windows[name] = self._silent_windows.get(name, 0) + 1
                if self._silent_windows[name] == UNDECIDED_WINDOWS:
                    self._warn(f"undecided:{name}", _undecided_message(layer))

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The decisions and their counts (for ``state_dict``)."""
        return {
            "broadcast": sorted(self.broadcast),
            "per_example": sorted(self.per_example),
            "agreeing": dict(self._agreeing),
            "silent_windows": dict(self._silent_windows),
        }

    def check(self, state: Mapping[str, Any] | None) -> None:
        """Raise ``ValueError`` unless :meth:`load` can take ``state`` (it names our layers)."""
        state = state or {}
        named = {*state.get("broadcast", ()), *state.get("per_example", ())}
        named |= {*state.get("agreeing", {}), *state.get("silent_windows", {})}
        if not named <= self._names:
            raise ValueError(
                f"state_dict layer_usage names layers this model does not check: "
                f"{sorted(named - self._names)}"
            )

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state` (``None``: a state saved before it existed; nothing decided).

        Raises:
            ValueError: as :meth:`check`.
        """
        self.check(state)
        state = state or {}
        self.broadcast = set(state.get("broadcast", ()))
        self.per_example = set(state.get("per_example", ()))
        self._agreeing = {k: int(v) for k, v in state.get("agreeing", {}).items()}
        self._silent_windows = {k: int(v) for k, v in state.get("silent_windows", {}).items()}


def _broadcast_message(layer: LayerCurvature) -> str:
    kind = type(layer.block.module).__name__
    pattern = f"^{re.escape(layer.name)}$"
    return (
        f"K-FAC layer {layer.name!r} ({kind}) had another dim 0 than the model's batch in a "
        "forward pass: its ids were looked up once and broadcast over the batch (e.g. Hugging "
        "Face's position ids (1, T), or arange(T)), so its output gradient is the examples' "
        "sum and no exact factor exists; or they were flattened ((N*T,) ids: reshape them to "
        "(N, T) to have it preconditioned). Its gradient passes through unpreconditioned and "
        f"unclipped; add it to skip_layers (e.g. skip_layers=[{pattern!r}]) to say so"
    )


def _undecided_message(layer: LayerCurvature) -> str:
    kind = type(layer.block.module).__name__
    return (
        f"K-FAC cannot tell whether layer {layer.name!r} ({kind}) gets one row per example: "
        f"in {UNDECIDED_WINDOWS} factor windows no forward pass of the model had a batch of "
        "more than one example among its tensor inputs, or it ran outside the model's "
        "forward. It stays preconditioned; if its ids are looked up once and broadcast over "
        "the batch, its factor is wrong: add it to skip_layers"
    )
