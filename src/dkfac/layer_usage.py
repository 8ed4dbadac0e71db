"""What the layers did in a factor window: which ran forward, which only got a gradient.

Some layers have a gradient but never statistics: their parent uses their weight outside their
``forward()`` (``nn.MultiheadAttention`` calls ``F.linear`` on ``out_proj.weight``). Such a
layer passes its gradient through. So does a layer whose block needs one input row per
example (:attr:`~dkfac.curvature.blocks.KroneckerBlock.needs_examples_in_dim0`, an embedding)
when it is looked up once and broadcast over the batch: Hugging Face's position ids ``(1, T)``
give it one "example" in a pass where the other layers see ``N``, and its output gradient is
the examples' sum, from which no exact factor exists. Both are agreed over the workers, so
every worker decides alike; the checks warn once per kind of trouble.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Sequence

import torch

from dkfac.curvature.layer import LayerCurvature

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
        # Per forward pass of the window: the model's examples (its first tensor input's
        # dim 0), and each training call's input dim 0 of the layers that need one row per
        # example.
        self._model_rows: dict[int, int] = {}
        self._examples: dict[int, dict[str, int]] = {}
        # Layers that need one row per example, once decided: broadcast lookups, or not.
        self._broadcast: set[str] = set()
        self._per_example: set[str] = set()
        self._checked = {layer.name for layer in layers if layer.block.needs_examples_in_dim0}

    @property
    def silent(self) -> frozenset[str]:
        """Layers with a gradient whose forward has run on no worker yet: passed through."""
        return frozenset(self._silent)

    @property
    def broadcast(self) -> frozenset[str]:
        """Layers looked up once and broadcast over the batch: passed through, not captured."""
        return frozenset(self._broadcast)

    def is_broadcast(self, name: str) -> bool:
        """Whether layer ``name`` was found broadcast (checked in the hooks: no copy)."""
        return name in self._broadcast

    @property
    def passed_through(self) -> frozenset[str]:
        """Every layer whose gradient passes through unpreconditioned."""
        return frozenset(self._silent | self._broadcast)

    def pass_started(self, pass_id: int, rows: int) -> None:
        """The model's forward pass ``pass_id`` started on a batch of ``rows`` examples."""
        self._model_rows[pass_id] = rows

    def forward_ran(
        self, layer: LayerCurvature, *, training: bool, pass_id: int | None = None, rows: int = 0
    ) -> None:
        """``layer``'s forward hook ran; ``training``: in training mode with gradients on.

        For a layer that needs one row per example, ``pass_id`` and ``rows`` (its input's dim
        0) of a training call are kept for :meth:`find_silent`'s broadcast check.
        """
        self._forwarded.add(layer.name)
        self._trained_forward = self._trained_forward or training
        if training and pass_id is not None and layer.name in self._checked:
            seen = self._examples.setdefault(pass_id, {})
            seen[layer.name] = min(seen.get(layer.name, rows), rows)

    def new_window(self) -> None:
        """Forget the current window's forward calls (a loaded state starts a new window)."""
        self._forwarded.clear()
        self._examples.clear()
        self._model_rows.clear()
        self._trained_forward = False

    def check_statistics(self, captured: Sequence[LayerCurvature]) -> None:
        """Warn once if the window captured no statistics or not ``accumulation_steps`` passes.

        Args:
            captured: the layers whose statistics this worker collects.
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
        if self._accumulation_steps is not None and max(calls) != self._accumulation_steps:
            self._warn_once(
                "accumulation",
                f"K-FAC saw {max(calls)} backward pass(es) before step() but "
                f"accumulation_steps={self._accumulation_steps}; statistics are pooled "
                "over all of them",
            )

    def find_silent(
        self, active: Sequence[LayerCurvature], any_worker: AnyWorker, device: torch.device
    ) -> None:
        """Mark the layers that have a gradient but whose forward ran on no worker this window.

        Such a layer's weight is used by its parent outside the layer's ``forward()``, so no
        statistics can exist for it; it passes its gradient through until a later factor
        window sees its forward. The decision is the same on every worker: whether a layer's
        forward ran is OR-ed over the workers (one small collective, only while some layer's
        forward has never run anywhere), so a layer that only some ranks use in a step is
        preconditioned everywhere. When no hook ran on any worker (no forward since the last
        factor update), nothing is decided.

        Args:
            active: the layers that have a gradient this step.
            any_worker: the strategy's OR over the workers.
            device: where the agreement's tensor lives.
        """
        unknown = [layer for layer in self._layers if layer.name not in self._seen_forward]
        decided = self._broadcast | self._per_example
        undecided = [layer for layer in self._layers if layer.name in self._checked - decided]
        local = [bool(self._forwarded)] + [layer.name in self._forwarded for layer in unknown]
        local += [flag for layer in undecided for flag in self._broadcast_evidence(layer.name)]
        self._forwarded.clear()
        self._examples.clear()
        self._model_rows.clear()
        if not unknown and not undecided:
            self._silent = set()
            return
        ran = any_worker(local, device)
        self._decide_broadcast(undecided, ran[1 + len(unknown) :])
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

    def _broadcast_evidence(self, name: str) -> tuple[bool, bool]:
        """Whether this window can tell, and whether it shows ``name`` broadcast.

        In a forward pass of the model on ``N`` examples (its first tensor input's dim 0),
        ``name`` looked up once and broadcast has another dim 0 (1 for ids ``(1, T)``, ``T``
        for ids ``(T,)``). A pass tells when the dims differ, or when ``N > 1`` (over one
        example a broadcast sums one gradient: exact). Calls outside the model's forward
        tell nothing.
        """
        informative = broadcast = False
        for pass_id, seen in self._examples.items():
            examples = self._model_rows.get(pass_id)
            if name not in seen or examples is None:
                continue
            mismatch = seen[name] != examples
            informative = informative or mismatch or examples > 1
            broadcast = broadcast or mismatch
        return informative, broadcast

    def _decide_broadcast(self, undecided: Sequence[LayerCurvature], flags: Sequence[bool]) -> None:
        """Record the agreed evidence: each layer decided once some worker could tell."""
        for layer, informative, broadcast in zip(undecided, flags[0::2], flags[1::2], strict=True):
            if not informative:
                continue
            if not broadcast:
                self._per_example.add(layer.name)
                continue
            self._broadcast.add(layer.name)
            layer.forget()  # what it captured before it could be told is not a factor
            kind = type(layer.block.module).__name__
            self._warn_once(
                f"broadcast:{layer.name}",
                f"K-FAC layer {layer.name!r} ({kind}) saw another number of examples (dim 0 of "
                "its input) than the model's forward pass had: it was looked up once and "
                "broadcast over the batch (e.g. Hugging Face's position ids of shape (1, T)), "
                "so its output "
                "gradient is the examples' sum and no exact factor exists. Its gradient passes "
                "through unpreconditioned and unclipped; add it to skip_layers (e.g. "
                f"skip_layers=[{f'^{re.escape(layer.name)}$'!r}]) to say so explicitly",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
            # Attributed to the user's pre.step() (step -> _step -> the check -> here).
            warnings.warn(message, RuntimeWarning, stacklevel=5)
