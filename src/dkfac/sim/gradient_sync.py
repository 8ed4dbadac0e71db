"""How a simulated step averages its gradients: DDP's allreduce buckets or DeAR's two halves.

* DDP: each bucket's allreduce is launched from the backward pass (:func:`ddp_buckets`) and
  the backward pass returns once all of them are done.
* DeAR (:class:`dkfac.DeAR`, docs/dear.md): each bucket's reduce-scatter is launched from the
  backward pass (:func:`dear_buckets`), and ``dear.step()`` waits for them and launches the
  all-gathers, first bucket first. Without K-FAC the all-gathers travel under the *next*
  forward pass, which waits for a bucket's all-gather and applies the bucket's optimizer update
  just before the bucket's first layer: the step is simulated in its steady state, with the
  previous step's all-gathers issued when it starts. With K-FAC the averaged gradients are
  needed before preconditioning (``dear.gather_gradients()``): the all-gathers are launched
  once the reduce-scatters are done and waited for at once, a stage of their own, and the
  update is applied at the end of the step.

DDP's buckets and DeAR's travel on a process group of their own (DeAR makes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dkfac.sim.link_schedule import LinkSchedule, ScheduledCollective, Stage
from dkfac.sim.passes import DearBucket, WorkerPasses, ddp_buckets, dear_buckets
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import GATHER_STAGE, SimulatedCluster, SimulatedRun


@dataclass
class GradientSync:
    """What the gradient averaging adds to a simulated step.

    Attributes:
        collectives: launched from the forward and backward passes (their issue times set);
            a worker waits for them before the passes' stage ends (DDP: the backward pass
            returns once they are done; DeAR: ``dear.step()`` or ``gather_gradients()``).
        passes_s: per worker, its forward and backward passes as the averaging delays them
            (DeAR without K-FAC: the waits for last step's all-gathers and the updates).
        stages: stages of its own after the passes (DeAR with K-FAC: the all-gathers).
        optimizer_in_passes: whether the optimizer's time is inside ``passes_s``.
    """

    collectives: list[ScheduledCollective]
    passes_s: list[float]
    stages: list[Stage] = field(default_factory=list)
    optimizer_in_passes: bool = False


def gradient_sync(
    profile: ComputeProfile,
    cluster: SimulatedCluster,
    run: SimulatedRun,
    passes: Sequence[WorkerPasses],
    network: LinkSchedule,
    *,
    kfac: bool,
) -> GradientSync:
    """The averaging of ``run`` (its ``gradient_sync``) for workers with these passes.

    DeAR without K-FAC runs the previous step's all-gathers on ``network`` first.
    """
    if run.gradient_sync != "dear":
        return _ddp(profile, cluster, passes)
    everyone = tuple(range(cluster.world_size))
    buckets = [dear_buckets(profile, worker, run.dear_bucket_cap_mb) for worker in passes]
    first = buckets[0]

    def gathers(issued: dict[int, float]) -> list[ScheduledCollective]:
        return [
            ScheduledCollective("all_gather", b.nbytes, everyone, None, ("dear",), dict(issued))
            for b in first
        ]

    forward = [w.forward_s for w in passes]
    if not kfac:
        last_step = gathers({rank: 0.0 for rank in everyone})
        done = network.run(last_step)
        forward = [_forward_waiting(worker, first, done, profile.optimizer_s) for worker in passes]
    # Issued last bucket first; the lane keeps that order.
    scatters = [
        ScheduledCollective(
            "reduce_scatter",
            bucket.nbytes,
            everyone,
            None,
            ("dear",),
            {rank: forward[rank] + buckets[rank][k].launch_s for rank in everyone},
        )
        for k, bucket in reversed(list(enumerate(first)))
    ]
    if min(min(c.issued.values()) for c in scatters) < network.now:
        # The link schedule starts what was issued before its clock at its clock: the
        # previous step's all-gathers must be done before this step's first collective.
        raise RuntimeError("a reduce-scatter was issued before last step's all-gathers ended")
    passes_s = [f + w.backward_s for f, w in zip(forward, passes, strict=True)]
    if not kfac:
        return GradientSync(scatters, passes_s, optimizer_in_passes=True)
    nothing = [0.0] * len(everyone)
    at_the_stage = gathers({})  # issued by each worker when it reaches the stage
    gather = Stage(GATHER_STAGE, at_the_stage, at_the_stage, nothing, nothing)
    return GradientSync(scatters, passes_s, [gather])


def _ddp(
    profile: ComputeProfile, cluster: SimulatedCluster, passes: Sequence[WorkerPasses]
) -> GradientSync:
    """DDP's allreduce buckets (:func:`ddp_buckets`), launched from the backward pass."""
    everyone = tuple(range(cluster.world_size))
    cap = int(cluster.ddp_bucket_cap_mb * 2**20)
    buckets = [ddp_buckets(profile, worker, cap) for worker in passes]
    allreduces = [
        ScheduledCollective(
            "allreduce",
            size,
            everyone,
            None,
            ("ddp",),
            {rank: passes[rank].forward_s + buckets[rank][k][0] for rank in everyone},
        )
        for k, (_, size) in enumerate(buckets[0])
    ]
    return GradientSync(allreduces, [w.forward_s + w.backward_s for w in passes])


def _forward_waiting(
    passes: WorkerPasses,
    buckets: Sequence[DearBucket],
    gathered: Sequence[float],
    optimizer_s: float,
) -> float:
    """The forward pass when each bucket waits for its all-gather and applies its update.

    A layer starts when the previous one's output exists; before a bucket's first layer the
    pass waits until the bucket's all-gather (completing at ``gathered``) is done, then
    applies the bucket's share of the optimizer step (by bytes; equal shares without bytes).
    """
    total = sum(bucket.nbytes for bucket in buckets)
    delay = 0.0
    for bucket, done in zip(buckets, gathered, strict=True):
        layer = bucket.first_layer
        start = passes.a_ready_s[layer - 1] if layer > 0 else 0.0
        share = bucket.nbytes / total if total else 1.0 / len(buckets)
        delay = max(start + delay, done) - start + optimizer_s * share
    return passes.forward_s + delay
