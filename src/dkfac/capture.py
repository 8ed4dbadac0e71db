"""The hooks that feed each layer's factor statistics, bound to the forward pass they belong to.

A forward hook per layer accumulates ``A`` from the layer's input and registers a hook on its
output that accumulates ``G`` from the output gradient. Examples count once per forward pass of
the whole model (a shared layer runs several times in one), so every call is bound to a pass
when it happens: the backward of several passes may come later, all at once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from dkfac.autograd_engine import accumulators_below, current_backward_id
from dkfac.broadcast_check import batch_rows
from dkfac.comm import StepRecorder
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.statistics import whole_call_estimate
from dkfac.deferred_statistics import DeferredStatistics
from dkfac.layer_hooks import LayerHooks, warn_about_earlier_hooks
from dkfac.layer_usage import LayerUsage
from dkfac.mixed_precision import loss_scale
from dkfac.pending_statistics import PendingStatistics, Refusals
from dkfac.statistics_fraction import StatisticsFraction
from dkfac.strategies import Strategy


class StatisticsCapture:
    """Hooks on the model and its layers that collect statistics while :attr:`capturing`.

    Args:
        model: the unwrapped model (its forward delimits a pass).
        layers: the preconditioned layers.
        strategy: decides which layers this worker captures, and hears of every statistic.
        recorder: times the statistics as ``factor_compute``.
        usage: told of every forward call, captured here or not.
        loss_reduction: ``"mean"`` or ``"sum"``, passed on to the strategy.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale is divided out of ``G``, or None.
        capturing: whether the first window captures.
        statistics_fraction: the share of each call's examples (its first, along dim 0) whose
            statistics are taken (:func:`~dkfac.curvature.statistics.kept_examples`).
        compiled: the model runs under ``torch.compile``: make the buffers of
            :class:`~dkfac.deferred_statistics.DeferredStatistics` now.
        batched: hold eager inputs and output gradients and form their statistics together
            (:mod:`dkfac.pending_statistics`; ``batched_statistics``).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[LayerCurvature],
        strategy: Strategy,
        recorder: StepRecorder,
        usage: LayerUsage,
        *,
        loss_reduction: str,
        grad_scaler: Any | None,
        capturing: bool,
        statistics_fraction: float = 1.0,
        compiled: bool = False,
        batched: bool = False,
    ) -> None:
        # Eager inputs and output gradients held until their statistics are formed together
        # (batched_statistics).
        self._pending = PendingStatistics() if batched else None
        self.refusals = Refusals() if self._pending is None else self._pending.refusals
        self._fraction = StatisticsFraction(statistics_fraction)
        self._model = model
        self._layers = list(layers)
        self._strategy = strategy
        self._recorder = recorder
        self._usage = usage
        self._loss_reduction = loss_reduction
        self._grad_scaler = grad_scaler
        self._removed = False
        self._compiled = compiled
        self._window_scale: float | None = None
        # Forward passes of the model in this window ("number": a layer's examples count once
        # per pass; calls outside the model's forward are passes of their own) and the model's
        # forward nesting ("depth"). A dict: TorchDynamo (2.13) drops attribute stores traced
        # after a hook is registered on a graph tensor (compiled hooks do), dict stores it keeps;
        # "calls" numbers the layers' calls with an output-gradient hook (never reset).
        self._pass = {"number": 0, "depth": 0, "calls": 0}
        self._batch: dict[str, int | None] = {"examples": None}  # the pass's (a dict: as above)
        # (backward id, pass) of the backward pass whose checkpointed segments are recomputed.
        self._recomputing: tuple[int, int] | None = None
        # Statistics of compiled forward passes, added to the layers at the window's step().
        self._deferred = DeferredStatistics(self._layers)
        captured = [index for index, layer in enumerate(self._layers) if strategy.captures(layer)]
        if compiled:
            self._deferred.prepare(captured)
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._pass_starts, with_kwargs=True),
            model.register_forward_hook(self._pass_ends, always_call=True),
        ]
        # First among a layer's forward hooks, so G is the gradient of the layer's own output
        # whatever later hooks make of it, and, compiling with the identity function in its
        # place (torch < 2.13), later hooks keep the replacement. Except there: TorchDynamo
        # 2.11 then fails on its own guards for the hooks ("'function' object has no
        # attribute 'args'"), so dkfac's hook goes last and earlier hooks are named instead.
        first = not (compiled and self._deferred.output_function)
        if not first:
            named = [(self._layers[i].name, self._layers[i].block.module) for i in captured]
            warn_about_earlier_hooks(named, type(self), stacklevel=4)
        modules = [layer.block.module for layer in self._layers]
        self._layer_hooks = LayerHooks(modules, self._forward_hook, first)
        self._capturing = False
        self.capturing = capturing
        if compiled:
            self._layer_hooks.attach()

    @property
    def capturing(self) -> bool:
        """Whether the hooks collect statistics (the current window is a factor window)."""
        return self._capturing

    @capturing.setter
    def capturing(self, capturing: bool) -> None:
        self._capturing = capturing
        # Outside factor windows an eager model's layers carry no hook (dkfac.layer_hooks).
        if self._compiled or self._removed:
            return
        if capturing:
            self._layer_hooks.attach()
        else:
            self._layer_hooks.detach()

    @contextmanager
    def resumed_after(self) -> Iterator[None]:
        """Whatever the enclosed block sets, :attr:`capturing` is as before when it exits."""
        capturing = self.capturing
        try:
            yield
        finally:
            self.capturing = capturing

    def fold_deferred(self) -> None:
        """Add what compiled forward passes, or held eager inputs, gave this window.

        Raises:
            HeldTensorChangedError: a held tensor was changed in place (left out; raised once).
        """
        self._form_pending()
        self.refusals.raise_unraised()

        def heard(layer: LayerCurvature, side: str) -> None:
            self._strategy.statistic_added(layer, side, self._loss_reduction)

        self._deferred.fold(self._loss_scale, heard)

    def discard_window(self) -> None:
        """Forget what compiled passes captured in this window (a state was restored)."""
        self._deferred.discard()
        if self._pending is not None:
            self._pending.discard()
        self.end_window()

    def end_window(self) -> None:
        """The factor window ended: the loss scale is read again, passes count from 1 again.

        Pass numbers only tell the passes of one window apart; starting each window from the
        same number keeps what compiled hooks see the same from window to window.
        """
        self._window_scale = None
        self._pass["number"] = 0
        self._recomputing = None

    def remove(self) -> None:
        """Detach every hook; hooks still referenced elsewhere do nothing from now on."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._layer_hooks.detach()
        self._removed = True
        self._usage.gradients.forget()
        if self._pending is not None:
            self._pending.discard()
        self._deferred.release()

    def __deepcopy__(self, memo: dict[int, Any]) -> StatisticsCapture:
        """The same object: a deep-copied model's hooks (EMA, snapshots) are inert.

        The hooks hold this object (a process group, which cannot be copied) and a layer
        index; called with a module of the copy, :meth:`_forward_hook` returns.
        """
        return self

    # -- passes -------------------------------------------------------------------------------
    def _pass_starts(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module is self._model:  # not a deep copy's
            if self._pass["depth"] == 0:
                self._form_pending()  # the previous pass's inputs, before this one's are made
                self.refusals.raise_unraised()  # from this pass's or the last one's hooks
            if self._pass["depth"] == 0 and self.capturing:
                self._pass["number"] += 1
                rows = batch_rows(args, kwargs)
                self._batch["examples"] = rows  # the batch's examples (None: not known)
                self._usage.pass_started(self._pass["number"], rows)
            self._pass["depth"] += 1

    def _pass_ends(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if module is self._model and self._pass["depth"] > 0:
            self._pass["depth"] -= 1
            # Its backward call tells micro-batches apart (dkfac.window_passes), not traced.
            if self._pass["depth"] == 0 and self.capturing and module.training:
                self._usage.pass_ended(self._pass["number"], output)

    def _current_pass(self) -> int:
        """The model's forward pass in progress; outside one, a new pass for this call.

        A forward run inside a backward pass is checkpointing recomputing a segment: every such
        call of one backward is one pass, the one it differentiates (reentrant: the segment's
        only capture; a pass per call would count a layer's examples once per segment).
        """
        if self._pass["depth"] > 0:
            return self._pass["number"]
        backward = current_backward_id()
        if backward is not None:
            if self._recomputing is None or self._recomputing[0] != backward:
                self._pass["number"] += 1
                self._recomputing = (backward, self._pass["number"])
                self._usage.backward_reached(self._pass["number"], backward, computing=False)
            return self._recomputing[1]
        self._pass["number"] += 1
        return self._pass["number"]

    # -- statistics ---------------------------------------------------------------------------
    def _forward_hook(
        self, index: int, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> Tensor | None:
        # Returns the output to use instead (DeferredStatistics.watch_g, torch < 2.13) or None.
        # The hook holds the layer's index, not the layer: a deep copy of the model then
        # copies no K-FAC state, and its hooks (module is the copy) do nothing.
        layer = self._layers[index]
        if self._removed or not self.capturing or module is not layer.block.module:
            return None
        # Recorded in a capture window on every worker, whether it captures this layer or not,
        # so all workers agree on which layers are used outside their forward and which are
        # broadcast (LayerUsage.find_silent).
        # The layer's own parameters all frozen (a GAN's critic in the generator's step): the
        # call gets no gradient, it is no training (substituted ones, torch.func: not known),
        # and its pass's outputs are told so.
        own = module._parameters.get("weight") is layer.block.weight
        training = module.training and torch.is_grad_enabled()
        if training and own and not layer.block.requires_grad:
            training = False
            if self._pass["depth"] > 0:
                self._usage.accumulators_found(self._pass["number"], [])
        x = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        pass_id = self._current_pass() if training and x is not None else None
        rows = int(x.shape[0]) if x is not None and x.dim() > 0 else 1
        self._usage.forward_ran(layer, training=training, pass_id=pass_id, rows=rows)
        # Decided on every worker, before it learns whether it captures this layer: a refusal
        # raised on the owner alone (DP-KFAC) would leave the others waiting in a collective.
        examples, kept = 1, 1
        if (
            self._fraction.fraction < 1
            and pass_id is not None
            and x is not None
            and isinstance(output, Tensor)
        ):
            examples, kept = self._fraction.of_call(layer, x, output, self._batch["examples"])
        # The accumulators a loss's backward call runs for this call (not a penalty's), found
        # on every worker alike: its pass's outputs answer from all of its layer calls.
        accumulators = None
        searched = isinstance(output, Tensor) and output.requires_grad
        if pass_id is not None and searched and not torch.compiler.is_compiling():
            stop = x.grad_fn if x is not None else None  # not the input's own graph
            accumulators = accumulators_below(output, layer.block.parameters(), stop)
            self._usage.accumulators_found(pass_id, accumulators)
        if (
            pass_id is None
            or x is None
            or not isinstance(output, Tensor)
            or self._usage.is_broadcast(layer.name)  # no exact factor: passed through
        ):
            return None
        # Held only in the forward pass: a call recomputed in the backward pass (checkpointing)
        # is formed at once, a compiled one by DeferredStatistics.
        pending = self._pending
        if pending is not None and (
            torch.compiler.is_compiling() or current_backward_id() is not None
        ):
            pending = None
        captured = self._strategy.captures(layer)
        if not captured:  # watched, so every worker refuses an in-place change and forms at
            # the same hooks as the others (the first gradient hook): a recomputed call's
            # output gradient too, which the owner holds (its input it forms at once).
            if self._pending is None or torch.compiler.is_compiling():
                return None
            if pending is not None:
                self._hold(pending, layer, "a", x, pass_id, examples, kept, captured=False)
        elif torch.compiler.is_compiling():
            # Traced into the model's graph: tensor work only, the bookkeeping at step().
            if not self._deferred.prepared:
                raise RuntimeError(
                    "K-FAC's hooks are being compiled, but the preconditioner was built for an "
                    "eager model: build it from the compiled model (torch.compile(model) or "
                    "model.compile() first)"
                )
            self._deferred.add_a(index, pass_id, x)
            if output.requires_grad:
                return self._deferred.watch_g(index, pass_id, output)
            return None
        elif pending is None or not self._hold(pending, layer, "a", x, pass_id, examples, kept):
            with self._recorder.phase("factor_compute"):
                if kept == examples or not layer.block.a_from_part:
                    layer.accumulate_a(x, pass_id)
                else:
                    part, weight = whole_call_estimate(layer.a_statistic(x[:kept]), examples, kept)
                    layer.add_statistic("a", part, pass_id, None, weight)
            self._strategy.statistic_added(layer, "a", self._loss_reduction)
        if output.requires_grad:
            # The pass is bound now: the backward of several passes may come later at once.
            self._pass["calls"] += 1
            call = (pass_id, self._pass["calls"])
            hook = functools.partial(
                self._output_grad_hook, layer, call, examples, kept, captured, accumulators
            )
            output.register_hook(hook)  # type: ignore[no-untyped-call]
        return None

    def _hold(
        self,
        pending: PendingStatistics,
        layer: LayerCurvature,
        side: str,
        tensor: Tensor,
        pass_id: int,
        examples: int,
        kept: int,
        captured: bool = True,
        grad_scale: float | None = None,
    ) -> bool:
        """:meth:`PendingStatistics.hold`; past the byte budget, everything held is formed."""
        held = pending.hold(layer, side, tensor, pass_id, examples, kept, captured, grad_scale)
        if held and pending.over_budget():
            self._form_pending()
        return held

    def _form_pending(self, side: str | None = None) -> None:
        """Form the held statistics (of ``side``; :mod:`dkfac.pending_statistics`), announced."""
        if self._pending:
            with self._recorder.phase("factor_compute"):
                formed = self._pending.form(side)
            for layer, formed_side in formed:
                self._strategy.statistic_added(layer, formed_side, self._loss_reduction)

    def _output_grad_hook(
        self,
        layer: LayerCurvature,
        pass_and_call: tuple[int, int],
        examples: int,
        kept: int,
        captured: bool,
        accumulators: list[Node] | None,
        grad: Tensor,
    ) -> None:
        # captured=False: another worker's layer, watched (batched_statistics alone).
        if self._removed:
            return
        pass_id, call = pass_and_call
        computed = self._usage.gradients.computed(layer.name, accumulators)
        self._usage.backward_reached(pass_id, computing=computed)
        pending = self._pending
        if pending is not None and pending.holds("a"):  # a backward call began: the inputs
            self._form_pending("a")  # are complete (formed before the caller may change them)
        if not computed:  # a gradient penalty's vector-Jacobian products: no loss gradients
            return
        self._usage.g_taken(layer.name, call)
        if pending is not None:
            scale = self._loss_scale() if captured else None
            held = self._hold(pending, layer, "g", grad, pass_id, examples, kept, captured, scale)
            if held or not captured:
                return
        with self._recorder.phase("factor_compute"):
            if kept == examples:
                layer.accumulate_g(grad, pass_id, self._loss_scale())
            else:
                part, weight = whole_call_estimate(layer.g_statistic(grad[:kept]), examples, kept)
                layer.add_statistic("g", part, pass_id, self._loss_scale(), weight)
        self._strategy.statistic_added(layer, "g", self._loss_reduction)

    def _loss_scale(self) -> float | None:
        """The GradScaler's loss scale, read once per capture window (public ``get_scale()``).

        It changes only in ``scaler.update()``, after the optimizer step: read once, it leaves
        the backward hooks free of host synchronisations after the window's first.
        """
        if self._window_scale is None:
            self._window_scale = loss_scale(self._grad_scaler)
        return self._window_scale
