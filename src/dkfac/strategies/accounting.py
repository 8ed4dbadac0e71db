"""Dry-run accounting: what each strategy sends, decomposes and holds, from layer shapes alone.

No training, no process group, no factor tensors: a model is a list of :class:`LayerShape`
(``d_A``, ``d_G`` per preconditioned layer). For one *second-order update* (one factor
update, one decomposition, one preconditioning: a step at schedule (1, 1)) and every rank
of a world of ``P``, :func:`account_strategy` returns

* the collectives the strategy issues, in exactly the ``pre.comm_stats()`` format: payload
  ``bytes``, ``calls`` and ``wire_bytes`` per ``"phase/collective"``;
* the decomposition work, ``Σ d³`` over the factors the rank decomposes;
* the bytes of running factors and of decompositions the rank holds.

It runs the strategies' own code, not a model of it: each strategy is built as for a run
(:func:`~dkfac.strategies.distributed_strategy`) and gives its placement, and the
collectives are issued by the strategies' runner
(:class:`~dkfac.strategies.runner.PlacementRunner`: its factor exchange, trace exchange,
decomposition and gradient shares) against a
:class:`~dkfac.comm.recording.RecordingCommunicator`, which fuses and packs by the real
communicator's rules and counts in a real :class:`~dkfac.comm.recorder.StepRecorder`; tensors
are shape-only, so nothing is computed. What a rank holds and decomposes is read from the
placement, as the strategy reads it. ``tests/test_accounting.py`` checks the result against
the analytic byte counts the distributed tests assert on real runs.

Not counted: DDP's gradient allreduce (the same for every strategy; reported separately by
the dry-run report), and one-off collectives (SPD/PAD's re-plan after profiling, cost-model
calibration, and the preconditioner's layer-usage agreement: one maximum-allreduce of
``1 + L`` float64 flags per factor update, only while some layer's forward has never run on
any worker, e.g. every step for a model with ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dkfac.comm.cost_model import ClusterCostModel
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.recording import RecordingCommunicator
from dkfac.comm.wire import element_size
from dkfac.curvature.factor_side import factor_shape, factor_values
from dkfac.strategies import distributed_strategy
from dkfac.strategies.base import Strategy
from dkfac.strategies.decomposition_payload import payload_shapes
from dkfac.strategies.layer_shapes import LayerShape
from dkfac.strategies.pipeline import FactorPipeline
from dkfac.strategies.plan import Placement
from dkfac.strategies.registry import (
    PipelinedOptions,
    option_keywords,
    resolve_options,
    strategy_names,
)
from dkfac.strategies.runner import PlacementRunner

#: Strategies :func:`account_strategy` knows: every distributed one.
ACCOUNTED_STRATEGIES: tuple[str, ...] = strategy_names(distributed=True)


@dataclass(frozen=True)
class DryRunSettings:
    """What the strategies are configured with (the preconditioner's defaults).

    Attributes:
        world_size: number of workers ``P``.
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        factor_dtype: dtype of the running factors and their statistics.
        inv_dtype: dtype of the decompositions.
        grad_dtype: dtype of the parameters' gradients (preconditioned gradients travel in it).
        bucket_cap_mb: largest fused collective in MiB.
        comm_dtype: transport dtype, ``None`` keeps each tensor's.
        cost_model: the cost model SPD/PAD plan with (needed for them only).
        inv_update_steps: the run's steps between decompositions. The accounts are of one
            second-order update all the same; PAD's ``share="auto"`` decides with it.
    """

    world_size: int
    inverse_method: str = "eigen"
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    bucket_cap_mb: float = 25.0
    comm_dtype: torch.dtype | None = None
    cost_model: ClusterCostModel | None = None
    inv_update_steps: int = 1

    @property
    def cap_bytes(self) -> int:
        """The communicator's bucket cap in bytes."""
        return int(self.bucket_cap_mb * 2**20)


@dataclass
class RankAccount:
    """One rank's share of one second-order update.

    Attributes:
        comm: ``pre.comm_stats()`` of the step: ``{"phase/collective": {"bytes", "calls",
            "wire_bytes"}}``.
        decomposition_work: ``Σ d³`` over the factors this rank decomposes.
        factor_bytes: running factors this rank holds (full ``d × d`` matrices).
        inverse_bytes: decompositions this rank holds.
    """

    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    decomposition_work: int = 0
    factor_bytes: int = 0
    inverse_bytes: int = 0

    @property
    def payload_bytes(self) -> int:
        """Payload of every collective this rank takes part in (``comm_stats`` ``bytes``)."""
        return sum(entry["bytes"] for entry in self.comm.values())

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends with bandwidth-optimal collectives (``wire_bytes``)."""
        return sum(entry["wire_bytes"] for entry in self.comm.values())

    @property
    def memory_bytes(self) -> int:
        """Factors plus decompositions held."""
        return self.factor_bytes + self.inverse_bytes


def _inverse_bytes(layer: LayerShape, settings: DryRunSettings) -> int:
    """Bytes of a layer's stored decomposition (its payload's tensors without the flag)."""
    both = [("a", layer.a_dim), ("g", layer.g_dim)]
    *tensors, _flag = payload_shapes(settings.inverse_method, both)
    return sum(math.prod(shape) for shape, _ in tensors) * element_size(settings.inv_dtype)


def _shape_only(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor of ``shape`` that holds no memory (one zero, expanded): read for its shape."""
    return torch.zeros((), dtype=dtype).expand(shape)


