"""One training step on a simulated cluster: every worker's compute, collectives and waits.

The collectives are not modelled: each worker's are issued by the strategies' own runner
(:func:`dkfac.strategies.accounting.issue_update`, the dry run's code) against a recording
communicator, which fuses and packs by the real communicator's rules; a hook-driven strategy's
factors are handed to its real :class:`~dkfac.strategies.pipeline.FactorPipeline` at the times
the :class:`~dkfac.sim.profile.ComputeProfile` says their statistics are complete, so its
buckets launch when they would. What is modelled is time:

* compute, per worker: the forward and backward pass, folding the factors it keeps, its
  decompositions, preconditioning the layers whose decompositions it holds, the optimizer;
* the network (:mod:`dkfac.sim.network`): a collective starts when every member has issued it,
  a worker of its process group's backend is free (each group's collectives start in issue
  order, on NCCL's one stream or gloo's two threads) and the uplinks it loads are free; it
  then holds those uplinks for its duration;
* waits, as the preconditioner has them: the backward pass returns once DDP's gradient
  allreduce is done; each stage of :data:`~dkfac.strategies.accounting.UPDATE_STAGES` waits
  for its collectives before the next begins.

DDP's gradient buckets (:func:`~dkfac.sim.passes.ddp_buckets`) travel on a process group of
their own. Each worker's passes (:func:`~dkfac.sim.passes.worker_passes`) include the
statistics of the layers the placement has it capture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from dkfac.comm.cost_model import ClusterCostModel
from dkfac.comm.direct_reduce import reduces_by_sending
from dkfac.comm.lanes import Lanes
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.recording import IssuedCollective, RecordingCommunicator
from dkfac.curvature.factor_side import factor_shape, factor_values
from dkfac.sim.gradient_sync import gradient_sync
from dkfac.sim.link_schedule import LinkSchedule, ScheduledCollective, Stage
from dkfac.sim.passes import WorkerPasses, worker_passes
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import SGD, Prediction, SimulatedCluster, SimulatedRun, StepPrediction
from dkfac.strategies.accounting import (
    UPDATE_STAGES,
    DryRunSettings,
    build_strategy,
    issue_update,
)
from dkfac.strategies.pipeline import FactorPipeline
from dkfac.strategies.pipelined import PipelinedStrategy
from dkfac.strategies.plan import Placement
from dkfac.strategies.runner import PlacementRunner


def cost_model_of(
    profile: ComputeProfile, cluster: SimulatedCluster, method: str
) -> ClusterCostModel:
    """The cost model SPD/PAD would measure on this cluster with this compute."""
    return ClusterCostModel(
        cluster.link.allreduce_fit(cluster.world_size), profile.decomposition_cost(method)
    )


def settings_of(
    profile: ComputeProfile, cluster: SimulatedCluster, run: SimulatedRun
) -> DryRunSettings:
    """The strategies' configuration for the simulated run (the preconditioner's defaults)."""
    return DryRunSettings(
        world_size=cluster.world_size,
        inverse_method=run.inverse_method,
        bucket_cap_mb=cluster.bucket_cap_mb,
        cost_model=cost_model_of(profile, cluster, run.inverse_method),
        inv_update_steps=run.inv_update_steps,
        comm_dtype=None if run.comm_dtype is None else getattr(torch, run.comm_dtype),
    )


def simulate(profile: ComputeProfile, cluster: SimulatedCluster, run: SimulatedRun) -> Prediction:
    """Predict ``run``'s time per iteration on ``cluster`` with ``profile``'s compute.

    Raises:
        ValueError: an unknown strategy, or options it does not allow at this world size.
    """
    placement = None
    if run.strategy != SGD:
        built = build_strategy(
            run.strategy,
            settings_of(profile, cluster, run),
            grad_worker_fraction=run.grad_worker_fraction,
            share=run.share,
        )
        placement = built.place([layer.dims for layer in profile.shapes])
        if isinstance(built, PipelinedStrategy) and placement.exchange == "hooks":
            placement = _fused_by_ready(profile, built, placement)
    steps = [
        _simulate_step(profile, cluster, run, placement, kind, share, factors, decompositions)
        for kind, share, factors, decompositions in run.step_kinds()
    ]
    return Prediction(run, steps)


def _fused_by_ready(
    profile: ComputeProfile, strategy: PipelinedStrategy, placement: Placement
) -> Placement:
    """SPD/PAD's fusion plan after profiling: alpha-beta merged at the predicted ready times.

    Each slot's ready time is the latest over the workers of when its statistics are
    complete in a factor step (the strategy agrees the measured medians by their maximum).
    """
    ranks = range(strategy.world_size)
    layers = range(len(profile.layers))
    passes = [worker_passes(profile, [placement.captures(i, r) for i in layers]) for r in ranks]
    ready = [
        max(
            w.a_ready_s[route.layer]
            if route.side == "a"
            else w.forward_s + w.g_ready_s[route.layer]
            for w in passes
        )
        for route in placement.factors
    ]
    dims = [layer.dims for layer in profile.shapes]
    buckets = strategy.fusion_for_ready(strategy.plan_factors(dims), ready)
    return dataclasses.replace(placement, buckets=tuple(tuple(b) for b in buckets))


def _hand_over(
    comm: RecordingCommunicator, passes: WorkerPasses, dtype: torch.dtype
) -> Callable[[FactorPipeline], None]:
    """Hand every factor to a pipeline in ready order, the clock at its ready time."""
    ready: dict[tuple[int, str], float] = {}
    for layer, (a, g) in enumerate(zip(passes.a_ready_s, passes.g_ready_s, strict=True)):
        ready[(layer, "a")], ready[(layer, "g")] = a, passes.forward_s + g

    def hooks(pipeline: FactorPipeline) -> None:
        for slot in sorted(pipeline.slots, key=lambda s: ready[(s.layer, s.side)]):
            comm.clock = ready[(slot.layer, slot.side)]
            total = torch.zeros((), dtype=dtype).expand(factor_shape(slot.dim))
            pipeline.ready(slot.layer, slot.side, total, 1)

    return hooks


def _simulate_step(
    profile: ComputeProfile,
    cluster: SimulatedCluster,
    run: SimulatedRun,
    placement: Placement | None,
    kind: str,
    share: float,
    factors: bool,
    decompositions: bool,
) -> StepPrediction:
    world = cluster.world_size
    everyone = tuple(range(world))
    network = LinkSchedule(cluster)
    stages: dict[str, float] = {}
    layer_count = len(profile.layers)
    passes = [
        worker_passes(
            profile,
            [
                factors and placement is not None and placement.captures(layer, rank)
                for layer in range(layer_count)
            ],
        )
        for rank in everyone
    ]

    issued: list[list[IssuedCollective]] = [[] for _ in everyone]
    stage_runs: list[tuple[RecordingCommunicator, Iterator[str]]] = []
    if placement is not None:
        settings = settings_of(profile, cluster, run)
        for rank in everyone:
            comm = RecordingCommunicator(
                StepRecorder(keep_steps=1),
                world,
                rank,
                bucket_cap_mb=cluster.bucket_cap_mb,
                comm_dtype=settings.comm_dtype,
                issued=issued[rank],
            )
            runner = PlacementRunner(placement, rank, comm.recorder, comm)
            hooks = _hand_over(comm, passes[rank], settings.factor_dtype)
            stage_runs.append(
                (
                    comm,
                    issue_update(
                        runner,
                        profile.shapes,
                        settings,
                        factors=factors,
                        decompositions=decompositions,
                        hooks=hooks,
                    ),
                )
            )
    lanes = _lanes(placement, cluster)
    nothing = [0.0] * world
    hooked = _next_stage(stage_runs, issued, lanes, "hooks") if placement is not None else []
    # Forward and backward: the gradient buckets (and a hook-driven strategy's factors)
    # launch. The hooks pack their buckets on the training thread, which delays the passes;
    # the backward pass returns once DDP's allreduce is done (DeAR: its reduce-scatters).
    sync = gradient_sync(profile, cluster, run, passes, network, kfac=placement is not None)
    hooked_pack = _packing(profile, hooked, everyone)
    program = [
        Stage(
            "forward_backward",
            [*sync.collectives, *hooked],
            sync.collectives,
            [p + pack for p, pack in zip(sync.passes_s, hooked_pack, strict=True)],
            nothing,
        ),
        *sync.stages,
    ]
    if placement is not None:
        compute = _RankCompute(profile, placement, run.inverse_method)
        before: dict[str, Callable[[int], float]] = {
            "decompositions": compute.decompose if decompositions else _nothing,
            "gradients": compute.precondition,
        }
        after: dict[str, Callable[[int], float]] = {
            "factor_exchange": compute.fold if factors else _nothing,
        }
        for name in UPDATE_STAGES[1:]:
            collectives = _next_stage(stage_runs, issued, lanes, name)
            packing = _packing(profile, collectives, everyone)
            waits = [*collectives, *hooked] if name == "factor_exchange" else collectives
            program.append(
                Stage(
                    name,
                    collectives,
                    waits,
                    [before.get(name, _nothing)(r) for r in everyone],
                    [after.get(name, _nothing)(r) + packing[r] for r in everyone],
                )
            )
    ends = network.run_stages(program, nothing)
    starts = nothing
    for stage, stage_ends in zip(program, ends, strict=True):
        stages[stage.name] = max(end - begun for end, begun in zip(stage_ends, starts, strict=True))
        starts = stage_ends
    # DeAR without K-FAC applies the update inside the next forward pass (in its passes).
    optimizer_s = 0.0 if sync.optimizer_in_passes else profile.optimizer_s
    stages["optimizer"] = optimizer_s
    seconds = max(ends[-1]) + optimizer_s
    return StepPrediction(kind, share, seconds, stages, max(network.sent))


def _nothing(rank: int) -> float:
    """No compute."""
    return 0.0


def _packing(
    profile: ComputeProfile, collectives: Sequence[ScheduledCollective], ranks: Sequence[int]
) -> list[float]:
    """Per rank, packing and unpacking the buckets of ``collectives`` it takes part in."""
    spent = [0.0] * len(ranks)
    for collective in collectives:
        for member in collective.members:
            spent[member] += profile.pack_s(collective.nbytes)
    return spent


def _lanes(placement: Placement | None, cluster: SimulatedCluster) -> Lanes[tuple[object, ...]]:
    """The lanes the runner's communicator opens on this cluster (:meth:`~Communicator.open_lanes`).

    A lane is named by its group's members, plus its root for a group of its own.
    """
    world = tuple(range(cluster.world_size))
    lanes: Lanes[tuple[object, ...]] = Lanes((world,))
    if placement is not None and reduces_by_sending(cluster.backend, cluster.world_size):
        lanes.open(placement.roots(world), lambda: (world, len(lanes)))
    return lanes


def _next_stage(
    stage_runs: Sequence[tuple[RecordingCommunicator, Iterator[str]]],
    issued: list[list[IssuedCollective]],
    lanes: Lanes[tuple[object, ...]],
    name: str,
) -> list[ScheduledCollective]:
    """Advance every worker's runner to the end of stage ``name``; match what they issued.

    A collective issued from a hook keeps its own time (the clock at its hand-over); the
    others' times are left NaN, set when the worker reaches the stage (:class:`Stage`). The
    ``k``-th collective on a lane is the same
    collective on every member (backends match them in issue order). Reduces and broadcasts
    over the whole world travel on their root's lane.
    """
    world = tuple(range(len(stage_runs)))
    matched: dict[tuple[tuple[object, ...], int], ScheduledCollective] = {}
    order: list[tuple[tuple[object, ...], int]] = []
    for rank, (comm, stages) in enumerate(stage_runs):
        before = len(issued[rank])
        comm.clock = float("nan")  # set by the hooks only
        reached = next(stages, None)
        if reached != name:
            raise RuntimeError(f"rank {rank}'s runner reached stage {reached!r}, not {name!r}")
        counts: dict[tuple[object, ...], int] = {}
        for entry in issued[rank][before:]:
            members = entry.group or world
            lane: tuple[object, ...] = (members,)
            if entry.op in ("reduce", "broadcast") and members == world:
                assert entry.root is not None
                lane = lanes.route(entry.root)
            k = counts.get(lane, 0)
            counts[lane] = k + 1
            key = (lane, k)
            if key not in matched:
                matched[key] = ScheduledCollective(
                    entry.op, entry.nbytes, members, entry.root, lane
                )
                order.append(key)
            collective = matched[key]
            if (collective.op, collective.nbytes, collective.root) != (
                entry.op,
                entry.nbytes,
                entry.root,
            ):
                raise RuntimeError(
                    f"rank {rank} issued {entry.op} of {entry.nbytes} bytes where another "
                    f"member issued {collective.op} of {collective.nbytes}: the ranks' "
                    "collectives do not match"
                )
            collective.issued[rank] = entry.issued_at  # NaN unless a hook issued it
    return [matched[key] for key in order]


class _RankCompute:
    """Each worker's share of the step's K-FAC compute, as the placement assigns it."""

    def __init__(self, profile: ComputeProfile, placement: Placement, method: str) -> None:
        self.profile = profile
        self.placement = placement
        self.cost = profile.decomposition_cost(method)
        self._all_values = sum(factor_values(route.dim) for route in placement.factors)

    def fold(self, rank: int) -> float:
        """Folding the factors ``rank`` keeps into their running averages."""
        kept = sum(
            factor_values(route.dim)
            for route in self.placement.factors
            if self.placement.holds_factor(route, rank)
        )
        return self.profile.factor_update_s * kept / self._all_values

    def decompose(self, rank: int) -> float:
        """Decomposing the factors ``rank`` decomposes."""
        return sum(
            self.cost.seconds(route.dim)
            for route in self.placement.factors
            if self.placement.decomposes(route, rank)
        )

    def precondition(self, rank: int) -> float:
        """Preconditioning the layers whose decompositions ``rank`` holds."""
        return sum(
            layer.precondition_s
            for index, layer in enumerate(self.profile.layers)
            if self.placement.holds_inverse(index, rank)
        )
