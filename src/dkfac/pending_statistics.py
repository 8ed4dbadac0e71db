"""Layer inputs and output gradients held until their statistics are formed together.

On a GPU a small model's factor step waits for the host, which prepares every launch; a
convolution's ``A`` takes a dozen or more (docs/benchmarks.md, "Host time of small steps").
The hooks meet one layer at a time, so with ``batched_statistics`` they hold each call's
input (forward hook) and output gradient (backward hook) instead. The held inputs are formed
when the backward pass begins (at the first output-gradient hook), the held gradients when the
next forward pass begins or at ``step()``; both when what is held reaches
:data:`PENDING_BYTES`: those of equal-shaped layers with equal settings in the launches of one
(:meth:`KroneckerBlock.a_statistics`, :meth:`KroneckerBlock.g_statistics`), then added to
their layers and announced in the order they were held.

Autograd keeps most inputs until the backward pass anyway (a weight's gradient needs its
layer's input), but not under activation checkpointing, and it frees each output gradient
once used: holding them costs memory, so once :data:`PENDING_BYTES` are held they are formed
at once. A tensor changed in place after it was held cannot give its statistic any more: that
is an error, not a silently wrong factor. Its statistic is left out of the window (the rest
is formed and kept: each factor's window is the mean over the examples it has, ``G`` still
scaled by all the examples its gradients were averaged over; the factors' sums and counts
are exchanged as usual, so replicas stay equal), and the error is raised at the next forward
pass or ``step()``, never from inside a hook: an error in the backward pass would leave DDP's
gradient averaging half done. Repeating the call that raised goes on. A worker that does not
capture a layer (DP-KFAC's other workers) watches its input and output gradient all the same,
counted in the budget, so with the same shapes on every worker all raise at the same call,
not the owner alone, and every worker forms what it holds at the same hooks. Workers holding
different bytes (different batch shapes) may form a tensor at different hooks, one before
the change and one after: then only the one that refused raises.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from dkfac.curvature.blocks import FactorStatistic
from dkfac.curvature.chunks import cut_by_size
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.statistics import whole_call_estimate

#: Bytes held at which everything held is formed at once. Also the most one group stacks:
#: its transient copies (the stack, the layouts or cast operands, the border rows' gathers)
#: are up to three to four times this (counted, not measured on a GPU), plus the padded
#: layout of a convolution's shifted products or im2col matrices, up to ``(h+2)(w+2)/(h·w)``
#: times its inputs with a 3x3 kernel's ``same`` padding (9 on 1x1 images), and im2col's
#: patches, up to ``kh·kw`` times them (its rule takes them on outputs no larger than
#: the input: ``factors.explicit_patches_pay``).
PENDING_BYTES = 128 << 20

#: What a held tensor of each side is, for the in-place refusal.
_WHAT = {"a": "input", "g": "output gradient"}


class HeldTensorChangedError(RuntimeError):
    """A held input or output gradient was changed in place before its statistic was formed."""


@dataclass
class Refusals:
    """Held tensors changed in place before their statistics were formed.

    Attributes:
        unraised: the first refusal's message not raised yet (:meth:`raise_unraised`).
        left_out: the statistics left out of their windows so far, on this worker.
    """

    unraised: str | None = None
    left_out: int = 0

    def raise_unraised(self) -> None:
        """Raise the refusal not raised yet, if any (once).

        Raises:
            HeldTensorChangedError: a held tensor was changed in place since the last call.
        """
        message, self.unraised = self.unraised, None
        if message is not None:
            raise HeldTensorChangedError(message)


@dataclass(frozen=True, eq=False)
class _Held:
    """One call's tensor (its kept part), and what its statistic is added with."""

    layer: LayerCurvature
    side: str  # "a": the call's input; "g": its output gradient
    captured: bool  # False: only watched for in-place changes (another worker's layer)
    tensor: Tensor
    version: int
    pass_id: int
    examples: int
    kept: int
    key: Hashable
    grad_scale: float | None  # G: the GradScaler's loss scale the gradient carries


