"""One timed window of ``dkfac bench`` on this rank: one configuration, one model.

A freshly built DDP model (the same seed for every configuration), SGD, and for a K-FAC
configuration its preconditioner; the warm-up, then ``iters`` iterations timed after a
``dist.barrier()`` with the garbage collector paused. The raw numbers of this rank are combined
across ranks by :mod:`dkfac.bench.window_reduction`.
"""

from __future__ import annotations

import collections
import gc
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

import dkfac
from dkfac.bench.configs import (
    INVERSE_METHOD,
    LR,
    MODELS,
    MOMENTUM,
    NUM_CLASSES,
    Configuration,
)
from dkfac.curvature.inverse import FACTOR_SIDES
from dkfac.strategies import option_keywords

#: Most extra warm-up steps a strategy may take to finish profiling (spd/pad: 5 factor
#: updates at its defaults; with factor_update_steps=10, 50 steps).
MAX_PROFILING_STEPS = 100


def kfac_memory_bytes(pre: dkfac.KFACPreconditioner) -> tuple[int, int]:
    """Bytes of the running factors and of the decompositions this rank holds.

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
            inverse_bytes += sum(
                t.numel() * t.element_size() for t in layer.inverse.tensors().values()
            )
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
) -> dict[str, Any]:
    """Build a fresh DDP model for ``config``, warm it up, time ``iters`` iterations.

    Returns this rank's raw numbers; :func:`~dkfac.bench.window_reduction.reduce_window`
    combines the ranks. The garbage collector is paused during the window (for every
    configuration alike).
    """
    torch.manual_seed(seed)
    net = MODELS[model_name](num_classes=NUM_CLASSES)
    net.train()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pre: dkfac.KFACPreconditioner | None = None
    if config.strategy is not None:
        pre = dkfac.KFACPreconditioner(
            model,
            strategy=config.strategy,
            inverse_method=INVERSE_METHOD,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            bucket_cap_mb=bucket_cap_mb,
            **option_keywords(config.strategy, grad_worker_fraction=config.grad_worker_fraction),
        )

    def iteration() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        torch.autograd.backward(loss)  # loss.backward(), untyped in torch's stubs
        if pre is not None:
            pre.step()
        optimizer.step()
        return loss

    clock = time.perf_counter
    iter_s: list[float] = []
    phase_sums: dict[str, float] = collections.defaultdict(float)
    byte_sums: dict[str, int] = collections.defaultdict(int)
    call_sums: dict[str, int] = collections.defaultdict(int)
    try:
        loss = torch.zeros(())
        for _ in range(warmup):
            loss = iteration()
        # SPD/PAD re-plan their fusion after profiling a few factor updates: the window times
        # the plan they keep, never the provisional one (at most MAX_PROFILING_STEPS more).
        settled_warmup = warmup
        while pre is not None and pre.profiling and settled_warmup < warmup + MAX_PROFILING_STEPS:
            loss = iteration()
            settled_warmup += 1
        if pre is not None and pre.profiling:
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
                if pre is not None:
                    for phase, seconds in pre.timings().items():
                        phase_sums[phase] += seconds
                    for key, count in pre.comm_stats().items():
                        byte_sums[key] += count["bytes"]
                        call_sums[key] += count["calls"]
            wall_s = clock() - window_start
        finally:
            if gc_was_enabled:
                gc.enable()
        final_loss = float(loss.detach())
        factor_bytes = inverse_bytes = 0
        plan: dict[str, Any] = {}
        if pre is not None:
            if pre.steps != settled_warmup + iters:
                raise RuntimeError(
                    f"{config.key}: pre.steps={pre.steps}, expected {settled_warmup + iters}"
                )
            factor_bytes, inverse_bytes = kfac_memory_bytes(pre)
            plan = dict(pre.plan())
    finally:
        if pre is not None:
            pre.remove()
    return {
        "wall_s": wall_s,
        "iter_s": iter_s,
        "phase_s": {name: value / iters for name, value in phase_sums.items()},
        "bytes_per_step": {key: value / iters for key, value in byte_sums.items()},
        "calls_per_step": {key: value / iters for key, value in call_sums.items()},
        "factor_bytes": factor_bytes,
        "inverse_bytes": inverse_bytes,
        "final_loss": final_loss,
        "warmup_steps": settled_warmup if pre is not None else warmup,
        "cost_model": plan.get("cost_model"),
        "fusion_buckets": len(plan.get("buckets", [])),
    }
