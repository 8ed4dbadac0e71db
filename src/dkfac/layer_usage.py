"""What the layers did in a factor window: which ran forward, which only got a gradient.

Some layers have a gradient but never statistics: their parent uses their weight outside their
``forward()`` (``nn.MultiheadAttention`` calls ``F.linear`` on ``out_proj.weight``). Such a
layer passes its gradient through. So does an embedding looked up once and broadcast over the
batch (:mod:`dkfac.broadcast_check`). Both are agreed over the workers, so every worker
decides alike; the checks warn once per kind of trouble. The window's micro-batches (backward
calls) and those each layer sat out are counted here too (:mod:`dkfac.window_passes`).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from dkfac.autograd_engine import (
    SEPARATE_BACKWARD_CALLS,
    LayerGradients,
    SeparateBackwardCallsWarning,
    current_backward_id,
)
from dkfac.broadcast_check import BroadcastCheck
from dkfac.curvature.layer import LayerCurvature
from dkfac.window_passes import WindowPasses

logger = logging.getLogger(__name__)

#: Element-wise OR of flags over the workers (a strategy's ``any_worker``).
AnyWorker = Callable[[Sequence[bool], torch.device], list[bool]]


class LayerUsage:
    """The layers' forward calls in the current factor window, and the warnings they cause.

    Args:
        layers: every preconditioned layer, in the same order on every worker.
        accumulation_steps: the backward passes expected per window (None: any number).
    """

    def __init__(self, layers: Sequence[LayerCurvature], accumulation_steps: int | None) -> None:
        self._layers = list(layers)
        self._accumulation_steps = accumulation_steps
        # Layers whose forward hook ran in the current window (whether or not this worker
        # captures them).
        self._forwarded: set[str] = set()
        # Whether any layer ran forward in training mode with gradients on since the last
        # factor update, captured here or not (under DP-KFAC this worker's own layers may all
        # sit out a window that other layers trained in).
        self._trained_forward = False
        # Layers whose forward ran on some worker at least once: never silent again, so once
        # every layer is known, finding silent layers costs no communication.
        self._seen_forward: set[str] = set()
        self._silent: set[str] = set()
        self._warned: set[str] = set()
        self._broadcast_check = BroadcastCheck(layers, self._warn_once)
        self.gradients = LayerGradients()
        self._passes = WindowPasses(self.gradients)
        # A layer's call of the window (by its number): the backward call whose output
        # gradients entered its G (:meth:`g_taken`).
        self._g_calls: dict[int, int] = {}
        self._separate_warned = False

    @property
    def silent(self) -> frozenset[str]:
        """Layers with a gradient whose forward has run on no worker yet: passed through."""
        return frozenset(self._silent)

    @property
    def broadcast(self) -> frozenset[str]:
        """Layers looked up once and broadcast over the batch: passed through, not captured."""
        return frozenset(self._broadcast_check.broadcast)

    @property
    def per_example(self) -> frozenset[str]:
        """Checked layers found to get one row per example (no more evidence is gathered)."""
        return frozenset(self._broadcast_check.per_example)

    def is_broadcast(self, name: str) -> bool:
        """Whether layer ``name`` was found broadcast (checked in the hooks: no copy)."""
        return name in self._broadcast_check.broadcast

    @property
    def passed_through(self) -> frozenset[str]:
        """Every layer whose gradient passes through unpreconditioned."""
        return frozenset(self._silent | self._broadcast_check.broadcast)

    def pass_started(self, pass_id: int, rows: int | None) -> None:
        """The model's forward pass ``pass_id`` started on ``rows`` examples (None: unknown)."""
        self._passes.started(pass_id, rows)
        if rows is not None:
            self._broadcast_check.pass_started(pass_id, rows)

    def pass_ended(self, pass_id: int, output: Any) -> None:
        """The model's forward pass ``pass_id`` returned ``output`` (watched for its backward).

        Without ``accumulation_steps`` no micro-batch is counted: nothing is watched.
        """
        if self._accumulation_steps is not None:
            self._passes.watch_outputs(pass_id, output)

    def accumulators_found(self, pass_id: int, accumulators: list[Node] | None) -> None:
        """A layer's call in pass ``pass_id`` has ``accumulators``.

        They answer for the pass's outputs (:meth:`LayerGradients.any_computed`), kept only with
        ``accumulation_steps``.
        """
        if self._accumulation_steps is not None:
            self.gradients.found(pass_id, accumulators)

    def backward_reached(
        self, pass_id: int, backward: int | None = None, *, computing: bool
    ) -> None:
        """A backward call (``backward``, else the running one) reached pass ``pass_id``.

        ``computing``: it computes some layer's gradient (:class:`LayerGradients`).
        """
        if self._accumulation_steps is not None:  # as pass_ended: in every gradient hook
            self._passes.reached(pass_id, backward, computing=computing)

    def g_taken(self, name: str, call: int) -> None:
        """The output gradients of layer ``name``'s call number ``call`` enter ``G`` now.

        Warned once when another backward call's had already for that call of the layer (a
        layer called several times, in a loop or in checkpointed segments each backpropagated
        by a call of their own, is not: its calls have numbers of their own): ``G`` adds each
        backward call's products, which is not the summed loss's ``G``
        (:class:`~dkfac.autograd_engine.SeparateBackwardCallsWarning`). A call outside the
        autograd engine's knowledge (a compiled model's hooks) is not checked.
        """
        backward = current_backward_id()
        if backward is None or self._separate_warned:
            return
        if self._g_calls.setdefault(call, backward) != backward:
            self._separate_warned = True
            message = SEPARATE_BACKWARD_CALLS.format(name=name)
            logger.warning(message)
            # From a backward hook: no frame of the caller's to point at.
            warnings.warn(message, SeparateBackwardCallsWarning, stacklevel=1)

    def forward_ran(
        self, layer: LayerCurvature, *, training: bool, pass_id: int | None = None, rows: int = 0
    ) -> None:
        """``layer``'s forward hook ran; ``training``: in training mode with gradients on.

        For a layer that needs one row per example, ``pass_id`` and ``rows`` (its input's dim
        0) of a training call are kept for :meth:`find_silent`'s broadcast check.
        """
        self._forwarded.add(layer.name)
        self._trained_forward = self._trained_forward or training
        if training and pass_id is not None:
            self._broadcast_check.layer_ran(layer.name, pass_id, rows)

    def new_window(self) -> None:
        """Forget the current window's forward calls (a loaded state starts a new window)."""
        self._forwarded.clear()
        self._broadcast_check.clear_window()
        self._passes.clear()
        self._g_calls.clear()
        self._trained_forward = False

    def count_sat_out(self, captured: Sequence[LayerCurvature]) -> int | None:
        """Count in each layer's ``G`` the micro-batches it sat out; forget the window's passes.

        See :mod:`dkfac.window_passes` (only with ``accumulation_steps`` > 1 given). Call
        once per factor window, after every statistic of the window was added.

        Args:
            captured: the layers whose statistics this worker collects.

        Returns:
            The window's micro-batches (backward calls), None if not known.
        """
        micro_batches, estimated = self._passes.count_sat_out(captured, self._accumulation_steps)
        for name in estimated:
            self._warn_once(
                f"sat-out:{name}",
                f"K-FAC layer {name!r} sat out micro-batches of an accumulated window and its "
                "examples are not a whole multiple of the model's batch (or a batch was not "
                "known): the examples of those micro-batches, which its gradients are divided "
                "by, are taken as its mean per micro-batch, exact for equal micro-batches",
            )
        self._passes.clear()
        self._g_calls.clear()
        return micro_batches

    def check_statistics(
        self, captured: Sequence[LayerCurvature], micro_batches: int | None = None
    ) -> None:
        """Warn once if the window captured no statistics or not ``accumulation_steps`` passes.

        Args:
            captured: the layers whose statistics this worker collects.
            micro_batches: the window's backward calls (:meth:`count_sat_out`), None if not
                known: the most forward passes a layer had a gradient in are counted.
        """
        trained, self._trained_forward = self._trained_forward, False
        if not captured:  # DP-KFAC: this worker owns no layer, it has nothing to check
            return
        # A layer may sit out some passes (a branch): the window had as many as any layer saw.
        calls = [layer.backward_passes for layer in captured if layer.has_statistics]
        if not calls and trained:  # other layers trained; this worker's own sat this one out
            return
        if not calls:
            self._warn_once(
                "no-statistics",
                "K-FAC captured no factor statistics before this step: forward passes run in "
                "model.eval() mode or under torch.no_grad() are ignored; factors not updated",
            )
            return
        # Backward calls where known (a model called twice for one loss makes one), else the
        # most forward passes a layer had a gradient in.
        seen = micro_batches or max(calls)
        if self._accumulation_steps is not None and seen != self._accumulation_steps:
            self._warn_once(
                "accumulation",
                f"K-FAC saw {seen} backward pass(es) before step() but "
                f"accumulation_steps={self._accumulation_steps}; their statistics are pooled "
                "as one batch's, and a layer that ran in only some of them is not corrected "
                "for those it sat out (docs/math.md, 'Gradient accumulation')",
            )

    def find_silent(
        self, active: Sequence[LayerCurvature], any_worker: AnyWorker, device: torch.device
    ) -> None:
        """Mark the layers that have a gradient but whose forward ran on no worker this window.

        Such a layer's weight is used by its parent outside the layer's ``forward()``, so no
        statistics can exist for it; it passes its gradient through until a later factor
        window sees its forward. The decision is the same on every worker: whether a layer's
        forward ran is OR-ed over the workers (one small collective, only while some layer's
        forward has never run anywhere or some embedding is not decided by
        :mod:`dkfac.broadcast_check`, whose evidence travels in it), so a layer that only some
        ranks use in a step is preconditioned everywhere. When no hook ran on any worker (no
        forward since the last factor update), nothing is decided.

        Args:
            active: the layers that have a gradient this step.
            any_worker: the strategy's OR over the workers.
            device: where the agreement's tensor lives.
        """
        unknown = [layer for layer in self._layers if layer.name not in self._seen_forward]
        undecided = self._broadcast_check.undecided()
        local = [bool(self._forwarded)] + [layer.name in self._forwarded for layer in unknown]
        local += self._broadcast_check.evidence(undecided)
        self._forwarded.clear()
        self._broadcast_check.clear_window()
        if not unknown and not undecided:
            self._silent = set()
            return
        ran = any_worker(local, device)
        self._broadcast_check.decide(undecided, ran[1 + len(unknown) :])
        if not ran[0]:
            return
        self._seen_forward.update(
            layer.name for layer, r in zip(unknown, ran[1 : 1 + len(unknown)], strict=True) if r
        )
        self._silent = {layer.name for layer in active if layer.name not in self._seen_forward}
        for layer in active:
            if layer.name not in self._silent:
                continue
            kind = type(layer.block.module).__name__
            pattern = f"^{re.escape(layer.name)}$"
            self._warn_once(
                f"silent:{layer.name}",
                f"K-FAC layer {layer.name!r} ({kind}) has a gradient but captured no factor "
                "statistics: its forward() did not run, so its parent uses its weight outside "
                "its forward (e.g. nn.MultiheadAttention calls F.linear on out_proj.weight). "
                "Its gradient passes through unpreconditioned and unclipped; add it to "
                f"skip_layers (e.g. skip_layers=[{pattern!r}]) to say so explicitly",
            )

    def state(self) -> dict[str, Any]:
        """What was decided (for ``state_dict``): seen, silent and broadcast layers."""
        return {
            "seen_forward": sorted(self._seen_forward),
            "silent": sorted(self._silent),
            "broadcast_check": self._broadcast_check.state(),
        }

    def check_state(self, state: Mapping[str, Any] | None) -> None:
        """Raise ``ValueError`` unless :meth:`load` can take ``state`` (it names our layers)."""
        state = state or {}
        names = {layer.name for layer in self._layers}
        named = {*state.get("seen_forward", ()), *state.get("silent", ())}
        if not named <= names:
            raise ValueError(
                f"state_dict layer_usage names unknown layers: {sorted(named - names)}"
            )
        self._broadcast_check.check(state.get("broadcast_check"))

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state` (``None``: a state saved before it existed); a new window.

        Raises:
            ValueError: as :meth:`check_state`.
        """
        self.check_state(state)
        state = state or {}
        self._broadcast_check.load(state.get("broadcast_check"))
        self._seen_forward = set(state.get("seen_forward", ()))
        self._silent = set(state.get("silent", ()))
        self.new_window()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
            # Attributed to the user's pre.step() (step -> _step -> the check -> here).
            warnings.warn(message, RuntimeWarning, stacklevel=5)
