"""Factor statistics captured inside a compiled graph, added to the layers at ``step()``.

Under ``torch.compile`` TorchDynamo traces dkfac's hooks into the model's graph. A hook that
changes Python state in the backward pass cannot be traced (the output-gradient hook of the
eager path adds to a layer's :class:`~dkfac.curvature.statistics.FactorStatistics` and tells
the strategy), and state the forward hook reads that grows from step to step (a pass counter,
a running sum) makes TorchDynamo recompile. So, while compiling, the hooks only do tensor
work: each call's ``Σ a aᵀ`` and (from its output's gradient hook; before torch 2.13 from
an identity function the forward hook puts in place of the output) ``Σ dy dyᵀ`` are added into
one buffer per layer and factor, made before the window on the eager side, and the forward
hook records the call (layer, pass, the input's and output's shapes). At the window's
``step()``, :meth:`DeferredStatistics.fold` adds each buffer to its layer as the eager hooks
would have, with each call's rows and examples from its block, and tells the strategy.
What the hooks do in one window is then the same every window, and the graph is reused.

A block counts rows and examples from the shape alone, but only computing its statistic says
what they are: the first time a layer records a shape, :meth:`DeferredStatistics.fold` computes
the statistic of zeros of that shape on the eager side, once, and keeps the counts. That
eager call also makes what the block prepares outside a graph (a convolution's stride-1 index
plan, where it takes shifted products), so from the next window on the compiled hooks use it
too (one recompilation).

A pipelined strategy hears of the statistics at ``step()`` instead of during the backward pass:
the same factors, without the overlap.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from dkfac.curvature.blocks import FactorStatistic
from dkfac.curvature.layer import LayerCurvature

#: ``on_statistic(layer, side)``: the strategy hears of one added statistic.
StatisticListener = Callable[[LayerCurvature, str], None]
#: Recorded shapes whose counts are kept before the cache starts over.
MAX_COUNTED_SHAPES = 1024
#: The ``GradScaler``'s loss scale of the window (read only when there is something to fold).
LossScale = Callable[[], float | None]
#: Whether TorchDynamo compiles tensor hooks that mutate one buffer more than once per graph
#: (a layer called more than once per pass). Before 2.13 it fails ("referenced nonexistent
#: value": 2.11.0 and 2.12.1 checked); there the output gradient's statistic comes from an
#: identity function put in place of the layer's output (:class:`_GStatisticOnBackward`).
#: 2.13 pre-releases and source builds (``2.13.0a0``) count as before 2.13: the safe side.
TENSOR_HOOKS_SHARE_BUFFERS = TorchVersion(torch.__version__) >= "2.13"


@dataclass(frozen=True)
class _Call:
    """One captured call: its layer, factor side, forward pass and the tensor it came from."""

    index: int
    side: str
    pass_id: int
    shape: torch.Size
    dtype: torch.dtype


class DeferredStatistics:
    """Per layer, the window's ``A`` and ``G`` sums of calls captured while compiling.

    Args:
        layers: the preconditioned layers (indexed as the capture hooks index them).
    """

    def __init__(self, layers: Sequence[LayerCurvature]) -> None:
        self._layers = list(layers)
        self._sums: dict[tuple[int, str], Tensor] = {}
        # Backward calls that reached each layer's G buffer (counted by the hook itself).
        self._backward_calls: dict[int, Tensor] = {}
        self._calls: list[_Call] = []
        # (layer, side, shape, dtype) -> (rows, examples) of one call, as its block counts them.
        self._counts: dict[tuple[int, str, torch.Size, torch.dtype], tuple[int, int]] = {}
        self.prepared = False
        #: Whether compiled hooks watch ``G`` through :class:`_GStatisticOnBackward`.
        self.output_function = not TENSOR_HOOKS_SHARE_BUFFERS

    def prepare(self, captured: Collection[int]) -> None:
        """Make the zeroed buffers of the layers this worker captures (by index), eagerly.

        On the layers' devices as they are now: a model moved to another device afterwards
        needs a new preconditioner.
        """
        self.prepared = True
        for index, layer in enumerate(self._layers):
            if index not in captured:
                continue
            for side in ("a", "g"):
                self._sums[index, side] = layer.zeros(side)
            device = layer.block.weight.device
            self._backward_calls[index] = torch.zeros((), dtype=torch.int64, device=device)

    def add_a(self, index: int, pass_id: int, x: Tensor) -> None:
        """While compiling: add ``Σ a aᵀ`` of one forward call of layer ``index``."""
        self._sums[index, "a"].add_(self._layers[index].a_statistic(x).total)
        self._calls.append(_Call(index, "a", pass_id, x.shape, x.dtype))

    def watch_g(self, index: int, pass_id: int, output: Tensor) -> Tensor | None:
        """While compiling: add ``Σ dy dyᵀ`` of ``output``'s gradient when it comes.

        Tensor work on buffers made outside the graph only: TorchDynamo traces it into the
        backward graph. Returns the tensor to use in place of ``output`` (torch < 2.13:
        :class:`_GStatisticOnBackward`), or None (a hook on ``output`` sees every use of it).
        """
        layer, total = self._layers[index], self._sums[index, "g"]
        calls = self._backward_calls[index]
        self._calls.append(_Call(index, "g", pass_id, output.shape, output.dtype))
        if self.output_function:
            result: Tensor = _GStatisticOnBackward.apply(  # type: ignore[no-untyped-call]
                output, total, calls, layer
            )
            return result

        def add_g(grad: Tensor) -> None:
            total.add_(layer.g_statistic(grad).total)
            calls.add_(1)

        output.register_hook(add_g)  # type: ignore[no-untyped-call]
        return None

    def discard(self) -> None:
        """Forget the window's calls and zero the buffers (a restored state, a removal)."""
        self._calls = []
        for buffer in (*self._sums.values(), *self._backward_calls.values()):
            buffer.zero_()

    def release(self) -> None:
        """Drop the buffers (the hooks are gone)."""
        self._calls, self._sums, self._backward_calls = [], {}, {}

    def fold(self, grad_scale: LossScale, on_statistic: StatisticListener) -> None:
        """Add the window's sums to the layers, as the eager hooks would have; zero the buffers.

        Args:
            grad_scale: returns the ``GradScaler``'s loss scale of the window (``G`` is divided
                by its square) or ``None``; called only when there is something to fold.
            on_statistic: called once per added statistic, as the eager hooks call the strategy.

        Raises:
            RuntimeError: an output gradient reached a layer for some of its recorded calls but
                not all (their rows and examples cannot be told apart).
        """
        if not self._calls:
            return
        try:
            self._fold(self._calls, grad_scale(), on_statistic)
        finally:
            self.discard()

    def _fold(
        self, calls: Sequence[_Call], grad_scale: float | None, on_statistic: StatisticListener
    ) -> None:
        recorded_g = Counter(call.index for call in calls if call.side == "g")
        indices = list(recorded_g)
        counted = (
            torch.stack([self._backward_calls[i] for i in indices]).tolist() if indices else []
        )  # one read from the device for every layer
        reached = dict(zip(indices, counted, strict=True))
        for index, expected in recorded_g.items():
            if reached[index] not in (0, expected):
                name = self._layers[index].name
                raise RuntimeError(
                    f"K-FAC layer {name!r} under torch.compile: its output gradient came for "
                    f"{reached[index]} of its {expected} calls in this window; which calls it "
                    "came for cannot be told in a compiled graph, so G has no exact count"
                )
        first: set[tuple[int, str]] = set()
        for call in calls:
            if call.side == "g" and reached[call.index] == 0:
                continue  # no backward reached it: no G, as with the eager hooks
            layer = self._layers[call.index]
            key = (call.index, call.side)
            rows, examples = self._counted(call)
            # The window's whole sum rides on the layer's first call, zeros of its shape on
            # the others: a tensor each, since a pipelined strategy may send one as a late
            # addition, reduced in place while the fold goes on.
            total = self._sums[key]
            total = total.clone() if key not in first else torch.zeros_like(total)
            first.add(key)
            statistic = FactorStatistic(total, rows, examples)
            layer.add_statistic(call.side, statistic, call.pass_id, grad_scale)
            on_statistic(layer, call.side)

    def _counted(self, call: _Call) -> tuple[int, int]:
        """Rows and examples of one call, from its block's statistic of zeros (kept)."""
        key = (call.index, call.side, call.shape, call.dtype)
        counts = self._counts.get(key)
        if counts is None:
            if len(self._counts) >= MAX_COUNTED_SHAPES:  # shapes that vary without end
                self._counts.clear()
            layer = self._layers[call.index]
            device = layer.block.weight.device
            zeros = torch.zeros(call.shape, dtype=call.dtype, device=device)
            made = layer.a_statistic(zeros) if call.side == "a" else layer.g_statistic(zeros)
            counts = self._counts[key] = (made.rows, made.examples)
        return counts


class _GStatisticOnBackward(torch.autograd.Function):
    """The identity on a layer's output whose backward adds ``Σ dy dyᵀ`` into a buffer.

    What a hook on the output does, as a function TorchDynamo before 2.13 can trace (see
    :data:`TENSOR_HOOKS_SHARE_BUFFERS`). The forward hook returns its result in place of the
    layer's output, so only gradients that flow through the result reach ``G``: forward hooks
    that run after dkfac's see it; those that run before (registered before the
    preconditioner, with ``prepend``, or for every module) see the raw output (the
    preconditioner names the layers with earlier hooks of their own). The result is
    ``output.detach()``: the same memory and version counter, but not a view in autograd's
    sense, since a view made inside a custom function may not be modified in place (an
    in-place ReLU after a convolution).
    """

    @staticmethod
    def forward(
        ctx: Any, output: Tensor, total: Tensor, calls: Tensor, layer: LayerCurvature
    ) -> Tensor:
        # On ctx, not saved for backward: the buffers change in place between the calls.
        ctx.buffers = (total, calls, layer)
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        total, calls, layer = ctx.buffers
        total.add_(layer.g_statistic(grad).total)
        calls.add_(1)
        return grad, None, None, None
