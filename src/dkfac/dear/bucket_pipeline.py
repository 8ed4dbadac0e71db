"""The buckets of a DeAR step on their way from gradients to applied updates.

Bucket state and shard bookkeeping: which bucket holds each parameter's gradient, which
bucket's reduce-scatter goes next (strictly last bucket to first), the all-gathers, the
averaged gradients installed as ``.grad`` views, and each bucket's deferred optimizer update,
applied exactly once with the hyperparameters of the step that produced its gradients.
:class:`~dkfac.dear.averaging.DeAR` holds one and drives it from its hooks and its ``step``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.dear.gradient_buckets import GradientBucket, build_gradient_buckets
from dkfac.dear.update_sites import UpdateSites


class BucketPipeline:
    """The gradient buckets of one layout, their collectives and their deferred updates.

    Args:
        params: the trainable parameters, in forward order.
        optimizer: the optimizer over them (its update must be per-parameter).
        sites: before which modules' forward each parameter's update is due.
        comm: the communicator of the ranks that share the model.
        recorder: the step recorder that ``comm`` records into.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        sites: UpdateSites,
        comm: Communicator,
        recorder: StepRecorder,
    ) -> None:
        self._params = params
        self.optimizer = optimizer
        self._recorder = recorder
        self._comm = comm
        self._world = comm.world_size
        self._hyperparameters: list[dict[str, Any]] = []
        self._buckets: list[GradientBucket] = []
        self._bucket_of: dict[int, tuple[GradientBucket, int]] = {}
        # Where each parameter's update is applied: the pre-hooks of the modules that hold it,
        # plus, for a parameter its parent uses without calling its module (the out_proj of
        # nn.MultiheadAttention), the nearest ancestor whose forward runs (learned at step 0).
        self._sites = sites
        self._apply_at: dict[int, list[GradientBucket]] = {}
        self._next_launch = -1

    @property
    def buckets(self) -> list[GradientBucket]:
        """The buckets of the current layout, first (earliest parameters) to last."""
        return self._buckets

    def bucket_of(self, param: Tensor) -> tuple[GradientBucket, int] | None:
        """``param``'s bucket and position in it, or None for a parameter not averaged here."""
        return self._bucket_of.get(id(param))

    def apply_pending(self) -> None:
        """Apply every bucket's pending update now."""
        for bucket in self._buckets:
            if bucket.pending:
                self.apply(bucket)

    # -- bucket state ----------------------------------------------------------------------
    def build(self, cap_mb: float) -> None:
        """Buckets of at most ``cap_mb`` MiB, none launched, last bucket next."""
        self._buckets = build_gradient_buckets(self._params, cap_mb, self._world)
        self._bucket_of = {
            id(param): (bucket, position)
            for bucket in self._buckets
            for position, param in enumerate(bucket.params)
        }
        self._next_launch = len(self._buckets) - 1
        self._index_sites()

    def _index_sites(self) -> None:
        """``_apply_at``: per module, the buckets its pre-hook must bring up to date."""
        self._apply_at = {}
        for param in self._params:
            bucket = self._bucket_of[id(param)][0]
            for module in self._sites.modules_of(param):
                buckets = self._apply_at.setdefault(id(module), [])
                if bucket not in buckets:
                    buckets.append(bucket)

    def learn_sites(self) -> None:
        """Add the sites of parameters used outside their module (see :class:`UpdateSites`)."""
        if self._sites.learn():
            self._index_sites()

    def reset(self, *, pending: bool) -> None:
        """Ready for the next backward pass; ``pending``: an update awaits every bucket."""
        for bucket in self._buckets:
            bucket.ready.clear()
            bucket.launched = False
            bucket.pending = pending
        self._next_launch = len(self._buckets) - 1

    # -- collectives -----------------------------------------------------------------------
    def _launch_reduce_scatter(self, bucket: GradientBucket) -> None:
        """Pack this rank's gradients and used flags (1/P each) and start the reduce-scatter."""
        if bucket.pending:  # last step's update was never needed by a forward: apply it now
            self.apply(bucket)
        with torch.no_grad():
            bucket.flat.zero_()
            for position, param in enumerate(bucket.params):
                if param.grad is not None:
                    start = bucket.offsets[position]
                    bucket.flat[start : start + param.numel()].copy_(param.grad.reshape(-1))
                    bucket.flags[position] = 1
            bucket.flat.div_(self._world)
        bucket.reduce = self._comm.reduce_scatter(
            bucket.flat, bucket.shard, phase="grad_reduce_scatter"
        )
        bucket.launched = True
        bucket.reduce_started = self._recorder.now()
        self._next_launch = bucket.index - 1

    def launch_complete_reduce_scatters(self) -> None:
        """Start the next buckets whose gradients are all ready, last bucket first."""
        while self._next_launch >= 0:
            candidate = self._buckets[self._next_launch]
            if len(candidate.ready) < len(candidate.params):
                break
            self._launch_reduce_scatter(candidate)

    def launch_remaining_reduce_scatters(self) -> None:
        """Buckets not complete in backward (unused parameters) go now, last bucket first."""
        while self._next_launch >= 0:
            self._launch_reduce_scatter(self._buckets[self._next_launch])

    def launch_all_gathers(self) -> None:
        """Wait for each reduce-scatter and start its all-gather, first bucket first."""
        for bucket in self._buckets:
            assert bucket.reduce is not None
            with self._recorder.phase("grad_reduce_scatter"):
                bucket.reduce.wait()
            self._recorder.span(
                "reduce_scatter in flight", bucket.reduce_started, self._recorder.now()
            )
            bucket.reduce = None
            bucket.gather = self._comm.all_gather(
                bucket.shard, bucket.flat, phase="grad_all_gather"
            )
            bucket.gather_started = self._recorder.now()

    def _wait_gather(self, bucket: GradientBucket) -> None:
        """Wait for ``bucket``'s all-gather, if one is in flight."""
        if bucket.gather is None:
            return
        with self._recorder.phase("grad_all_gather"):
            bucket.gather.wait()
        self._recorder.span("all_gather in flight", bucket.gather_started, self._recorder.now())
        bucket.gather = None

    def install_gradients(self, bucket: GradientBucket) -> list[nn.Parameter]:
        """Averaged gradients into ``.grad`` (views of ``flat``); the parameters some rank used."""
        self._wait_gather(bucket)
        used = bucket.flags.gt(0).tolist()
        installed = []
        for position, param in enumerate(bucket.params):
            if used[position]:
                param.grad = bucket.grad_view(position)
                installed.append(param)
        return installed

    # -- deferred updates ------------------------------------------------------------------
    def apply_updates_due_before(self, module: nn.Module) -> None:
        """Apply the pending updates of the buckets ``module``'s forward must see up to date."""
        for bucket in self._apply_at.get(id(module), ()):
            if bucket.pending:
                self.apply(bucket)

    def apply(self, bucket: GradientBucket) -> None:
        """The deferred optimizer update of ``bucket``'s parameters, exactly once.

        The optimizer steps every parameter that has a ``.grad``, so gradients of other
        parameters (a backward pass may be under way when a late update runs) are set aside
        and put back afterwards.
        """
        bucket.pending = False
        aside = [(param, param.grad) for param in self._params if param.grad is not None]
        for param, _ in aside:
            param.grad = None
        # Optimizer state created under an evaluation's inference_mode would be unusable later.
        with torch.inference_mode(False):
            self.install_gradients(bucket)
            self.optimizer_step()
        for param in bucket.params:
            param.grad = None
        for param, grad in aside:
            param.grad = grad

    def remember_hyperparameters(self) -> None:
        """Keep the optimizer's hyperparameters now, for the deferred updates of this step."""
        # Values, not references: schedulers change a tensor lr in place.
        self._hyperparameters = [
            {k: v.clone() if isinstance(v, Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]

    def optimizer_step(self) -> None:
        """``optimizer.step()`` with the hyperparameters of the step that produced the grads.

        Only parameters whose ``.grad`` is set are touched: every other ``.grad`` is ``None``.
        """
        with self._recorder.phase("update"):
            groups = self.optimizer.param_groups
            current = [{k: v for k, v in g.items() if k != "params"} for g in groups]
            # Groups added after the step (add_param_group) keep their own values.
            for group, saved in zip(groups, self._hyperparameters, strict=False):
                group.update(saved)
            try:
                self.optimizer.step()
            finally:
                for group, values in zip(groups, current, strict=True):
                    group.update(values)
