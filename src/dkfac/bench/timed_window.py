"""One timed window of ``dkfac bench`` on this rank: one configuration, one model.

A freshly built model (the same seed for every configuration) wrapped in DDP with SGD, and for
a K-FAC configuration its preconditioner; or, for DeAR + SGD, the bare model hooked by
:class:`dkfac.DeAR`, which averages the gradients and takes the SGD step. The warm-up (longer
while SPD/PAD profile or DeAR searches its bucket size), then ``iters`` iterations timed after
a ``dist.barrier()`` with the garbage collector paused. The raw numbers of this rank are
combined across ranks by :mod:`dkfac.bench.window_reduction`.
"""

from __future__ import annotations

import collections
import gc
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import dkfac
from dkfac.bench.configs import (
    AUTO,
    DEAR_AUTO_RANGE_MB,
    DEAR_AUTO_TRIAL_STEPS,
    DEAR_BUCKET_CAP_MB,
    DEAR_WAITS,
    INVERSE_METHOD,
    LR,
    MODELS,
    MOMENTUM,
    NUM_CLASSES,
    Configuration,
)
from dkfac.bench.models import batch_loss
from dkfac.curvature.factor_side import FACTOR_SIDES
from dkfac.strategies import option_keywords

#: Most extra warm-up steps a strategy may take to finish profiling (spd/pad: 5 factor
#: updates at its defaults; with factor_update_steps=10, 50 steps) or DeAR to finish its
#: bucket size search (at most 11 sizes of 1/16-64 MiB, a warm-up and 5 timed steps each).
MAX_PROFILING_STEPS = 100