def build_strategy(
    strategy: str,
    settings: DryRunSettings,
    *,
    grad_worker_fraction: float = 1.0,
    share: str = "auto",
) -> Strategy:
    """``strategy`` built as for a run, on a recording communicator of the settings' world.

    The strategy is made by :func:`~dkfac.strategies.distributed_strategy` (as
    ``make_strategy`` makes it). ``grad_worker_fraction`` (kaisa) and ``share`` (pad) are
    options of the strategies that have them.

    Raises:
        ValueError: an unknown strategy, a fraction the world size does not allow, or
            spd/pad without a cost model.
    """
    if strategy not in ACCOUNTED_STRATEGIES:
        raise ValueError(
            f"strategy={strategy!r} is not allowed: expected one of "
            f"{', '.join(map(repr, ACCOUNTED_STRATEGIES))}"
        )
    given = {
        "grad_worker_fraction": grad_worker_fraction,
        "cost_model": settings.cost_model,
        "share": share,
    }
    options = resolve_options(strategy, **option_keywords(strategy, **given))
    if isinstance(options, PipelinedOptions) and settings.cost_model is None:
        raise ValueError(f"strategy={strategy!r} needs DryRunSettings.cost_model")
    recorder = StepRecorder(keep_steps=1)
    comm = RecordingCommunicator(
        recorder,
        settings.world_size,
        0,
        bucket_cap_mb=settings.bucket_cap_mb,
        comm_dtype=settings.comm_dtype,
    )
    return distributed_strategy(
        options,
        comm,
        recorder,
        inverse_method=settings.inverse_method,
        inv_dtype=settings.inv_dtype,
        factor_dtype=settings.factor_dtype,
        grad_dtype=settings.grad_dtype,
        inv_update_steps=settings.inv_update_steps,
    )


def plan_strategy(
    strategy: str,
    layers: Sequence[LayerShape],
    settings: DryRunSettings,
    *,
    grad_worker_fraction: float = 1.0,
    share: str = "auto",
) -> Placement:
    """The placement ``strategy`` plans for ``layers`` (:func:`build_strategy`, then ``place``).

    Raises:
        ValueError: as :func:`build_strategy`.
    """
    built = build_strategy(
        strategy, settings, grad_worker_fraction=grad_worker_fraction, share=share
    )
    return built.place([layer.dims for layer in layers])


#: The stages of one step's K-FAC collectives, in the order the preconditioner issues them;
#: the runner waits for each stage's collectives before the next begins.
UPDATE_STAGES: tuple[str, ...] = (
    "hooks",
    "factor_exchange",
    "traces",
    "decompositions",
    "gradients",
)


