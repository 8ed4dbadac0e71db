"""Dry-run accounting: what each strategy sends, decomposes and holds, from layer shapes alone.

No training, no process group, no factor tensors: a model is a list of :class:`LayerShape`
(``d_A``, ``d_G`` per preconditioned layer). For one *second-order update* (one factor
update, one decomposition, one preconditioning: a step at schedule (1, 1)) and every rank
of a world of ``P``, :func:`account_strategy` returns

* the collectives the strategy issues, in exactly the ``pre.comm_stats()`` format: payload
  ``bytes``, ``calls`` and ``wire_bytes`` per ``"phase/collective"``;
* the decomposition work, ``Σ d³`` over the factors the rank decomposes;
* the bytes of running factors and of decompositions the rank holds.

It is the strategies' own accounting, not a model of it: owners come from the same planners
the strategies call (:func:`dkfac.strategies.kaisa.plan_layer_owners`,
:func:`dkfac.strategies.dp.plan_layer_owners`,
:meth:`dkfac.strategies.pipelined.PipelinedStrategy.place_factors`), who sends what to whom
from the same grouping functions (``row_broadcasts``, ``column_sources``, ``group_by_source``,
``broadcast_sources``), payload tensors from the same shape functions, and bytes from the
communicator's own fusion and packing rules (:func:`~dkfac.comm.wire.plan_fusion`,
:func:`~dkfac.comm.wire.record_collective`), recorded in a real
:class:`~dkfac.comm.recorder.StepRecorder`. ``tests/test_accounting.py`` checks the
result against the analytic byte counts the distributed tests assert on real runs.

Not counted: DDP's gradient allreduce (the same for every strategy; reported separately by
the dry-run report), and one-off collectives (SPD/PAD's re-plan after profiling, cost-model
calibration, and the preconditioner's layer-usage agreement: one maximum-allreduce of
``1 + L`` float64 flags per factor update, only while some layer's forward has never run on
any worker, e.g. every step for a model with ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dkfac.comm.cost_model import ClusterCostModel
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.wire import (
    element_size,
    group_by_source,
    plan_fusion,
    record_collective,
)
from dkfac.strategies import dp, kaisa
from dkfac.strategies.decomposition_payload import payload_shapes
from dkfac.strategies.factor_inverses import (
    EVERY_WORKER,
    broadcast_sources,
)
from dkfac.strategies.factor_placement import keeps_factor
from dkfac.strategies.layer_shapes import LayerShape
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.pipelined import PipelinedStrategy
from dkfac.strategies.registry import KAISAOptions, strategy_names
from dkfac.strategies.spd import SPDStrategy

#: Strategies :func:`account_strategy` knows: every distributed one.
ACCOUNTED_STRATEGIES: tuple[str, ...] = strategy_names(distributed=True)


@dataclass(frozen=True)
class DryRunSettings:
    """What the strategies are configured with (the preconditioner's defaults).

    Attributes:
        world_size: number of workers ``P``.
        inverse_method: ``"eigen"`` or ``"inverse"``.
        factor_dtype: dtype of the running factors and their statistics.
        inv_dtype: dtype of the decompositions.
        grad_dtype: dtype of the parameters' gradients (preconditioned gradients travel in it).
        bucket_cap_mb: largest fused collective in MiB.
        comm_dtype: transport dtype, ``None`` keeps each tensor's.
        cost_model: the cost model SPD/PAD plan with (needed for them only).
    """

    world_size: int
    inverse_method: str = "eigen"
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    bucket_cap_mb: float = 25.0
    comm_dtype: torch.dtype | None = None
    cost_model: ClusterCostModel | None = None

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


class _Ledger:
    """A communicator without a process group: fuses, packs and records like the real one."""

    def __init__(self, settings: DryRunSettings) -> None:
        self.settings = settings
        self.recorder = StepRecorder(keep_steps=1)

    def collective(
        self,
        phase: str,
        op: str,
        tensors: Sequence[tuple[tuple[int, ...], bool, torch.dtype]],
        ranks: int,
        exact: bool = False,
    ) -> None:
        """Count the fused collectives of ``tensors`` (shape, symmetric, dtype) over ``ranks``.

        ``exact`` (the float64 counts) ignores ``comm_dtype``, as ``Communicator.allreduce``.
        """
        plan = plan_fusion(
            [shape for shape, _, _ in tensors],
            [dtype for _, _, dtype in tensors],
            [sym for _, sym, _ in tensors],
            self.settings.cap_bytes,
            None if exact else self.settings.comm_dtype,
        )
        for payload in plan:
            record_collective(self.recorder, phase, op, payload.nbytes, ranks)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """What ``pre.comm_stats()`` reports for the recorded step."""
        self.recorder.finish_step(0)
        return self.recorder.comm_stats()


def _values(shapes: Sequence[tuple[tuple[int, ...], bool]]) -> int:
    """Values held by full (unpacked) tensors of ``shapes``."""
    return sum(math.prod(shape) for shape, _ in shapes)


def _inverse_bytes(layer: LayerShape, settings: DryRunSettings) -> int:
    """Bytes of a layer's stored decomposition (the payload tensors without the flag)."""
    *tensors, _ = payload_shapes(settings.inverse_method, _both_factors(layer))
    return _values(tensors) * element_size(settings.inv_dtype)


def _both_factors(layer: LayerShape) -> list[tuple[str, int]]:
    """A layer's two factors as one payload carries them (KAISA's per-layer decomposition)."""
    return [("a", layer.a_dim), ("g", layer.g_dim)]


def _factor_bytes(dim: int, settings: DryRunSettings) -> int:
    return dim * dim * element_size(settings.factor_dtype)


def _grad_tensor(
    layer: LayerShape, settings: DryRunSettings
) -> tuple[tuple[int, ...], bool, torch.dtype]:
    """The ``(d_G, d_A)`` gradient matrix (preconditioned or not) as it travels."""
    return (layer.g_dim, layer.a_dim), False, settings.grad_dtype


def account_kaisa(
    layers: Sequence[LayerShape], settings: DryRunSettings, grad_worker_fraction: float
) -> list[RankAccount]:
    """KAISA (and D-KFAC, fraction 1) per rank: what :class:`~.kaisa.KAISAStrategy` does."""
    world = settings.world_size
    g = KAISAOptions(grad_worker_fraction).grad_workers(world)
    owners = kaisa.plan_layer_owners([layer.dims for layer in layers], world)
    factors = [((dim, dim), True, settings.factor_dtype) for layer in layers for dim in layer.dims]
    accounts = []
    for rank in range(world):
        ledger = _Ledger(settings)
        my_row, my_column = rank // g, rank % g
        # update_factors: the float64 counts alone, then every packed factor, fused.
        ledger.collective(
            "factor_comm", "allreduce", [((2 * len(layers),), False, torch.float64)], world, True
        )
        ledger.collective("factor_comm", "allreduce", factors, world)
        if g > 1:  # a row of one rank has no group: nothing to broadcast
            for _, indices in kaisa.row_broadcasts(owners, g, my_row, world):
                payload = [
                    (shape, sym, settings.inv_dtype)
                    for index in indices
                    for shape, sym in payload_shapes(
                        settings.inverse_method, _both_factors(layers[index])
                    )
                ]
                ledger.collective("inverse_comm", "broadcast", payload, g)
        if world // g > 1:  # a column of one rank has no group: no gradient travels
            sources = kaisa.column_sources(owners, g, my_column)
            for _, indices in group_by_source(sources):
                grads = [_grad_tensor(layers[index], settings) for index in indices]
                ledger.collective("grad_comm", "broadcast", grads, world // g)
        held = [layer for layer, owner in zip(layers, owners, strict=True) if owner // g == my_row]
        accounts.append(
            RankAccount(
                comm=ledger.comm_stats(),
                decomposition_work=sum(
                    layer.a_dim**3 + layer.g_dim**3
                    for layer, owner in zip(layers, owners, strict=True)
                    if owner == rank
                ),
                factor_bytes=sum(
                    _factor_bytes(d, settings) for layer in layers for d in layer.dims
                ),
                inverse_bytes=sum(_inverse_bytes(layer, settings) for layer in held),
            )
        )
    return accounts


def account_dp(layers: Sequence[LayerShape], settings: DryRunSettings) -> list[RankAccount]:
    """DP-KFAC per rank: what :class:`~.dp.DPStrategy` does (no factor traffic)."""
    world = settings.world_size
    owners = dp.plan_layer_owners([layer.dims for layer in layers], world)
    accounts = []
    for rank in range(world):
        ledger = _Ledger(settings)
        for _, indices in group_by_source(owners):  # Communicator.broadcast_from
            grads = [_grad_tensor(layers[index], settings) for index in indices]
            ledger.collective("grad_comm", "broadcast", grads, world)
        mine = [layer for layer, owner in zip(layers, owners, strict=True) if owner == rank]
        accounts.append(
            RankAccount(
                comm=ledger.comm_stats(),
                decomposition_work=sum(layer.a_dim**3 + layer.g_dim**3 for layer in mine),
                factor_bytes=sum(_factor_bytes(d, settings) for layer in mine for d in layer.dims),
                inverse_bytes=sum(_inverse_bytes(layer, settings) for layer in mine),
            )
        )
    return accounts


def account_pipelined(
    strategy: type[PipelinedStrategy], layers: Sequence[LayerShape], settings: DryRunSettings
) -> list[RankAccount]:
    """SPD-KFAC or PAD-KFAC per rank, with the size-first fusion plan.

    The alpha-beta re-plan after profiling moves bucket boundaries only: the same payload,
    in more or fewer calls (``wire_bytes`` may differ by rounding, under a byte per call).
    """
    if settings.cost_model is None:
        raise ValueError(f"strategy={strategy.name!r} needs DryRunSettings.cost_model")
    world = settings.world_size
    placement = strategy.place_factors(
        [layer.dims for layer in layers],
        world,
        settings.cost_model,
        inverse_method=settings.inverse_method,
        inv_dtype=settings.inv_dtype,
        factor_dtype=settings.comm_dtype or settings.factor_dtype,
        cap_bytes=settings.cap_bytes,
    )
    slots = placement.costs.slots
    owners = {
        (slot.layer, slot.side): owner
        for slot, owner in zip(slots, placement.decomposer, strict=True)
    }
    accounts = []
    for rank in range(world):
        ledger = _Ledger(settings)
        for bucket in placement.buckets:  # FactorPipeline: one collective per planned bucket
            destination = placement.destination[bucket[0]]
            factors = [((slots[i].dim, slots[i].dim), True, settings.factor_dtype) for i in bucket]
            op = "allreduce" if destination is None else "reduce"
            ledger.collective("factor_comm", op, factors, world)
        # The counts: one per slot and the late-statistics marker (FactorPipeline.finish).
        ledger.collective(
            "factor_comm", "allreduce", [((len(slots) + 1,), False, torch.float64)], world, True
        )
        if settings.inverse_method == "inverse" and not strategy.factors_everywhere:
            # The owners exchange tr(F)/d for the factored Tikhonov damping.
            ledger.collective(
                "inverse_comm", "allreduce", [((len(layers), 2), False, settings.inv_dtype)], world
            )
        for _, keys in broadcast_sources(owners, world):
            payload = [
                (shape, sym, settings.inv_dtype)
                for index, side in keys
                for shape, sym in payload_shapes(
                    settings.inverse_method,
                    [(side, layers[index].a_dim if side == "a" else layers[index].g_dim)],
                )
            ]
            ledger.collective("inverse_comm", "broadcast", payload, world)
        accounts.append(
            RankAccount(
                comm=ledger.comm_stats(),
                decomposition_work=sum(
                    slot.dim**3
                    for slot, owner in zip(slots, placement.decomposer, strict=True)
                    if owner in (rank, EVERY_WORKER)
                ),
                factor_bytes=sum(
                    _factor_bytes(slot.dim, settings)
                    for slot, destination in zip(slots, placement.destination, strict=True)
                    if keeps_factor(destination, rank)
                ),
                # Every rank rebuilds every layer's inverse from the broadcast factors.
                inverse_bytes=sum(_inverse_bytes(layer, settings) for layer in layers),
            )
        )
    return accounts


def account_strategy(
    strategy: str,
    layers: Sequence[LayerShape],
    settings: DryRunSettings,
    *,
    grad_worker_fraction: float = 1.0,
) -> list[RankAccount]:
    """Per-rank accounts of one second-order update of ``strategy`` on ``layers``.

    Raises:
        ValueError: an unknown strategy, a fraction the world size does not allow, or
            spd/pad without a cost model.
    """
    if strategy == "dkfac":
        return account_kaisa(layers, settings, 1.0)
    if strategy == "kaisa":
        return account_kaisa(layers, settings, grad_worker_fraction)
    if strategy == "dp":
        return account_dp(layers, settings)
    if strategy == SPDStrategy.name:
        return account_pipelined(SPDStrategy, layers, settings)
    if strategy == PADStrategy.name:
        return account_pipelined(PADStrategy, layers, settings)
    raise ValueError(
        f"strategy={strategy!r} is not allowed: expected one of "
        f"{', '.join(map(repr, ACCOUNTED_STRATEGIES))}"
    )


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
