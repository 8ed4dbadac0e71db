"""Layer inputs held from the forward pass until their ``A`` statistics are formed together.

On a GPU a small model's factor step waits for the host, which prepares every launch; a
convolution's ``A`` takes a dozen or more (docs/benchmarks.md, "Host time of small steps").
The forward hook meets one layer at a time, so with ``batched_statistics`` it holds each
input instead, and the held inputs are formed when the backward pass begins (at the first
output-gradient hook), before the next forward pass, or at ``step()``: those of equal-shaped
layers with equal settings in the launches of one (:meth:`KroneckerBlock.a_statistics`),
then added to their layers and announced in the order they were held.

Autograd keeps most of these inputs until the backward pass anyway (a weight's gradient
needs its layer's input); where it does not (activation checkpointing), holding them costs
memory, so once :data:`PENDING_INPUT_BYTES` are held they are formed at once, in the forward
pass. An input changed in place after its layer's call cannot give its statistic any more:
that is an error, not a silently wrong factor. A worker that does not capture a layer
(DP-KFAC's other workers) watches its input all the same, counted in the budget, so every
worker refuses alike instead of the owner alone, leaving the others waiting in a collective.
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

#: Bytes of held inputs at which they are formed at once. Also the most inputs one group
#: stacks: its transient copies (the stack, the layouts or cast operands, the border rows'
#: gathers) are up to three to four times this (counted, not measured on a GPU).
PENDING_INPUT_BYTES = 128 << 20


@dataclass(frozen=True)
class _Held:
    """One forward call's input (its kept part), and what its statistic is added with."""

    layer: LayerCurvature
    captured: bool  # False: only watched for in-place changes (another worker's layer)
    x: Tensor
    version: int
    pass_id: int
    examples: int
    kept: int
    key: Hashable


class PendingInputs:
    """The inputs held since their statistics were last formed (see the module docstring)."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._bytes = 0

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(
        self,
        layer: LayerCurvature,
        x: Tensor,
        pass_id: int,
        examples: int,
        kept: int,
        captured: bool = True,
    ) -> bool:
        """Hold the first ``kept`` of ``examples`` examples of ``x``, a call's input.

        Args:
            layer: the layer called.
            x: its input.
            pass_id: the forward pass of the call.
            examples: the call's examples.
            kept: how many of them (the first) feed the statistic.
            captured: whether this worker captures ``layer``; ``False``: the input is only
                watched, so a refusal is raised here as on the worker that captures it.

        Returns:
            Whether it is held; ``False``: its block forms it alone (do it now, if captured).
        """
        if kept != examples and not layer.block.a_from_part:
            kept = examples  # the whole call, as the eager hook computes it
        part = x if kept == examples else x[:kept]
        if part.is_inference():  # no version counter to check: formed at once, as before
            return False
        key = layer.block.a_batch_key(part)
        if key is None:
            return False
        part = part.detach()  # the same storage and version counter, no graph
        key = (key, layer.factor_dtype)
        held = _Held(layer, captured, part, part._version, pass_id, examples, kept, key)
        self._held.append(held)
        self._bytes += _bytes(part)
        return True

    def over_budget(self) -> bool:
        """Whether the held inputs reached :data:`PENDING_INPUT_BYTES`."""
        return self._bytes >= PENDING_INPUT_BYTES

    def form(self) -> list[LayerCurvature]:
        """Form and add every captured input's statistic; their layers, in the order held.

        Raises:
            RuntimeError: an input was changed in place after its layer's call.
        """
        for entry in self._held:  # checked first: a refusal drops nothing held
            if entry.x._version != entry.version:
                raise RuntimeError(
                    f"layer {entry.layer.name!r}: its input was changed in place after the "
                    "layer's forward call, before K-FAC formed its statistic from it; do not "
                    "change a layer's input in place, or pass batched_statistics=False"
                )
        held = [entry for entry in self._held if entry.captured]
        self._held, self._bytes = [], 0

        def held_bytes(position: int) -> int:
            return _bytes(held[position].x)

        groups: dict[Hashable, list[int]] = {}
        for position, entry in enumerate(held):
            groups.setdefault(entry.key, []).append(position)
        formed: dict[int, FactorStatistic] = {}
        # Formed where the next pass may start inside torch.inference_mode: the sums must be
        # ordinary tensors, which later windows add to in place.
        with torch.inference_mode(False):
            for positions in groups.values():
                for chunk in cut_by_size(positions, held_bytes, PENDING_INPUT_BYTES):
                    statistics = held[chunk[0]].layer.a_statistics([held[p].x for p in chunk])
                    formed.update(zip(chunk, statistics, strict=True))
        for position, entry in enumerate(held):
            statistic, weight = whole_call_estimate(formed[position], entry.examples, entry.kept)
            entry.layer.add_statistic("a", statistic, entry.pass_id, None, weight)
        return [entry.layer for entry in held]

    def discard(self) -> None:
        """Forget the held inputs (the window's statistics are being dropped)."""
        self._held, self._bytes = [], 0


def _bytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()