class PendingStatistics:
    """The tensors held since their statistics were last formed (see the module docstring)."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._bytes = 0
        self._sides = {"a": 0, "g": 0}  # entries held of each side
        self.refusals = Refusals()

    def __bool__(self) -> bool:
        return bool(self._held)

    def holds(self, side: str) -> bool:
        """Whether a tensor of factor ``side`` is held."""
        return self._sides[side] > 0

    def hold(
        self,
        layer: LayerCurvature,
        side: str,
        tensor: Tensor,
        pass_id: int,
        examples: int,
        kept: int,
        captured: bool = True,
        grad_scale: float | None = None,
    ) -> bool:
        """Hold the first ``kept`` of ``examples`` examples of ``tensor``, for factor ``side``.

        Args:
            layer: the layer called.
            side: ``"a"`` (``tensor`` is the call's input) or ``"g"`` (its output gradient).
            tensor: the call's input or output gradient.
            pass_id: the forward pass of the call.
            examples: the call's examples.
            kept: how many of them (the first) feed the statistic.
            captured: whether this worker captures ``layer``; ``False``: the tensor is only
                watched, so a refusal is raised here as on the worker that captures it.
            grad_scale: ``G``: the loss scale of a ``GradScaler`` that ``tensor`` carries.

        Returns:
            Whether it is held; ``False``: its block forms it alone (do it now, if captured).
        """
        if side == "a" and kept != examples and not layer.block.a_from_part:
            kept = examples  # the whole call, as the eager hook computes it
        part = tensor if kept == examples else tensor[:kept]
        if part.is_inference():  # no version counter to check: formed at once, as before
            return False
        block = layer.block
        key = block.a_batch_key(part) if side == "a" else block.g_batch_key(part)
        if key is None:
            return False
        part = part.detach()  # the same storage and version counter, no graph
        key = (side, key, layer.factor_dtype)
        held = _Held(
            layer, side, captured, part, part._version, pass_id, examples, kept, key, grad_scale
        )
        self._held.append(held)
        self._bytes += _kept_alive(part)
        self._sides[side] += 1
        return True

    def over_budget(self) -> bool:
        """Whether the held tensors reached :data:`PENDING_BYTES`."""
        return self._bytes >= PENDING_BYTES

    def form(self, side: str | None = None) -> list[tuple[LayerCurvature, str]]:
        """Form and add the statistics held (of factor ``side``; ``None``: every one).

        A tensor changed in place since it was held is left out (:attr:`refusals`).

        Returns:
            The captured layers and sides whose statistics were added, in the order held.
        """
        chosen = [entry for entry in self._held if side is None or entry.side == side]
        changed = [entry for entry in chosen if entry.tensor._version != entry.version]
        for entry in changed:
            self._refuse(entry)
        if changed:
            chosen = [entry for entry in chosen if entry.tensor._version == entry.version]
        self._held = [entry for entry in self._held if side is not None and entry.side != side]
        self._bytes = sum(_kept_alive(entry.tensor) for entry in self._held)
        self._sides = {each: 0 for each in self._sides}
        for entry in self._held:
            self._sides[entry.side] += 1
        held = [entry for entry in chosen if entry.captured]

        def held_bytes(position: int) -> int:
            return _bytes(held[position].tensor)

        groups: dict[Hashable, list[int]] = {}
        for position, entry in enumerate(held):
            groups.setdefault(entry.key, []).append(position)
        formed: dict[int, FactorStatistic] = {}
        # Formed and added where the next pass may start inside torch.inference_mode: the
        # sums (and a scaled sum that starts a window's total) must be ordinary tensors, which
        # later windows add to in place.
        with torch.inference_mode(False):
            for positions in groups.values():
                for chunk in cut_by_size(positions, held_bytes, PENDING_BYTES):
                    first, tensors = held[chunk[0]], [held[p].tensor for p in chunk]
                    if first.side == "a":
                        statistics = first.layer.a_statistics(tensors)
                    else:
                        statistics = first.layer.g_statistics(tensors)
                    formed.update(zip(chunk, statistics, strict=True))
            for position, entry in enumerate(held):
                statistic, weight = whole_call_estimate(
                    formed[position], entry.examples, entry.kept
                )
                layer, scale = entry.layer, entry.grad_scale
                layer.add_statistic(entry.side, statistic, entry.pass_id, scale, weight)
        return [(entry.layer, entry.side) for entry in held]

    def discard(self) -> None:
        """Forget what is held (the window's statistics are being dropped), and its refusal.

        A refusal not raised yet said the rest of its window was kept; the window is gone.
        """
        self._held, self._bytes = [], 0
        self.refusals.unraised = None
        self._sides = {each: 0 for each in self._sides}

    def _refuse(self, entry: _Held) -> None:
        """Leave ``entry``'s statistic out, to be raised at the next forward pass or step."""
        if entry.captured:
            self.refusals.left_out += 1
            # A held tensor is batched along dim 0 (its block gave it a batch key); a part of
            # a call (statistics_fraction) stands for the whole call's examples.
            whole = entry.kept == entry.examples
            examples = int(entry.tensor.shape[0]) if whole else entry.examples
            entry.layer.statistics(entry.side).lose(entry.pass_id, examples)
        if self.refusals.unraised is None:
            self.refusals.unraised = (
                f"layer {entry.layer.name!r}: its {_WHAT[entry.side]} was changed in place "
                f"after the layer's {'forward call' if entry.side == 'a' else 'backward hook'}, "
                "before K-FAC formed its statistic from it; that statistic was left out of its "
                "factor window (the rest was kept). Do not change it in place, or pass "
                "batched_statistics=False"
            )


def _bytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements (what a group's copies of it take)."""
    return tensor.numel() * tensor.element_size()


def _kept_alive(tensor: Tensor) -> int:
    """The bytes holding ``tensor`` keeps alive: its whole storage.

    A fraction's part of a gradient keeps all of it, which autograd would have freed.
    """
    return max(tensor.untyped_storage().nbytes(), _bytes(tensor))
