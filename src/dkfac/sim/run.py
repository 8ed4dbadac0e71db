"""What the simulator is asked and what it answers: the cluster, the run, the predictions."""

from __future__ import annotations

from dataclasses import dataclass, field

from dkfac.sim.network import LinkModel

#: The first-order baseline: DDP's gradient allreduce and the optimizer, no K-FAC.
SGD = "sgd"

#: How a simulated run averages its gradients (:attr:`SimulatedRun.gradient_sync`).
GRADIENT_SYNCS: tuple[str, ...] = ("ddp", "dear")

#: The stage in which DeAR's all-gathers complete when K-FAC needs the gradients at once.
GATHER_STAGE = "gradient_gather"

#: Stage spans a :class:`StepPrediction` reports, in order.
STAGE_NAMES: tuple[str, ...] = (
    "forward_backward",
    GATHER_STAGE,
    "factor_exchange",
    "traces",
    "decompositions",
    "gradients",
    "optimizer",
)


@dataclass(frozen=True)
class SimulatedCluster:
    """The workers and their network.

    Attributes:
        world_size: number of workers ``P``.
        link: each worker's link.
        backend: ``"nccl"`` or ``"gloo"``; it decides how a reduce at two ranks travels
            (:func:`~dkfac.comm.direct_reduce.reduces_by_sending`).
        bucket_cap_mb: K-FAC's fused-collective cap (the communicator's).
        ddp_bucket_cap_mb: DDP's ``bucket_cap_mb`` (its gradient buckets after the first;
            a run averaging with DeAR has its own, :attr:`SimulatedRun.dear_bucket_cap_mb`).
    """

    world_size: int
    link: LinkModel
    backend: str = "nccl"
    bucket_cap_mb: float = 25.0
    ddp_bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"a simulated cluster needs at least 2 workers, got {self.world_size}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")


@dataclass(frozen=True)
class SimulatedRun:
    """What is trained: the strategy and its options, and the K-FAC schedule.

    Attributes:
        strategy: :data:`SGD` or a distributed K-FAC strategy (``"dkfac"``, ``"kaisa"``...).
        grad_worker_fraction: KAISA's fraction.
        share: PAD's ``share``.
        factor_update_steps: steps between factor updates.
        inv_update_steps: steps between decompositions (a multiple of the former).
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        comm_dtype: the preconditioner's ``comm_dtype`` (``"float16"``, ``"bfloat16"``): what
            K-FAC's collectives carry; ``None``: each tensor's own dtype.
        gradient_sync: how gradients are averaged: ``"ddp"`` (allreduce buckets) or
            ``"dear"`` (:class:`dkfac.DeAR`: reduce-scatters under the backward pass,
            all-gathers under the next forward pass, or at once when K-FAC needs them).
        dear_bucket_cap_mb: DeAR's bucket cap in MiB (what its ``"auto"`` search settled on,
            when it searched).
    """

    strategy: str
    grad_worker_fraction: float = 1.0
    share: str = "auto"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    inverse_method: str = "eigen"
    comm_dtype: str | None = None
    gradient_sync: str = "ddp"
    dear_bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if self.gradient_sync not in GRADIENT_SYNCS:
            raise ValueError(
                f"gradient_sync={self.gradient_sync!r}: expected one of {', '.join(GRADIENT_SYNCS)}"
            )
        if not self.dear_bucket_cap_mb > 0:
            raise ValueError(f"dear_bucket_cap_mb must be positive, got {self.dear_bucket_cap_mb}")
        if self.comm_dtype not in (None, "float16", "bfloat16", "float32"):
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r}: expected float16, bfloat16 or float32"
            )
        f, i = self.factor_update_steps, self.inv_update_steps
        if f < 1 or i < f or i % f:
            raise ValueError(
                f"inv_update_steps ({i}) must be a positive multiple of factor_update_steps ({f})"
            )

    @property
    def label(self) -> str:
        """A short row name: the strategy, its option, its schedule."""
        sync = " dear" if self.gradient_sync == "dear" else ""
        if self.strategy == SGD:
            return SGD + sync
        option = ""
        if self.strategy == "kaisa":
            option = f" f={self.grad_worker_fraction:g}"
        elif self.strategy == "pad":
            option = f" {self.share}"
        if self.comm_dtype is not None:
            option += f" {self.comm_dtype}"
        schedule = f"({self.factor_update_steps},{self.inv_update_steps})"
        return f"{self.strategy}{option}{sync} {schedule}"

    def step_kinds(self) -> list[tuple[str, float, bool, bool]]:
        """``(kind, share of steps, updates factors, decomposes)`` of the schedule's steps."""
        if self.strategy == SGD:
            return [("sgd", 1.0, False, False)]
        f, i = self.factor_update_steps, self.inv_update_steps
        kinds = [("decomposition", 1.0 / i, True, True)]
        if f < i:
            kinds.append(("factor", 1.0 / f - 1.0 / i, True, False))
        if f > 1:
            kinds.append(("precondition", 1.0 - 1.0 / f, False, False))
        return kinds


@dataclass
class StepPrediction:
    """One kind of step: its time (slowest worker) and each stage's span.

    Attributes:
        kind: ``"decomposition"``, ``"factor"``, ``"precondition"`` or ``"sgd"``.
        share: the share of the schedule's steps that are of this kind.
        seconds: from the start of the forward pass to the end of the optimizer step,
            on the slowest worker.
        stages: per stage of :data:`STAGE_NAMES`, the longest span over workers.
        wire_bytes: bytes the busiest worker sends (DDP's included).
    """

    kind: str
    share: float
    seconds: float
    stages: dict[str, float] = field(default_factory=dict)
    wire_bytes: float = 0.0


@dataclass
class Prediction:
    """A run's predicted time per iteration, averaged over its schedule's kinds of step."""

    run: SimulatedRun
    steps: list[StepPrediction]

    @property
    def iteration_s(self) -> float:
        """Mean time per iteration over the schedule."""
        return sum(step.share * step.seconds for step in self.steps)
