"""DeAR: data-parallel gradient aggregation with the all-reduce decoupled (docs/dear.md).

An all-reduce is a reduce-scatter followed by an all-gather. :class:`DeAR` runs the first half
under the backward pass and the second under the *next* forward pass:

1. Gradients are fused into buckets in forward order (parameter registration order); the
   first bucket is capped at 1 MiB.
2. During backward, a post-accumulate-grad hook marks each gradient ready; a bucket whose
   gradients all exist starts its reduce-scatter at once (buckets are launched strictly from
   the last to the first, so every rank issues the same collectives in the same order even
   when some parameter is unused on one rank).
3. :meth:`DeAR.step` (where ``optimizer.step()`` used to be) waits for the reduce-scatters and
   starts every bucket's all-gather, first bucket first.
4. In the next forward pass, the forward pre-hook of each module waits for the all-gathers of
   the buckets holding its parameters and applies the optimizer update to exactly those
   parameters, just before they are used.

Numerically this is DDP (``find_unused_parameters=True``) followed by ``optimizer.step()``:
gradients are averaged over ranks; a parameter no rank used keeps ``grad=None`` and is skipped
by the optimizer. The update of each step is applied exactly once: by the pre-hook, by
:meth:`DeAR.finish` (call it before evaluation that bypasses the modules' forward, at the end
of training, or let ``model.state_dict()``/``optimizer.state_dict()`` call it), or at the
latest before the same bucket's next reduce-scatter.

This module is the public class and its hooks into the model and autograd; the buckets, their
collectives and the deferred updates are :mod:`dkfac.dear.bucket_pipeline`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dkfac.comm.communicator import Communicator, ProcessGroup
from dkfac.comm.groups import require_distributed
from dkfac.comm.handle import CollectiveHandle
from dkfac.comm.recorder import StepRecorder
from dkfac.dear.argument_checks import (
    OptimizerFactory,
    check_bucket_options,
    check_model,
    make_optimizer,
)
from dkfac.dear.bucket_pipeline import BucketPipeline
from dkfac.dear.bucket_search import (
    DEFAULT_AUTO_RANGE_MB,
    BucketSizeSearch,
    distinct_candidates,
    power_of_two_sizes,
)
from dkfac.dear.gradient_buckets import plan_gradient_buckets, trainable_parameters
from dkfac.dear.update_sites import UpdateSites

logger = logging.getLogger(__name__)

#: Phases of a DeAR step: time spent *waiting* (exposed communication) and updating.
DEAR_PHASES: tuple[str, ...] = (
    "grad_reduce_scatter",
    "grad_all_gather",
    "update",
    "buffer_broadcast",
)


class DeAR:
    """Drop-in replacement of DDP + ``optimizer.step()`` that overlaps both halves of the allreduce.

    Example::

        model = MyModel()
        dear = dkfac.DeAR(model, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)   # pre-hooks apply last step's update
            loss.backward()                       # reduce-scatters start under backward
            dear.step()                           # all-gathers start; replaces optimizer.step()
        dear.finish()                             # apply the last update (evaluation, saving)

    With K-FAC, the preconditioner needs every averaged gradient before it runs, so the
    all-gathers cannot wait for the next forward pass::

        loss.backward()
        dear.gather_gradients()   # .grad = averaged gradients (only reduce-scatter overlapped)
        pre.step()
        dear.step()               # the update is applied now, nothing is deferred

    Gradients belong to DeAR from :meth:`step` until the update is applied: ``.grad`` is
    ``None`` after :meth:`step` and after each update, so ``optimizer.zero_grad()`` is optional.
    Hyperparameters (``lr``, ...) are those of the optimizer when :meth:`step` was called, even if
    a scheduler changes them before the deferred update runs. Parameters must be used through
    their own module's ``forward`` (as with FSDP): that is where their update is applied.

    Args:
        model: the model (not wrapped in DDP). Its parameters and buffers are broadcast from
            rank 0 now; buffers again after every :meth:`step`, received by the next forward
            pass that runs with gradients enabled (as DDP's ``broadcast_buffers``).
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters, or a factory
            ``params -> Optimizer``. Its update must be per-parameter (SGD, Adam, AdamW, ...).
        bucket_cap_mb: bucket size in MiB, or ``"auto"``: each power-of-two size in
            ``auto_range_mb`` that gives a distinct layout is timed for ``auto_trial_steps``
            iterations, then the fastest (median, agreed over ranks) is kept for the rest of
            the run.
        auto_range_mb: ``(low, high)`` MiB searched by ``"auto"`` (default 64 KiB to 64 MiB).
        auto_trial_steps: timed iterations per candidate size.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) each step.
        process_group: the ranks that share the model; default: a new group of all ranks, so
            DeAR's collectives, launched from hooks, never interleave with other traffic.

    Raises:
        ValueError: an argument is not allowed (message names it).
        RuntimeError: no initialised ``torch.distributed`` process group.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        *,
        bucket_cap_mb: float | str = 25.0,
        auto_range_mb: tuple[float, float] = DEFAULT_AUTO_RANGE_MB,
        auto_trial_steps: int = 5,
        broadcast_buffers: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        check_model(model)
        search = check_bucket_options(bucket_cap_mb, auto_range_mb, auto_trial_steps)
        params = trainable_parameters(model)
        checked_optimizer = make_optimizer(model, optimizer)
        self.module = model
        require_distributed(
            "DeAR",
            builder="DeAR",
            alternative="in a single process, call optimizer.step() directly",
        )
        recorder = StepRecorder(phases=DEAR_PHASES)
        comm = (
            Communicator.with_own_group(recorder)
            if process_group is None
            else Communicator(recorder, group=process_group)
        )
        self.optimizer = checked_optimizer
        self._params = params
        self._comm = comm
        self._recorder = recorder
        self._world = comm.world_size
        self._sites = UpdateSites(model, params)
        self._pipeline = BucketPipeline(params, checked_optimizer, self._sites, comm, recorder)
        self._broadcast_buffers = broadcast_buffers
        self._sync_enabled = True
        self._steps = 0
        self._gathered = False
        self._buffer_sync: CollectiveHandle | None = None
        self._last_step_at: float | None = None
        self._backward_started: float | None = None
        self._forward_started: float | None = None
        self._broadcast_state()

        self._search: BucketSizeSearch | None = None
        if search:
            candidates = distinct_candidates(
                power_of_two_sizes(*auto_range_mb),
                lambda mb: tuple(map(tuple, plan_gradient_buckets(self._params, mb))),
            )
            self._search = BucketSizeSearch(candidates, trial_steps=auto_trial_steps)
            self.bucket_cap_mb = self._search.current
        else:
            self.bucket_cap_mb = float(bucket_cap_mb)
        self.tuning: list[tuple[float, float]] = []
        self._pipeline.build(self.bucket_cap_mb)
        self._handles: list[RemovableHandle] = self._register_hooks()

    # -- construction ----------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP does)."""
        tensors = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        if tensors and self._world > 1:
            with torch.no_grad():
                self._comm.broadcast(tensors, 0, phase="broadcast").wait()

    def _register_hooks(self) -> list[RemovableHandle]:
        register = nn.Parameter.register_post_accumulate_grad_hook
        handles = [register(param, self._on_gradient) for param in self._params]  # type: ignore[no-untyped-call]
        # prepend: updates land before other pre-hooks read the parameters (weight_norm
        # recomputes `weight` from `weight_g`/`weight_v` in its own pre-hook).
        for module in self.module.modules():
            hook = functools.partial(self._before_module_forward, module)
            handles.append(module.register_forward_pre_hook(hook, prepend=True))
        handles.append(
            self.module.register_forward_pre_hook(self._before_model_forward, prepend=True)
        )
        handles.append(self.module.register_forward_hook(self._after_model_forward))
        # Saving or loading while an update is pending would lose it: apply it first.
        for owner in (self.module, self.optimizer):
            handles.append(owner.register_state_dict_pre_hook(self._finish_hook))
            handles.append(owner.register_load_state_dict_pre_hook(self._finish_hook))
        return handles

    # -- hooks -----------------------------------------------------------------------------
    def _finish_hook(self, *_: Any, **__: Any) -> None:
        self.finish()

    def _on_gradient(self, param: Tensor) -> None:
        entry = self._pipeline.bucket_of(param)
        if not self._sync_enabled or entry is None:  # entry None: a deep copy's parameter
            return
        if self._backward_started is None:
            self._backward_started = self._recorder.now()
        bucket, position = entry
        if bucket.pending:
            raise RuntimeError(
                f"DeAR: a parameter of shape {tuple(param.shape)} was used in the forward pass "
                "before its update of the last step was applied: it is used outside the "
                "forward() of the modules that hold it, by a module DeAR did not see use it at "
                "step 0. Call dear.finish() before such forward passes, or use the parameter "
                "through its own module"
            )
        if bucket.launched:
            raise RuntimeError(
                "a gradient was accumulated again after its bucket's reduce-scatter started: "
                "call dear.step() after each backward pass, or run the extra backward passes "
                "of gradient accumulation inside `with dear.no_sync():`"
            )
        bucket.ready.add(position)
        self._pipeline.launch_complete_reduce_scatters()

    def _before_model_forward(self, module: nn.Module, args: Any) -> None:
        if module is not self.module:  # a deep copy of the model
            return
        self._forward_started = self._recorder.now()
        # As DDP: rank 0's buffers (sent by the last step) replace this rank's at the next
        # forward, in any mode.
        self._receive_buffers()
        if not (torch.is_grad_enabled() and module.training):
            # Evaluation has nothing to overlap, and fused fast paths (TransformerEncoderLayer
            # in eval) read parameters without calling the modules that hold them.
            self.finish()

    def _receive_buffers(self) -> None:
        if self._buffer_sync is not None:
            handle, self._buffer_sync = self._buffer_sync, None
            with self._recorder.phase("buffer_broadcast"):
                handle.wait()

    def _after_model_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_started is not None:
            self._recorder.span("forward", self._forward_started, self._recorder.now())
            self._forward_started = None

    def _before_module_forward(self, module: nn.Module, *_: Any) -> None:
        self._sites.saw_forward(module)
        self._pipeline.apply_updates_due_before(module)

    # -- public ----------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> DeAR:
        """The same DeAR: a deep-copied model's hooks (EMA, snapshots) ignore the copy."""
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (the model can also be called directly)."""
        return self.module(*args, **kwargs)

    @property
    def searching(self) -> bool:
        """Whether ``bucket_cap_mb="auto"`` is still timing candidate sizes."""
        return self._search is not None

    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls."""
        return self._steps

    def gather_gradients(self) -> None:
        """Finish the allreduce now: ``.grad`` holds the averaged gradients, as after DDP.

        For code that reads or changes gradients before the update (K-FAC, clipping). The
        reduce-scatters still overlapped the backward pass; the all-gathers do not overlap
        anything. The following :meth:`step` applies the update at once.
        """
        if self._gathered:
            return
        if self._sites.learning:
            self._pipeline.learn_sites()
        self._pipeline.launch_remaining_reduce_scatters()
        self._pipeline.launch_all_gathers()
        for bucket in self._pipeline.buckets:
            self._pipeline.install_gradients(bucket)
        self._gathered = True

    def step(self) -> None:
        """Take the optimizer step of this iteration (call it instead of ``optimizer.step()``).

        Starts the all-gathers; each bucket's update is applied in the next forward pass just
        before its parameters are used (or at once after :meth:`gather_gradients`, and on the
        first step, so that an LR scheduler sees ``optimizer.step()`` before its own step).
        """
        now = self._recorder.now()
        if self._backward_started is not None:
            self._recorder.span("backward (gradients ready)", self._backward_started, now)
            self._backward_started = None
        deferred = not self._gathered
        if self._sites.learning:
            self._pipeline.learn_sites()
        if deferred:  # may apply last step's late updates, with last step's hyperparameters
            self._pipeline.launch_remaining_reduce_scatters()
        self._pipeline.remember_hyperparameters()
        # Before the all-gathers: on a backend that runs a group's collectives in order
        # (NCCL), the next forward must not wait behind every all-gather for the buffers.
        buffers = list(self.module.buffers()) if self._broadcast_buffers else []
        if buffers and self._world > 1:
            self._receive_buffers()  # normally done by the forward pass before this step
            self._buffer_sync = self._broadcast_by_dtype(buffers)
        if deferred:
            self._pipeline.launch_all_gathers()
        else:
            self._pipeline.optimizer_step()
        self._gathered = False
        for param in self._params:
            param.grad = None
        self._pipeline.reset(pending=deferred)
        if self._steps == 0:
            self.finish()
        self._tune(now)
        self._recorder.finish_step(self._steps)
        self._steps += 1

    def _broadcast_by_dtype(self, buffers: list[Tensor]) -> CollectiveHandle:
        """Rank 0's buffers, one fused broadcast per dtype (int64 counters stay exact)."""
        pending = []
        for dtype in dict.fromkeys(b.dtype for b in buffers):
            same = [b for b in buffers if b.dtype == dtype]
            pending.append(self._comm.broadcast(same, 0, phase="buffer_broadcast"))
        return CollectiveHandle.joined(pending)

    def finish(self) -> None:
        """Apply every pending update now (before evaluation, saving, or the end of training)."""
        self._pipeline.apply_pending()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate ``.grad`` (gradient accumulation), as in DDP."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _tune(self, now: float) -> None:
        """Feed the iteration time to the bucket-size search; switch or freeze when it says."""
        previous, self._last_step_at = self._last_step_at, now
        if self._search is None or previous is None or not self._search.record(now - previous):
            return
        search = self._search
        if search.measured_all:
            device = self._pipeline.buckets[0].flat.device  # NCCL reduces device tensors only
            medians = torch.tensor(search.medians, dtype=torch.float64, device=device)
            self._comm.allreduce([medians], phase="tuning", maximum=True).wait()
            self.tuning = list(zip(search.candidates, medians.tolist(), strict=True))
            chosen = search.choose(medians.tolist())
            self._search = None
            logger.info(
                "DeAR bucket size: %.3g MiB (median s/iteration per size: %s)",
                chosen,
                ", ".join(f"{mb:g}: {s:.4f}" for mb, s in self.tuning),
            )
        else:
            chosen = search.current
        if chosen != self.bucket_cap_mb:
            self.finish()
            self.bucket_cap_mb = chosen
            self._pipeline.build(self.bucket_cap_mb)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls of the last step per ``"phase/collective"`` (payload on this rank)."""
        return self._recorder.comm_stats()

    def timings(self) -> dict[str, float]:
        """Seconds of the last step spent waiting for collectives and in optimizer updates."""
        return self._recorder.timings()

    def export_trace(self, path: str) -> None:
        """Chrome trace of recent steps: forward, backward, waits and collectives in flight."""
        self._recorder.export_trace(path, rank=dist.get_rank())

    def remove(self) -> None:
        """Apply what is pending, detach every hook and release DeAR's process group."""
        self.finish()
        self._receive_buffers()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._comm.close()  # destroys the group only if DeAR made it