def issue_update(
    runner: PlacementRunner,
    layers: Sequence[LayerShape],
    settings: DryRunSettings,
    *,
    factors: bool = True,
    decompositions: bool = True,
    hooks: Callable[[FactorPipeline], None] | None = None,
) -> Iterator[str]:
    """Issue one step's collectives of ``runner``, with shape-only tensors, stage by stage.

    The runner's own methods and buffers; only the tensors' contents are missing (nothing is
    computed, every decomposition is "received"). After each stage of :data:`UPDATE_STAGES`
    has issued its collectives, its name is yielded, so a caller can tell them apart (the
    simulator, :mod:`dkfac.sim`). ``factors``: the step updates the factors; ``decompositions``:
    it also decomposes them (a step of schedule (1, 1) does both; others precondition only).
    ``hooks`` hands factors to a hook-driven pipeline as the backward pass would (by default
    nothing is handed over and every factor is sent at ``step()``).
    """
    placement = runner.placement
    cpu, meta = torch.device("cpu"), torch.device("meta")

    def factor_sum(dim: int) -> Tensor:
        return _shape_only(factor_shape(dim), settings.factor_dtype)

    if factors and hooks is not None and runner.pipeline is not None:
        hooks(runner.pipeline)
    yield "hooks"
    if factors and placement.exchange == "step":
        totals = [factor_sum(route.dim) for route in placement.factors]
        runner.send_factor_sums(totals, runner.counts_buffer(cpu))
    elif factors and runner.pipeline is not None:  # what the hooks did not send
        runner.pipeline.finish(lambda slot: factor_sum(slot.dim), profile=False)
    yield "factor_exchange"
    if decompositions and runner.exchanges_traces(settings.inverse_method):
        runner.share_traces(runner.trace_buffer(settings.inv_dtype, meta))
    yield "traces"
    if decompositions:
        runner.share_decompositions(
            runner.decomposition_payloads(settings.inverse_method, settings.inv_dtype, meta, {})
        )
    yield "decompositions"
    grads = [
        torch.empty(layer.g_dim, layer.a_dim, dtype=settings.grad_dtype, device=meta)
        for layer in layers
    ]
    runner.share_gradients(range(len(layers)), grads)
    yield "gradients"


def _record_update(
    runner: PlacementRunner, layers: Sequence[LayerShape], settings: DryRunSettings
) -> None:
    """Issue one second-order update's collectives of ``runner`` (:func:`issue_update`)."""
    for _stage in issue_update(runner, layers, settings):
        continue  # every stage issued in order; the dry run needs no time between them


def account_strategy(
    strategy: str,
    layers: Sequence[LayerShape],
    settings: DryRunSettings,
    *,
    grad_worker_fraction: float = 1.0,
    share: str = "auto",
) -> list[RankAccount]:
    """Per-rank accounts of one second-order update of ``strategy`` on ``layers``.

    ``grad_worker_fraction`` and ``share`` as in :func:`plan_strategy`.

    Raises:
        ValueError: an unknown strategy, a fraction the world size does not allow, or
            spd/pad without a cost model.
    """
    placement = plan_strategy(
        strategy, layers, settings, grad_worker_fraction=grad_worker_fraction, share=share
    )
    accounts = []
    for rank in range(settings.world_size):
        recorder = StepRecorder(keep_steps=1)
        comm = RecordingCommunicator(
            recorder,
            settings.world_size,
            rank,
            bucket_cap_mb=settings.bucket_cap_mb,
            comm_dtype=settings.comm_dtype,
        )
        _record_update(PlacementRunner(placement, rank, recorder, comm), layers, settings)
        recorder.finish_step(0)
        accounts.append(
            RankAccount(
                comm=recorder.comm_stats(),
                decomposition_work=placement.decomposition_work(rank),
                factor_bytes=sum(
                    factor_values(route.dim) * element_size(settings.factor_dtype)
                    for route in placement.factors
                    if placement.holds_factor(route, rank)
                ),
                inverse_bytes=sum(
                    _inverse_bytes(layer, settings)
                    for index, layer in enumerate(layers)
                    if placement.holds_inverse(index, rank)
                ),
            )
        )
    return accounts


def summarize_accounts(accounts: Sequence[RankAccount]) -> dict[str, Any]:
    """Max and mean over ranks of bytes, decomposition work and memory, plus per-rank lists."""

    def stats(values: list[int]) -> dict[str, Any]:
        return {"max": max(values), "mean": sum(values) / len(values), "per_rank": values}

    phases: dict[str, dict[str, int]] = {}
    for account in accounts:
        for key, entry in account.comm.items():
            total = phases.setdefault(key, {"bytes": 0, "calls": 0, "wire_bytes": 0})
            for name in total:
                total[name] = max(total[name], entry[name])
    return {
        "wire_bytes": stats([a.wire_bytes for a in accounts]),
        "payload_bytes": stats([a.payload_bytes for a in accounts]),
        "decomposition_work": stats([a.decomposition_work for a in accounts]),
        "memory_bytes": stats([a.memory_bytes for a in accounts]),
        "factor_bytes": stats([a.factor_bytes for a in accounts]),
        "inverse_bytes": stats([a.inverse_bytes for a in accounts]),
        "comm_max_per_rank": phases,
    }
