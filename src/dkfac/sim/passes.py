"""One worker's forward and backward pass: when each layer's factors and gradients are ready.

A plain pass takes the profile's times. On a factor step, a worker also computes the
statistics of the layers it captures (every layer, or only its own under DP-KFAC),
in its hooks on the training thread, so each one delays everything after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dkfac.dear.gradient_buckets import plan_bucket_sizes
from dkfac.sim.profile import ComputeProfile

#: DDP's first bucket is small (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so the
#: last layers' gradients leave early in the backward pass.
DDP_FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class WorkerPasses:
    """One worker's passes of one step.

    Attributes:
        forward_s: the forward pass (with the statistics it computes).
        backward_s: the backward pass (likewise).
        a_ready_s: per layer, from the forward's start until its ``A`` statistic is complete.
        g_ready_s: per layer, from the backward's start until its ``G`` statistic is complete.
        grad_ready_s: per layer, from the backward's start until its weight gradient exists.
    """

    forward_s: float
    backward_s: float
    a_ready_s: tuple[float, ...]
    g_ready_s: tuple[float, ...]
    grad_ready_s: tuple[float, ...]


def worker_passes(profile: ComputeProfile, captured: Sequence[bool]) -> WorkerPasses:
    """The passes of a worker that captures the layers ``captured`` says (none: plain)."""
    layers = profile.layers
    a_cost = [layer.a_statistic_s if c else 0.0 for layer, c in zip(layers, captured, strict=True)]
    g_cost = [layer.g_statistic_s if c else 0.0 for layer, c in zip(layers, captured, strict=True)]

    def delayed(times: Sequence[float], costs: Sequence[float], at: float) -> float:
        """What the statistics of layers that ran by ``at`` added (their hooks ran before)."""
        return sum(cost for time, cost in zip(times, costs, strict=True) if time <= at)

    outputs = [layer.output_s for layer in layers]
    output_grads = [layer.output_grad_s for layer in layers]
    return WorkerPasses(
        forward_s=profile.forward_s + sum(a_cost),
        backward_s=profile.backward_s + sum(g_cost),
        a_ready_s=tuple(t + delayed(outputs, a_cost, t) for t in outputs),
        g_ready_s=tuple(t + delayed(output_grads, g_cost, t) for t in output_grads),
        grad_ready_s=tuple(
            layer.grad_ready_s + delayed(output_grads, g_cost, layer.grad_ready_s)
            for layer in layers
        ),
    )


def ddp_buckets(
    profile: ComputeProfile, passes: WorkerPasses, cap_bytes: int
) -> list[tuple[float, int]]:
    """DDP's gradient buckets: ``(launch time from the backward's start, bytes)`` each.

    Gradients in reverse layer order fill a bucket until it holds at least its cap (the first
    :data:`DDP_FIRST_BUCKET_BYTES`, the others ``cap_bytes``), as DDP closes its buckets; a
    bucket goes when its last gradient exists. Parameters outside the preconditioned layers
    go with the last bucket, at the end of the backward pass. A layer's weight and bias are
    one tensor here (DDP adds them one by one, so its buckets can close between the two).
    """
    buckets: list[tuple[float, int]] = []
    ready, size, cap = 0.0, 0, min(cap_bytes, DDP_FIRST_BUCKET_BYTES)
    pairs = zip(profile.layers, passes.grad_ready_s, strict=True)
    for layer, grad_ready in reversed(list(pairs)):
        size += layer.grad_bytes
        ready = max(ready, grad_ready)
        if size >= cap:
            buckets.append((ready, size))
            ready, size, cap = 0.0, 0, cap_bytes
    if size or profile.other_grad_bytes or not buckets:
        buckets.append((passes.backward_s, size + profile.other_grad_bytes))
    return buckets


@dataclass(frozen=True)
class DearBucket:
    """One of DeAR's gradient buckets in a simulated step.

    Attributes:
        first_layer: its first layer in forward order: the next forward pass waits for the
            bucket's all-gather (and applies its update) before running that layer.
        launch_s: from the backward's start until its reduce-scatter is launched.
        nbytes: its gradients' bytes.
    """

    first_layer: int
    launch_s: float
    nbytes: int


def dear_buckets(profile: ComputeProfile, passes: WorkerPasses, cap_mb: float) -> list[DearBucket]:
    """DeAR's buckets in forward order (:func:`~dkfac.dear.gradient_buckets.plan_bucket_sizes`).

    A bucket's reduce-scatter is launched once its last gradient exists and every later
    bucket's has been launched (DeAR launches strictly from the last bucket to the first).
    Parameters outside the preconditioned layers, whose place in the forward order a profile
    does not record, are planned as one tensor before the first layer (its bucket is the
    first, capped like the others), ready at the end of the backward pass (as DDP's last
    bucket here). A layer's weight and bias are one tensor (DeAR plans per parameter, so a
    bucket may close between them).
    """
    # Items in forward order: (first layer the next forward reaches, ready, bytes).
    items = [
        (i, passes.grad_ready_s[i], layer.grad_bytes) for i, layer in enumerate(profile.layers)
    ]
    if profile.other_grad_bytes:
        items.insert(0, (0, passes.backward_s, profile.other_grad_bytes))
    plan = plan_bucket_sizes([nbytes for _, _, nbytes in items], cap_mb)
    ready = [max(items[i][1] for i in positions) for positions in plan]
    launches = list(ready)
    for k in reversed(range(len(plan) - 1)):
        launches[k] = max(ready[k], launches[k + 1])
    return [
        DearBucket(items[positions[0]][0], launch, sum(items[i][2] for i in positions))
        for positions, launch in zip(plan, launches, strict=True)
    ]
