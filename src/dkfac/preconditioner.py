"""The public K-FAC preconditioner: the schedule and the step; work delegated to a strategy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dkfac.adaptive import AdaptiveOptions, AdaptiveStep, ModelBatch
from dkfac.capture import StatisticsCapture
from dkfac.comm import ClusterCostModel, CostModelCache, StepRecorder
from dkfac.config import CONFIG_FIELDS, Hyperparameter, IntHyperparameter, KFACConfig
from dkfac.curvature.block_types import BlockFactory
from dkfac.layer_discovery import LayerWatch, discover_layers, is_compiled, unwrap_model
from dkfac.layer_usage import LayerUsage
from dkfac.mixed_precision import autocast_disabled, gradients_finite
from dkfac.optimizer_hook import OptimizerHook
from dkfac.plain_step import CudaGraphs, PlainStep
from dkfac.preconditioner_arguments import (
    check_blocks,
    refuse_compiled_subset,
    refuse_conflicting_arguments,
    refuse_step_call,
    refuse_unagreed_adaptive,
)
from dkfac.preconditioner_inspection import PreconditionerInspection
from dkfac.preconditioner_state import PreconditionerState
from dkfac.strategies import StrategyOptions
from dkfac.strategies.chooser import StrategyChooser
from dkfac.strategy_start import start_strategy
from dkfac.update_intervals import IntervalBudget, UpdateIntervals


class KFACPreconditioner(PreconditionerInspection, PreconditionerState):
    """K-FAC preconditioning as one call between ``loss.backward()`` and ``optimizer.step()``.

    Example::

        pre = dkfac.KFACPreconditioner(model, lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()          # replaces .grad of Linear/Conv2d layers by the K-FAC direction
            optimizer.step()

    or ``KFACPreconditioner(model, optimizer=optimizer)`` and ``optimizer.step()`` alone (a
    framework's loop: the optimizer's step runs K-FAC's first).

    Args:
        model: the model (plain or wrapped by DDP). ``nn.Linear``, ``nn.Conv2d``,
            ``nn.Conv1d`` and transformers' ``Conv1D`` are preconditioned; other modules with
            parameters keep their gradients and are listed as skipped in ``repr(pre)``.
        strategy: how work is placed on workers: a name from
            :data:`dkfac.strategies.STRATEGIES` (``"local"`` runs everything here) or its
            options object (``dkfac.strategies.KAISAOptions(grad_worker_fraction=0.5)``), or
            ``dkfac.AutoOptions(...)``: the strategy the simulator predicts fastest here.
            ``grad_worker_fraction``, ``profile_steps``, ``cost_model`` and ``share`` below are
            shorthands for those options (``None``: not given); one set for a strategy that
            does not read it, or next to an options object, is an error.
        inverse_method: ``"eigen"`` (exact ``(A⊗G + γI)⁻¹``), ``"inverse"`` (π-damped factored
            Tikhonov, Cholesky inverses) or ``"cholesky"`` (the same by triangular solves).
        damping: γ > 0 (finite).
        factor_decay: running-average decay ε in [0, 1): ``F ← ε·F + (1−ε)·F_batch``.
        kl_clip: κ > 0 (finite) of KL clipping, or ``None`` to disable it.
        lr: learning rate of the optimizer, used by KL clipping. Pass a callable when it
            changes (e.g. ``lambda step: scheduler.get_last_lr()[0]``). ``None``: the
            ``optimizer``'s, read at each step, or 0.1 without one.
        factor_update_steps: steps between factor updates.
        inv_update_steps: steps between decompositions; a multiple of ``factor_update_steps``.
            ``"auto"`` (or ``dkfac.IntervalBudget(share=...)``) for either (the factor
            interval only with the decomposition's): chosen once, early in the run, so each
            kind of update takes about 10% of a step's time (:mod:`dkfac.update_intervals`;
            ``pre.chosen_intervals``).
        accumulation_steps: backward passes per ``step()`` (gradient accumulation). Statistics
            of all micro-batches are pooled, so the result equals one large batch provided the
            loss of each micro-batch is divided by their number as usual. ``None`` (default):
            attached to an ``optimizer``, whatever number of passes runs between its steps
            (a Trainer's accumulation); else 1, and another number seen is warned about.
        skip_layers: regular expressions; a layer whose qualified name or class name matches
            one (``re.search``) is not preconditioned.
        loss_reduction: ``"mean"`` when the loss averages over the examples of the batch
            (window), ``"sum"`` when it sums them. Examples are indexed by dim 0 of the input.
        grad_scaler: a ``torch.amp.GradScaler``; output gradients are unscaled before they
            enter ``G``. Call ``scaler.unscale_(optimizer)`` before ``pre.step()``. A step whose
            gradients are not finite (the scaler skips it) changes no factor or decomposition.
        factor_dtype: dtype of the statistics and running factors (also for fp16/bf16 models).
        statistics_precision: ``"highest"`` (default): the statistics' products in
            ``factor_dtype``; ``"bf16"``: operands rounded to bfloat16, products summed in
            float32 (tensor cores; ``factor_dtype`` float32 only; README, "GPUs").
        conv_patches: a stride-1 convolution's ``A`` from ``"im2col"`` patches (``kh·kw`` times
            the input, or more), ``"shifted"`` products or ``"auto"`` (README, "GPUs").
        statistics_fraction: in (0, 1]: the factors are estimated from the first
            ``⌈f·N⌉`` examples of each call (dim 0) instead of all ``N`` (docs/math.md,
            "Statistics from part of the batch"); not with a compiled model.
        precondition_precision: ``"highest"`` (default) or ``"bf16"``: gradients
            preconditioned in bfloat16 (faster products; docs/math.md, "in bfloat16").
        inv_dtype: dtype of the decompositions, float32 or float64 (failures retried in float64).
        grad_worker_fraction: KAISA's fraction ``f`` of workers that precondition each layer
            (``strategy="kaisa"``, default 1); ``f·P`` must divide the world size ``P``.
        bucket_cap_mb: largest fused collective in MiB (0: one collective per tensor;
            ``None``: 25, or what ``strategy=AutoOptions(...)`` chooses).
        comm_dtype: transport dtype of collectives (e.g. ``torch.bfloat16``; ``None``: their own).
        profile_steps: ``"spd"``/``"pad"``: factor-update windows whose measured ready times
            re-plan the fusion buckets (alpha-beta merge rule; default 5, 0 keeps the size plan).
        cost_model: ``"spd"``/``"pad"``: a :class:`~dkfac.comm.ClusterCostModel` to plan with,
            or a :class:`~dkfac.comm.CostModelCache` (measures on first use, then reuses);
            ``None`` measures the process group and the decompositions at construction (about
            a second, collective: every rank builds its preconditioner together).
        share: ``"pad"``: what the owners broadcast: ``"decompositions"``, ``"gradients"``
            (preconditioned, every step) or ``"auto"`` (default: the fewer bytes per step at
            the first ``inv_update_steps``).
        check_replicas_every: every this many decomposition steps, compare the bits of each
            replicated decomposition across workers (one all-gather of two int64 per layer);
            a difference raises ``RuntimeError`` naming layers and ranks. 0 (default): never.
        adaptive: ``dkfac.AdaptiveOptions(loss_fn=...)``: each ``step(inputs, targets)`` moves
            the preconditioned layers' parameters itself, by the learning rate and momentum
            that minimise the quadratic model of the loss on the batch, and adapts the damping
            (Levenberg-Marquardt; ``damping`` is its initial value). Their ``.grad`` is cleared,
            so ``optimizer.step()`` moves only the other parameters; ``lr`` and ``kl_clip`` are
            not used (the step's scale is chosen). ``None`` (default): off.
        optimizer: attach to this optimizer: every ``optimizer.step()`` (also from
            ``GradScaler.step``, a Hugging Face ``Trainer``, Lightning) runs :meth:`step` first,
            through a step pre-hook, and ``pre.step()`` by hand is an error. :meth:`remove`
            detaches it. Not with ``adaptive`` (its step needs the batch). With a closure
            (``optimizer.step(closure)``, Lightning), K-FAC runs right after the closure.
        max_factor_dim: a layer with a factor side above this (a vocabulary-sized LM head) is
            skipped, with the reason in ``repr(pre)``, instead of allocating gigabytes
            (default 8192: 256 MiB per float32 factor); ``None``: no limit.
        batched_preconditioning: layers of equal shapes preconditioned by batched products
            (equal to one at a time up to round-off), and the KL clip's inner products
            formed in shared launches; ``None`` (default): on a GPU.
        batched_decompositions: factors of equal sizes decomposed by batched calls: True
            (every size), False, or the widest factors batched; ``None`` (default): the
            device's default, none for now (on an H200 faster on ResNet-32's factors, slower on
            ResNet-50's, as whole-model totals; docs/benchmarks.md).
        batched_factor_updates: equal-shaped factors folded into their running averages by
            stacked operations, a few per shape instead of a few per factor (the same
            result, bit for bit); ``None`` (default): on a GPU, where the host's launches
            were the cost of a factor step.
        batched_statistics: the hooks hold the layers' inputs and output gradients, and the
            statistics of equal-shaped layers are formed together: ``A`` when the backward
            pass begins, ``G`` when the next pass begins or at ``step()``
            (:mod:`dkfac.pending_statistics`; equal to one at a time up to round-off; a
            tensor changed in place before then is left out with an error, raised at the
            next pass or ``step()``, which goes on when repeated);
            ``None`` (default): on a GPU, unless the strategy sends factors from the hooks
            (SPD, PAD: forming them later would start their sends later).
        plain_step_graphs: a CUDA model's preconditioning, KL clip and scaling captured as a
            CUDA graph and replayed while the layers, their inverses and dtypes repeat
            (:mod:`dkfac.plain_step`; the same gradients bit for bit, a few host launches
            instead of dozens; steps whose preconditioning sends gradients run eagerly).
            Default False: on an H200 it cut ResNet-32's step from 16.6 to 14.7 ms (SGD's
            11.9) and left ResNet-50's at 67.6; the graph holds a copy of every gradient and
            direction, which a large model may not spare.
        blocks: curvature blocks for more layer types, ``{ModuleType: factory}``; the factory
            gets the module and returns a :class:`dkfac.curvature.KroneckerBlock` (looked up
            along the module's class hierarchy, before the built-in blocks).

    Damping, factor_decay, kl_clip, lr and both update intervals accept a number or a callable
    of the K-FAC step (completed ``step()`` calls), checked like a constant when :meth:`step`
    evaluates it; a bad value raises ``ValueError`` before anything changes.

    Raises:
        ValueError: an argument is not allowed (the message names it, its value, what is allowed).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        strategy: str | StrategyOptions | StrategyChooser = "local",
        inverse_method: str = "eigen",
        damping: Hyperparameter = 0.003,
        factor_decay: Hyperparameter = 0.95,
        kl_clip: Hyperparameter | None = 0.001,
        lr: Hyperparameter | None = None,
        factor_update_steps: IntHyperparameter | IntervalBudget | str = 1,
        inv_update_steps: IntHyperparameter | IntervalBudget | str = 1,
        accumulation_steps: int | None = None,
        skip_layers: Sequence[str] = (),
        loss_reduction: str = "mean",
        grad_scaler: Any | None = None,
        factor_dtype: torch.dtype = torch.float32,
        statistics_precision: str = "highest",
        conv_patches: str = "auto",
        statistics_fraction: float = 1.0,
        precondition_precision: str = "highest",
        inv_dtype: torch.dtype = torch.float32,
        grad_worker_fraction: float | None = None,
        bucket_cap_mb: float | None = None,
        comm_dtype: torch.dtype | None = None,
        profile_steps: int | None = None,
        cost_model: ClusterCostModel | CostModelCache | None = None,
        share: str | None = None,
        check_replicas_every: int = 0,
        adaptive: AdaptiveOptions | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        max_factor_dim: int | None = 8192,
        batched_preconditioning: bool | None = None,
        batched_decompositions: bool | int | None = None,
        batched_factor_updates: bool | None = None,
        batched_statistics: bool | None = None,
        plain_step_graphs: bool = False,
        blocks: Mapping[type[nn.Module], BlockFactory] | None = None,
    ) -> None:
        refuse_conflicting_arguments(model, adaptive, grad_scaler, optimizer)
        refuse_compiled_subset(is_compiled(model), statistics_fraction)
        check_blocks(blocks)
        if lr is None:  # the optimizer's rate, once the hook below exists
            lr = 0.1 if optimizer is None else (lambda step: self._hook_lr(step))
        # Every argument named like a KFACConfig field is that field (validated there).
        arguments = {name: value for name, value in locals().items() if name in CONFIG_FIELDS}
        self.config = KFACConfig(**arguments)
        self._recorder = StepRecorder()
        self._model = unwrap_model(model)
        self._strategy, self._choice = start_strategy(self.config, self._model, self._recorder)
        discovered, self._skipped = discover_layers(self._model, self.config, blocks)
        self._layers = [layer for _, layer in discovered]
        self._watch = LayerWatch(self._model, [path for path, _ in discovered], self._layers)
        # Attached without a number, the optimizer's steps delimit the windows: any number of
        # passes (pipelined strategies then expect as many as the window before).
        expected = accumulation_steps or (None if optimizer is not None else 1)
        device = self._layers[0].block.weight.device
        self._batched = self.config.batching(device, self._strategy.starts_work_from_hooks)
        self._strategy.setup(self._layers, accumulation_steps=expected or 1, batching=self._batched)
        # Batched preconditioning (a GPU's default) sums the KL clip in shared launches too.
        self._plain = PlainStep(
            self._strategy,
            self._batched.preconditioning,
            CudaGraphs(device) if self.config.plain_step_graphs else None,
            damping_matters=self.config.inverse_method == "eigen",
        )
        self._grad_scaler = grad_scaler
        self._steps = 0
        self._removed = self._force_inverse = False
        self._skipped_steps = self._decomposition_steps = 0
        self._usage = LayerUsage(self._layers, expected)
        self._intervals = UpdateIntervals(self.config.interval_settings(), device)
        self._adaptive = None
        refuse_unagreed_adaptive(adaptive, self._strategy)
        if adaptive is not None:
            self._adaptive = AdaptiveStep(adaptive, float(self.config.damping_at(0)), self._model)
        self._hook = None
        if optimizer is not None:
            parameters = [p for layer in self._layers for p in layer.block.parameters()]
            try:
                self._hook = OptimizerHook(optimizer, parameters, self.step)
            except ValueError:
                self._strategy.close()  # a process group it may have made
                raise
        self._capture = StatisticsCapture(
            self._model,
            self._layers,
            self._strategy,
            self._recorder,
            self._usage,
            loss_reduction=loss_reduction,
            grad_scaler=grad_scaler,
            capturing=self._is_factor_step(0),
            statistics_fraction=self.config.statistics_fraction,
            compiled=is_compiled(model),
            batched=self._batched.statistics,
        )

    # -- the step -------------------------------------------------------------------------------
    def step(self, inputs: Any = None, targets: Any = None) -> None:
        """Replace the gradients of the preconditioned layers by the K-FAC direction.

        Call after ``loss.backward()`` (and ``scaler.unscale_(optimizer)`` with AMP), before
        ``optimizer.step()``. With ``adaptive``, pass the batch the gradients are of: the
        model's ``inputs`` (a tensor, or a tuple of its positional arguments) and the
        ``targets`` of ``loss_fn``; the layers' parameters move here (see ``adaptive``).

        A layer found used outside its own ``forward()`` (its parent calls ``F.linear`` on its
        weight, like ``nn.MultiheadAttention`` does with ``out_proj``) has a gradient but no
        statistics: it is reported once and its gradient is left exactly as it is, like a
        layer in ``skip_layers`` (not preconditioned, not KL-clipped, not part of ``ν``).

        Raises:
            RuntimeError: called before any backward pass, after :meth:`remove`, or the model
                changed since the preconditioner was built.
            ValueError: a callable hyperparameter returned a value that is not allowed, or the
                batch is missing with ``adaptive`` (given without it).
        """
        hooked = self._hook is not None and not self._hook.running
        refuse_step_call(self._adaptive is not None, inputs, targets, self._removed, hooked)
        self._watch.check()
        # K-FAC's own arithmetic keeps its dtypes if step() is called inside torch.autocast.
        with autocast_disabled(self._layers[0].block.weight.device.type):
            batch = None if self._adaptive is None else self._adaptive.model_batch(inputs, targets)
            self._step(batch)

    def _hook_lr(self, step: int) -> float:
        assert self._hook is not None
        return self._hook.lr(step)

    def _damping_at(self, step: int) -> float:
        """``λ``: adaptive K-FAC's current value, else the configured one at ``step``."""
        return (
            self._adaptive.damping if self._adaptive is not None else self.config.damping_at(step)
        )

    def _step(self, batch: ModelBatch | None) -> None:
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
        factor_step, inverse_step = self._intervals.updates_at(k)
        capture_next = self._is_factor_step(k + 1)
        skipped = False
        if factor_step:
            self._capture.fold_deferred()
            captured = [layer for layer in self._layers if self._strategy.captures(layer)]
            # G's scale counts the micro-batches a layer sat out (dkfac.window_passes).
            self._usage.check_statistics(captured, self._usage.count_sat_out(captured))
            skipped = not gradients_finite(self._model, self._grad_scaler)
            if skipped:  # the GradScaler skips this step: no factor, no decomposition from it
                self._skipped_steps += 1
                self._force_inverse = self._force_inverse or inverse_step
            self._strategy.update_factors(
                self._layers, config.factor_decay_at(k), config.loss_reduction, fold=not skipped
            )
            self._capture.end_window()
            # After the factor update: SPD/PAD may still hold back factor collectives launched
            # from hooks on ranks that skipped a layer; update_factors issues them all, so the
            # usage agreement below comes after them in the same order on every rank.
            self._usage.find_silent(
                active, self._strategy.any_worker, self._layers[0].block.weight.device
            )
        if not skipped and (inverse_step or self._force_inverse):
            self._force_inverse = False
            with self._intervals.timed_decomposition():
                self._strategy.update_inverses(
                    self._layers, self._damping_at(k), config.inverse_method, config.inv_dtype
                )
            self._decomposition_steps += 1
            every = config.check_replicas_every
            if every and self._decomposition_steps % every == 0:
                self._strategy.check_replicas(self._layers)
        passed = self._usage.passed_through
        active = [layer for layer in active if layer.name not in passed]
        if active:
            damping = self._damping_at(k)
            if self._adaptive is not None and batch is not None:
                grads = [layer.block.grad_matrix() for layer in active]
                directions = self._strategy.precondition(active, grads, damping)
                with self._recorder.phase("adaptive"), self._capture.resumed_after():
                    self._capture.capturing = False  # its extra passes are not statistics
                    self._adaptive.step(
                        k,
                        [layer.name for layer in active],
                        [layer.block for layer in active],
                        grads,
                        directions,
                        batch,
                        self._strategy.average,
                    )
            else:
                clip = None
                if config.kl_clip_at is not None:
                    clip = (config.lr_at(k), config.kl_clip_at(k))
                self._plain.apply(active, damping, clip)
        counts = not skipped and not self._strategy.profiling  # as measurements, for budgets
        if self._intervals.step_finished(factor_step, self._strategy.largest, record=counts):
            capture_next = self._is_factor_step(k + 1)
        self._recorder.finish_step(self._steps)
        self._steps += 1
        self._capture.capturing = capture_next

    def __deepcopy__(self, memo: dict[int, Any]) -> KFACPreconditioner:
        """The same preconditioner: copying what holds it (a snapshot) copies no K-FAC state.

        It holds a process group, which cannot be copied, and its hooks feed this object's
        layers; a second object sharing them would take them away on its ``remove()``.
        """
        return self

    def remove(self) -> None:
        """Detach every hook and release the strategy's process group, if it made one.

        The model is left exactly as it was before. Under ``torch.distributed`` every rank
        calls it (like building the preconditioner).
        """
        self._capture.remove()
        if self._hook is not None:
            self._hook.remove()
        if not self._removed:
            self._strategy.close()
        self._removed = True
        self._plain.release()
        for layer in self._layers:
            layer.clear_statistics()
