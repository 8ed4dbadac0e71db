"""The public K-FAC preconditioner: hooks, schedule, KL clipping; work delegated to a strategy."""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dkfac.comm import ClusterCostModel, CostModelCache, StepRecorder
from dkfac.config import Hyperparameter, IntHyperparameter, KFACConfig
from dkfac.curvature.blocks import UnsupportedLayerError, make_block
from dkfac.curvature.layer import LayerCurvature, LayerHealth
from dkfac.layer_table import SkippedModule, format_layer_table
from dkfac.strategies import StrategyOptions, make_strategy

logger = logging.getLogger(__name__)

STATE_VERSION = 1


def current_backward_id() -> int | None:
    """An id of the backward pass the autograd engine is running on this thread, else None.

    PyTorch exposes no public "inside backward" query; the engine's graph-task id is what
    ``torch.utils.checkpoint`` itself uses. Without it (an older build) nothing is recomputed
    as far as dkfac can tell, and each recomputed call counts as a pass of its own.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        return None
    current = int(task_id())
    return None if current == -1 else current


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP/DataParallel wrapper (so names carry no ``module.`` prefix)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


@dataclass(frozen=True)
class Health:
    """What went wrong numerically, as :meth:`KFACPreconditioner.health` reports it.

    Attributes:
        skipped_steps: factor-update steps whose gradients were not finite (a GradScaler
            skipped them): no factor or decomposition was changed.
        layers: per preconditioned layer, the counts of :class:`LayerHealth` on this worker.
    """

    skipped_steps: int
    layers: dict[str, LayerHealth]


class KFACPreconditioner:
    """K-FAC preconditioning as one call between ``loss.backward()`` and ``optimizer.step()``.

    Example::

        pre = dkfac.KFACPreconditioner(model, lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()          # replaces .grad of Linear/Conv2d layers by the K-FAC direction
            optimizer.step()

    Args:
        model: the model (plain or wrapped by DDP). ``nn.Linear`` and ``nn.Conv2d`` layers are
            preconditioned; other modules with parameters keep their gradients and are listed
            as skipped in ``repr(pre)``.
        strategy: how work is placed on workers: a name from
            :data:`dkfac.strategies.STRATEGIES` (``"local"`` runs everything here) or its
            options object (``dkfac.strategies.KAISAOptions(grad_worker_fraction=0.5)``).
            ``grad_worker_fraction``, ``profile_steps`` and ``cost_model`` below are shorthands
            for those options; one set for a strategy that does not read it is an error.
        inverse_method: ``"eigen"`` (exact ``(A⊗G + γI)⁻¹``) or ``"inverse"`` (π-damped
            factored Tikhonov through Cholesky).
        damping: γ > 0 (finite).
        factor_decay: running-average decay ε in [0, 1): ``F ← ε·F + (1−ε)·F_batch``.
        kl_clip: κ > 0 (finite) of KL clipping, or ``None`` to disable it.
        lr: learning rate of the optimizer, used by KL clipping. Pass a callable when it
            changes (e.g. ``lambda step: scheduler.get_last_lr()[0]``).
        factor_update_steps: steps between factor updates.
        inv_update_steps: steps between decompositions; a multiple of ``factor_update_steps``.
        accumulation_steps: backward passes per ``step()`` (gradient accumulation). Statistics
            of all micro-batches are pooled, so the result equals one large batch provided the
            loss of each micro-batch is divided by ``accumulation_steps`` as usual.
        skip_layers: regular expressions; a layer whose qualified name or class name matches
            one (``re.search``) is not preconditioned.
        loss_reduction: ``"mean"`` when the loss averages over the examples of the batch
            (window), ``"sum"`` when it sums them. Examples are indexed by dim 0 of the input.
        grad_scaler: a ``torch.amp.GradScaler``; output gradients are unscaled before they
            enter ``G``. Call ``scaler.unscale_(optimizer)`` before ``pre.step()``. A step whose
            gradients are not finite (the scaler skips it) changes no factor or decomposition.
        factor_dtype: dtype of the statistics and running factors (also for fp16/bf16 models).
        inv_dtype: dtype of the decompositions (float32 or float64). A failed decomposition is
            retried in float64.
        grad_worker_fraction: KAISA's fraction ``f`` of workers that precondition each layer
            (``strategy="kaisa"``); ``f·P`` must divide the world size ``P``.
        bucket_cap_mb: largest fused collective in MiB (0: one collective per tensor).
        comm_dtype: transport dtype of collectives (e.g. ``torch.bfloat16``); ``None`` sends
            tensors in their own dtype.
        profile_steps: ``"spd"``/``"pad"``: factor-update windows whose measured factor ready
            times re-plan the fusion buckets (alpha-beta merge rule); 0 keeps the size plan.
        cost_model: ``"spd"``/``"pad"``: a :class:`~dkfac.comm.ClusterCostModel` to plan
            with, or a :class:`~dkfac.comm.CostModelCache` that measures on first use
            and then reuses (for several preconditioners in one job); ``None`` measures the
            process group and the decompositions at construction (about a second, collective:
            every rank builds its preconditioner together).
        check_replicas_every: every this many decomposition steps, compare the exact bits of
            every decomposition across the workers that hold it (one all-gather of two int64
            per layer) and raise a ``RuntimeError`` naming the layer and ranks on divergence:
            workers that decompose a factor independently (SPD-KFAC) must agree bitwise or the
            model replicas drift apart. 0 (default) never checks.

    Damping, factor_decay, kl_clip, lr and both update intervals accept a number or a callable
    of the K-FAC step (the number of completed ``step()`` calls). A callable's value is checked
    like a constant when :meth:`step` evaluates it (``inv_update_steps(k)`` must be a multiple of
    ``factor_update_steps(k)``); a bad value raises ``ValueError`` before anything changes.

    Raises:
        ValueError: an argument is not allowed (the message names it, its value and what is
            allowed).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        strategy: str | StrategyOptions = "local",
        inverse_method: str = "eigen",
        damping: Hyperparameter = 0.003,
        factor_decay: Hyperparameter = 0.95,
        kl_clip: Hyperparameter | None = 0.001,
        lr: Hyperparameter = 0.1,
        factor_update_steps: IntHyperparameter = 1,
        inv_update_steps: IntHyperparameter = 1,
        accumulation_steps: int = 1,
        skip_layers: Sequence[str] = (),
        loss_reduction: str = "mean",
        grad_scaler: Any | None = None,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        grad_worker_fraction: float = 1.0,
        bucket_cap_mb: float = 25.0,
        comm_dtype: torch.dtype | None = None,
        profile_steps: int = 5,
        cost_model: ClusterCostModel | CostModelCache | None = None,
        check_replicas_every: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model={type(model).__name__} is not allowed: expected a torch.nn.Module"
            )
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise ValueError(
                f"grad_scaler={grad_scaler!r} is not allowed: expected a "
                "torch.amp.GradScaler or None"
            )
        self.config = KFACConfig(
            strategy=strategy,
            inverse_method=inverse_method,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            accumulation_steps=accumulation_steps,
            skip_layers=skip_layers,
            loss_reduction=loss_reduction,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            grad_worker_fraction=grad_worker_fraction,
            bucket_cap_mb=bucket_cap_mb,
            comm_dtype=comm_dtype,
            profile_steps=profile_steps,
            cost_model=cost_model,
            check_replicas_every=check_replicas_every,
        )
        self._recorder = StepRecorder()
        self._strategy = make_strategy(
            self.config.options,
            self._recorder,
            bucket_cap_mb=bucket_cap_mb,
            comm_dtype=comm_dtype,
            inverse_method=inverse_method,
            inv_dtype=inv_dtype,
        )
        self._model = _unwrap(model)
        self._grad_scaler = grad_scaler
        discovered, self._skipped = self._discover_layers()
        self._paths = [path for path, _ in discovered]
        self._layers = [layer for _, layer in discovered]
        self._strategy.setup(self._layers, accumulation_steps=accumulation_steps)
        self._steps = 0
        self._removed = False
        self._warned: set[str] = set()
        # Layers whose forward hook ran in the current capture window (whether or not this
        # worker captures them), and layers found used outside their forward: these have a
        # gradient but never statistics, and pass it through unpreconditioned.
        self._forwarded: set[str] = set()
        # Whether any layer ran forward in training mode with gradients on since the last
        # factor update, captured here or not (under DP-KFAC this worker's own layers may all
        # sit out a window that other layers trained in).
        self._trained_forward = False
        self._silent: set[str] = set()
        # Layers whose forward ran on some worker at least once: never silent again, so once
        # every layer is known, finding silent layers costs no communication.
        self._seen_forward: set[str] = set()
        self._capture = self._is_factor_step(0)
        self._force_inverse = False
        self._window_scale: float | None = None
        self._skipped_steps = 0
        self._decomposition_steps = 0
        # Forward passes of the model: a layer's examples count once per pass (a shared layer
        # runs several times in one). Calls made outside the model's forward are passes of
        # their own.
        self._passes = 0
        self._pass_depth = 0
        # (backward id, pass) of the backward pass whose checkpointed segments are recomputed.
        self._recomputing: tuple[int, int] | None = None
        self._handles: list[RemovableHandle] = [
            self._model.register_forward_pre_hook(self._pass_starts),
            self._model.register_forward_hook(self._pass_ends, always_call=True),
        ]
        self._handles += [
            layer.block.module.register_forward_hook(functools.partial(self._forward_hook, index))
            for index, layer in enumerate(self._layers)
        ]

    # -- construction -----------------------------------------------------------------------
    def _discover_layers(self) -> tuple[list[tuple[str, LayerCurvature]], list[SkippedModule]]:
        """Every module with parameters: a (path, curvature) pair, or a skipped entry."""
        layers: list[tuple[str, LayerCurvature]] = []
        skipped: list[SkippedModule] = []
        holders = self._parameter_holders()
        for name, module in self._model.named_modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            kind = type(module).__name__
            if any(p.search(name) or p.search(kind) for p in self.config.skip_patterns):
                skipped.append(SkippedModule(name, kind, "matches skip_layers"))
                continue
            try:
                block = make_block(module)
            except UnsupportedLayerError as error:
                raise ValueError(f"layer {name!r} ({kind}): {error}") from None
            if block is None:
                skipped.append(SkippedModule(name, kind, "unsupported type"))
            elif not all(p.requires_grad for p in block.parameters()):
                skipped.append(SkippedModule(name, kind, "parameters do not require grad"))
            elif others := sorted(
                {other for p in params for other in holders[id(p)] if other != name}
            ):
                # A tied parameter's gradient sums its uses in every holder (GPT-2's LM head
                # and token embedding): this layer's factors describe only its own use.
                shared = ", ".join(repr(other) for other in others)
                skipped.append(SkippedModule(name, kind, f"parameter shared with {shared}"))
            else:
                curvature = LayerCurvature(name or kind, block, self.config.factor_dtype)
                layers.append((name, curvature))
        if not layers:
            found = ", ".join(sorted({s.kind for s in skipped})) or "no module with parameters"
            raise ValueError(
                f"model={type(self._model).__name__} is not allowed: it has no "
                f"layer K-FAC can precondition (nn.Linear, nn.Conv2d); found: {found}"
            )
        return layers, skipped

    def _parameter_holders(self) -> dict[int, list[str]]:
        """Per parameter (by id), the names of the modules that register it directly."""
        holders: dict[int, list[str]] = {}
        for name, module in self._model.named_modules():
            for param in module.parameters(recurse=False):
                holders.setdefault(id(param), []).append(name)
        return holders

    # -- hooks --------------------------------------------------------------------------------
    def _pass_starts(self, module: nn.Module, inputs: Any) -> None:
        if module is self._model:  # not a deep copy's
            if self._pass_depth == 0:
                self._passes += 1
            self._pass_depth += 1

    def _pass_ends(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if module is self._model and self._pass_depth > 0:
            self._pass_depth -= 1

    def _current_pass(self) -> int:
        """The model's forward pass in progress; outside one, a new pass for this call.

        A forward run inside a backward pass is activation checkpointing recomputing a segment
        (``torch.utils.checkpoint``): every such call of one backward belongs to one pass, the
        forward pass that backward differentiates. Under reentrant checkpointing that is the
        only capture of the segment (its first forward ran without gradients); counted a pass
        per call, a layer used in several segments would count its examples once per use.
        """
        if self._pass_depth > 0:
            return self._passes
        backward = current_backward_id()
        if backward is not None:
            if self._recomputing is None or self._recomputing[0] != backward:
                self._passes += 1
                self._recomputing = (backward, self._passes)
            return self._recomputing[1]
        self._passes += 1
        return self._passes

    def _forward_hook(
        self, index: int, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        # The hook holds the layer's index, not the layer: a deep copy of the model then
        # copies no K-FAC state, and its hooks (module is the copy) do nothing.
        layer = self._layers[index]
        if self._removed or not self._capture or module is not layer.block.module:
            return
        # Recorded on every worker, capturing or not, so all workers agree on which layers are
        # used outside their forward (see _find_silent).
        self._forwarded.add(layer.name)
        if not module.training or not torch.is_grad_enabled():
            return
        self._trained_forward = True
        if (
            not self._strategy.captures(layer)
            or not inputs
            or not isinstance(inputs[0], Tensor)
            or not isinstance(output, Tensor)
        ):
            return
        pass_id = self._current_pass()
        with self._recorder.phase("factor_compute"):
            layer.accumulate_a(inputs[0], pass_id)
        self._strategy.statistic_added(layer, "a", self.config.loss_reduction)
        if output.requires_grad:
            # The pass is bound now: the backward of several passes may come later at once.
            hook = functools.partial(self._output_grad_hook, layer, pass_id)
            output.register_hook(hook)  # type: ignore[no-untyped-call]

    def _output_grad_hook(self, layer: LayerCurvature, pass_id: int, grad: Tensor) -> None:
        if not self._removed:
            with self._recorder.phase("factor_compute"):
                layer.accumulate_g(grad, pass_id, self._loss_scale())
            self._strategy.statistic_added(layer, "g", self.config.loss_reduction)

    def _loss_scale(self) -> float | None:
        """The GradScaler's loss scale, read once per capture window (public ``get_scale()``).

        The scale only changes in ``scaler.update()``, after the optimizer step, so it is the
        same for every backward pass of a window; reading it once keeps the backward hooks
        free of host synchronisations after the first one of the window.
        """
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        if self._window_scale is None:
            self._window_scale = float(scaler.get_scale())
        return self._window_scale

    def _gradients_finite(self) -> bool:
        """Whether every gradient of the model is finite (checked only with a GradScaler).

        A GradScaler skips the optimizer step when a gradient is not finite; such a step must
        not change factors or decompositions either. One host read per factor-update step,
        only when a scaler is enabled. Gradients are read after averaging (DDP, DeAR), so
        every worker decides alike.
        """
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return True
        flags = [
            torch.isfinite(p.grad).all() for p in self._model.parameters() if p.grad is not None
        ]
        if not flags:
            return True
        return bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all())

    # -- schedule -----------------------------------------------------------------------------
    def _is_factor_step(self, step: int) -> bool:
        return step % self.config.factor_update_steps_at(step) == 0

    def _schedule(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` updates factors and decompositions; both intervals validated.

        Raises:
            ValueError: a callable interval returned a value that is not allowed at ``step``
                (not an integer >= 1, or ``inv_update_steps`` not a multiple of
                ``factor_update_steps``).
        """
        factor_steps, inv_steps = self.config.intervals_at(step)
        return step % factor_steps == 0, step % inv_steps == 0

    @property
    def steps(self) -> int:
        """Number of completed ``step()`` calls."""
        return self._steps

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> None:
        """Replace the gradients of the preconditioned layers by the K-FAC direction.

        Call after ``loss.backward()`` (and ``scaler.unscale_(optimizer)`` with AMP), before
        ``optimizer.step()``.

        A layer found used outside its own ``forward()`` (its parent calls ``F.linear`` on its
        weight, like ``nn.MultiheadAttention`` does with ``out_proj``) has a gradient but no
        statistics: it is reported once and its gradient is left exactly as it is, like a
        layer in ``skip_layers`` (not preconditioned, not KL-clipped, not part of ``ν``).

        Raises:
            RuntimeError: called before any backward pass, after :meth:`remove`, or the model
                changed since the preconditioner was built.
            ValueError: a callable hyperparameter returned a value that is not allowed.
        """
        if self._removed:
            raise RuntimeError(
                "step() after remove(): this preconditioner has detached its "
                "hooks; build a new KFACPreconditioner"
            )
        self._check_model()
        # K-FAC's own arithmetic keeps its dtypes if step() is called inside torch.autocast.
        with torch.autocast(self._layers[0].block.weight.device.type, enabled=False):
            self._step()

    def _step(self) -> None:
        active = [layer for layer in self._layers if layer.block.has_grad()]
        if not active:
            raise RuntimeError(
                "step() found no gradients: call loss.backward() before "
                "pre.step() (and optimizer.zero_grad(set_to_none=True) only "
                "before the backward pass)"
            )
        k, config = self._steps, self.config
        # Every interval this step needs (including whether the next step captures) is
        # evaluated and validated before anything changes.
        factor_step, inverse_step = self._schedule(k)
        capture_next = self._is_factor_step(k + 1)
        skipped = False
        if factor_step:
            self._check_statistics()
            skipped = not self._gradients_finite()
            if skipped:  # the GradScaler skips this step: no factor, no decomposition from it
                self._skipped_steps += 1
                self._force_inverse = self._force_inverse or inverse_step
            self._strategy.update_factors(
                self._layers, config.factor_decay_at(k), config.loss_reduction, fold=not skipped
            )
            self._window_scale = None
            # After the factor update: SPD/PAD may still hold back factor collectives launched
            # from hooks on ranks that skipped a layer; update_factors issues them all, so the
            # usage agreement below comes after them in the same order on every rank.
            self._find_silent(active)
        if not skipped and (inverse_step or self._force_inverse):
            self._force_inverse = False
            self._strategy.update_inverses(
                self._layers, config.damping_at(k), config.inverse_method, config.inv_dtype
            )
            self._decomposition_steps += 1
            every = config.check_replicas_every
            if every and self._decomposition_steps % every == 0:
                self._strategy.check_replicas(self._layers)
        active = [layer for layer in active if layer.name not in self._silent]
        if active:
            grads = [layer.block.grad_matrix() for layer in active]
            directions = self._strategy.precondition(active, grads, config.damping_at(k))
            scale = self._kl_scale(directions, grads, k)
            for layer, direction in zip(active, directions, strict=True):
                layer.block.set_grad(direction if scale is None else direction * scale)
        self._recorder.finish_step(self._steps)
        self._steps += 1
        self._capture = capture_next

    def _kl_scale(
        self, directions: Sequence[Tensor], grads: Sequence[Tensor], step: int
    ) -> Tensor | None:
        """ν = min(1, sqrt(κ / (η² Σ⟨V, ∇⟩))) as a device scalar: no host synchronisation."""
        kl_clip = self.config.kl_clip_at
        if kl_clip is None:
            return None
        device = grads[0].device
        terms = [
            (v * g).sum(dtype=torch.float64).to(device)
            for v, g in zip(directions, grads, strict=True)
        ]
        lr = self.config.lr_at(step)
        vg = torch.stack(terms).sum() * (lr * lr)
        nu = torch.sqrt(kl_clip(step) / vg.clamp_min(0.0)).clamp(max=1.0)
        return nu.to(grads[0].dtype)

    def _check_model(self) -> None:
        for layer, path in zip(self._layers, self._paths, strict=True):
            block = layer.block
            try:
                current: nn.Module | None = self._model.get_submodule(path)
            except AttributeError:
                current = None
            if (
                current is not block.module
                or getattr(current, "weight", None) is not block.weight
                or tuple(block.weight.shape) != block.weight_shape
            ):
                raise RuntimeError(
                    f"the model changed after KFACPreconditioner was built: layer {layer.name!r} "
                    "was replaced or resized. Build the preconditioner after the model is final "
                    "(call pre.remove() and create a new one)"
                )

    def _check_statistics(self) -> None:
        trained, self._trained_forward = self._trained_forward, False
        captured = [layer for layer in self._layers if self._strategy.captures(layer)]
        if not captured:  # DP-KFAC: this worker owns no layer, it has nothing to check
            return
        # A layer may sit out some passes (a branch): the window had as many as any layer saw.
        calls = [layer.backward_passes for layer in captured if layer.has_statistics]
        if not calls and trained:  # other layers trained; this worker's own sat this one out
            return
        if not calls:
            self._warn_once(
                "no-statistics",
                (
                    "K-FAC captured no factor statistics before this step: forward passes run in "
                    "model.eval() mode or under torch.no_grad() are ignored; factors not updated"
                ),
            )
            return
        if max(calls) != self.config.accumulation_steps:
            self._warn_once(
                "accumulation",
                (
                    f"K-FAC saw {max(calls)} backward pass(es) before step() but "
                    f"accumulation_steps={self.config.accumulation_steps}; statistics are pooled "
                    "over all of them"
                ),
            )

    def _find_silent(self, active: Sequence[LayerCurvature]) -> None:
        """Mark the layers that have a gradient but whose forward ran on no worker this window.

        Such a layer's weight is used by its parent outside the layer's ``forward()``, so no
        statistics can exist for it; it passes its gradient through until a later factor
        window sees its forward. The decision is the same on every worker: whether a layer's
        forward ran is OR-ed over the workers (one small collective, only while some layer's
        forward has never run anywhere), so a layer that only some ranks use in a step is
        preconditioned everywhere. When no hook ran on any worker (no forward since the last
        factor update), nothing is decided.
        """
        unknown = [layer for layer in self._layers if layer.name not in self._seen_forward]
        local = [bool(self._forwarded)] + [layer.name in self._forwarded for layer in unknown]
        self._forwarded.clear()
        if not unknown:
            self._silent = set()
            return
        ran = self._strategy.any_worker(local, self._layers[0].block.weight.device)
        if not ran[0]:
            return
        self._seen_forward.update(
            layer.name for layer, r in zip(unknown, ran[1:], strict=True) if r
        )
        self._silent = {layer.name for layer in active if layer.name not in self._seen_forward}
        for layer in active:
            if layer.name not in self._silent:
                continue
            kind = type(layer.block.module).__name__
            pattern = f"^{re.escape(layer.name)}$"
            self._warn_once(
                f"silent:{layer.name}",
                (
                    f"K-FAC layer {layer.name!r} ({kind}) has a gradient but captured no factor "
                    "statistics: its forward() did not run, so its parent uses its weight outside "
                    "its forward (e.g. nn.MultiheadAttention calls F.linear on out_proj.weight). "
                    "Its gradient passes through unpreconditioned and unclipped; add it to "
                    f"skip_layers (e.g. skip_layers=[{pattern!r}]) to say so explicitly"
                ),
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def __deepcopy__(self, memo: dict[int, Any]) -> KFACPreconditioner:
        """The same preconditioner: a deep-copied model's hooks (EMA, snapshots) are inert.

        The hooks hold this object (and through it a process group, which cannot be copied)
        and a layer index; called with a module of the copy, :meth:`_forward_hook` returns.
        """
        return self

    # -- inspection -------------------------------------------------------------------------
    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer name: (A, G)}`` running factors held by this worker."""
        return {
            layer.name: (layer.a, layer.g)
            for layer in self._layers
            if layer.a is not None and layer.g is not None and self._strategy.holds_factors(layer)
        }

    def health(self) -> Health:
        """Numerical trouble so far, on this worker.

        Steps skipped for non-finite gradients, and per layer how often batch factors,
        running factors and decompositions failed (counted where the layer is decomposed).
        """
        return Health(
            skipped_steps=self._skipped_steps,
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

    def export_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace (JSON) of the recent steps, one lane per phase."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._recorder.export_trace(path, rank=rank)

    def plan(self) -> dict[str, Any]:
        """The strategy's placement as plain data.

        ``"factors"``: one entry per factor with its owner(s); ``"buckets"``: the fused
        collectives in launch order with predicted times (``"spd"``/``"pad"``), plus the cost
        model behind them. ``"local"`` has no placement (empty lists).
        """
        return self._strategy.plan()

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
            f"KFACPreconditioner(strategy={self.config.options.name!r}, "
            f"inverse_method={self.config.inverse_method!r}, steps={self._steps}, "
            f"layers={len(self._layers)}, skipped={len(self._skipped)})"
        )
        lines = format_layer_table(
            self._model,
            dict(zip(self._paths, self._layers, strict=True)),
            self._skipped,
            self._strategy.plan(),
            silent=self._silent,
        )
        return "\n".join([header, *lines])

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Steps, running factors and decompositions: enough to continue bitwise identically."""
        layers = {layer.name: layer.state() for layer in self._layers}
        return {
            "version": STATE_VERSION,
            "steps": self._steps,
            "inverse_method": self.config.inverse_method,
            "layers": layers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same model architecture).

        Raises:
            ValueError: the state does not match this preconditioner's layers.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                "state_dict is not a dkfac KFACPreconditioner state (version "
                f"{STATE_VERSION} expected)"
            )
        saved = state["layers"]
        names = {layer.name for layer in self._layers}
        if set(saved) != names:
            missing, unexpected = sorted(names - set(saved)), sorted(set(saved) - names)
            raise ValueError(
                f"state_dict layers do not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for layer in self._layers:  # validate everything before changing anything
            layer.check_state(saved[layer.name])
        for layer in self._layers:
            layer.load_state(saved[layer.name])
        self._steps = int(state["steps"])
        self._forwarded.clear()
        self._trained_forward = False
        self._capture = self._is_factor_step(self._steps)
        # A state with factors but no decomposition (e.g. saved on another world size, where
        # decompositions live on their owners) is decomposed at the next step, on every rank.
        self._force_inverse = any(
            layer.a is not None or layer.g is not None for layer in self._layers
        ) and all(layer.inverse is None for layer in self._layers)
        self._strategy.after_load(self._layers)

    def remove(self) -> None:
        """Detach every hook and release the strategy's process group, if it made one.

        The model is left exactly as it was before. Under ``torch.distributed`` every rank
        calls it (like building the preconditioner).
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self._removed:
            self._strategy.close()
        self._removed = True
        for layer in self._layers:
            layer.clear_statistics()