class Instrumented(Protocol):
    """What the window reads after each iteration: a preconditioner's or DeAR's records."""

    def timings(self) -> dict[str, float]:
        """Seconds per phase of the last step."""
        ...

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per ``"phase/collective"`` of the last step."""
        ...


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The benchmark's optimizer (also DeAR's optimizer factory)."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def kfac_memory_bytes(pre: dkfac.KFACPreconditioner) -> tuple[int, int]:
    """Bytes of the running factors and of the decompositions this rank holds.

    The decompositions' bfloat16 copies (``precondition_precision="bf16"``) count too.
    Factors are counted one by one: under PAD an owner may hold a layer's ``A`` and not its
    ``G`` (``pre.factors()`` lists only layers with both, so it would miss those).
    """
    factor_bytes = 0
    for layer in pre.layers:
        for side in FACTOR_SIDES:
            factor = layer.factor(side)
            if factor is not None:
                factor_bytes += factor.numel() * factor.element_size()
    inverse_bytes = 0
    for layer in pre.layers:
        if layer.inverse is not None:
            inverse_bytes += sum(t.numel() * t.element_size() for t in layer.inverse.held_tensors())
    return factor_bytes, inverse_bytes


def time_window(
    config: Configuration,
    model_name: str,
    x: Tensor,
    y: Tensor,
    *,
    warmup: int,
    iters: int,
    seed: int,
    bucket_cap_mb: float,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Build a fresh model for ``config``, warm it up, time ``iters`` iterations.

    Returns this rank's raw numbers; :func:`~dkfac.bench.window_reduction.reduce_window`
    combines the ranks. The garbage collector is paused during the window (for every
    configuration alike). On a GPU (``device``) every iteration waits for the device at its
    end, so that its time is the device's, not that of queuing its work.
    """
    torch.manual_seed(seed)
    on = device or torch.device("cpu")
    net = MODELS[model_name](num_classes=NUM_CLASSES).to(on)
    net.train()
    model: nn.Module = net
    dear: dkfac.DeAR | None = None
    zero_grad: Callable[[], None] | None = None
    if config.dear:
        # DeAR owns the gradients from dear.step() until the next forward applies the update:
        # it resets them itself, and zero_grad() would only add work.
        dear = dkfac.DeAR(
            net,
            sgd,
            bucket_cap_mb=DEAR_BUCKET_CAP_MB,
            auto_range_mb=DEAR_AUTO_RANGE_MB,
            auto_trial_steps=DEAR_AUTO_TRIAL_STEPS,
        )
        step: Callable[[], Any] = dear.step
    else:
        model = DistributedDataParallel(net, device_ids=[on.index] if on.type == "cuda" else None)
        optimizer = sgd(model.parameters())
        step, zero_grad = optimizer.step, optimizer.zero_grad
    pre: dkfac.KFACPreconditioner | None = None
    if config.strategy is not None:
        auto = config.strategy == AUTO  # chooses its options and bucket cap: none passed
        fixed = {
            "bucket_cap_mb": bucket_cap_mb,
            **option_keywords(config.strategy, grad_worker_fraction=config.grad_worker_fraction),
        }
        pre = dkfac.KFACPreconditioner(
            model,
            strategy=(
                dkfac.AutoOptions(
                    example=(x, y),
                    loss_fn=batch_loss,
                    dear_bucket_cap_mb=DEAR_BUCKET_CAP_MB if dear is not None else None,
                )
                if auto
                else config.strategy
            ),
            inverse_method=INVERSE_METHOD,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            **({} if auto else fixed),
        )

    # Both report their phases when K-FAC runs with DeAR (its waits as DeAR names them).
    records: list[Instrumented] = [r for r in (pre, dear) if r is not None]

    def iteration() -> Tensor:
        if zero_grad is not None:
            zero_grad()
        loss = batch_loss(model(x), y)
        torch.autograd.backward(loss)  # loss.backward(), untyped in torch's stubs
        if pre is not None:
            if dear is not None:  # K-FAC preconditions the averaged gradients
                dear.gather_gradients()
            pre.step()
        step()
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        return loss

    def settling() -> bool:
        return (pre is not None and pre.profiling) or (dear is not None and dear.searching)

    clock = time.perf_counter
    iter_s: list[float] = []
    phase_sums: dict[str, float] = collections.defaultdict(float)
    byte_sums: dict[str, int] = collections.defaultdict(int)
    call_sums: dict[str, int] = collections.defaultdict(int)
    overlap_sums: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    try:
        loss = torch.zeros(())
        for _ in range(warmup):
            loss = iteration()
        # SPD/PAD re-plan their fusion after profiling a few factor updates, DeAR keeps the
        # fastest bucket size it tried: the window times the plan they keep, never a
        # provisional one (at most MAX_PROFILING_STEPS more). Both decide together on every
        # rank, so every rank leaves this loop after the same step.
        settled_warmup = warmup
        while settling() and settled_warmup < warmup + MAX_PROFILING_STEPS:
            loss = iteration()
            settled_warmup += 1
        if settling():
            raise RuntimeError(f"{config.key}: still profiling after {settled_warmup} steps")
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            dist.barrier()
            window_start = clock()
            for _ in range(iters):
                t0 = clock()
                loss = iteration()
                iter_s.append(clock() - t0)
                for record in records:
                    for phase, seconds in record.timings().items():
                        phase_sums[phase] += seconds
                    for key, count in record.comm_stats().items():
                        byte_sums[key] += count["bytes"]
                        call_sums[key] += count["calls"]
                if pre is not None:
                    for phase, split in pre.comm_overlap().items():
                        for part, seconds in split.items():
                            overlap_sums[phase][part] += seconds
            wall_s = clock() - window_start
        finally:
            if gc_was_enabled:
                gc.enable()
        final_loss = float(loss.detach())
        factor_bytes = inverse_bytes = 0
        plan: dict[str, Any] = {}
        dear_plan: dict[str, Any] = {}
        if pre is not None:
            if pre.steps != settled_warmup + iters:
                raise RuntimeError(
                    f"{config.key}: pre.steps={pre.steps}, expected {settled_warmup + iters}"
                )
            factor_bytes, inverse_bytes = kfac_memory_bytes(pre)
            plan = dict(pre.plan())
        if dear is not None:
            dear_plan = {"bucket_cap_mb": dear.bucket_cap_mb, "tuning": dear.tuning}
    finally:
        if pre is not None:
            pre.remove()
        if dear is not None:
            dear.remove()
    phase_s = {name: value / iters for name, value in phase_sums.items()}
    if dear is not None and pre is None:
        # SGD with DeAR: its exposed gradient waits, under the name the K-FAC rows use for
        # gradient traffic. With K-FAC, grad_comm stays K-FAC's own, as in the DDP rows (whose
        # gradient allreduce is not timed); DeAR's waits keep their own names.
        phase_s["grad_comm"] = sum(phase_s.get(name, 0.0) for name in DEAR_WAITS)
    return {
        "wall_s": wall_s,
        "iter_s": iter_s,
        "phase_s": phase_s,
        "bytes_per_step": {key: value / iters for key, value in byte_sums.items()},
        "calls_per_step": {key: value / iters for key, value in call_sums.items()},
        # Per phase, seconds per step its collectives were in flight, exposed (the training
        # thread inside the phase) and hidden under other work (pre.comm_overlap()).
        "overlap_s": {
            phase: {part: value / iters for part, value in split.items()}
            for phase, split in overlap_sums.items()
        },
        "factor_bytes": factor_bytes,
        "inverse_bytes": inverse_bytes,
        "final_loss": final_loss,
        "warmup_steps": settled_warmup,
        "cost_model": plan.get("cost_model"),
        "fusion_buckets": len(plan.get("buckets", [])),
        # PAD broadcasts decompositions or preconditioned gradients (its share option).
        "pad_share": plan.get("share", {}).get("mode"),
        "chosen": plan.get("chosen", {}).get("label"),  # strategy=auto's choice
        "dear_bucket_cap_mb": dear_plan.get("bucket_cap_mb"),
        "dear_tuning": dear_plan.get("tuning"),
    }
