"""What SPD-KFAC and PAD-KFAC share.

Hook-launched fused factor communication, per-factor decomposition placement from a
calibrated cost model, and re-planning of the fusion after profiling. Both compute exactly
what D-KFAC computes. A subclass only says where each factor's collective goes (allreduce to
all, or reduce to an owner) and who decomposes each factor.
"""

from __future__ import annotations

import logging
import warnings
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.cost_model import ClusterCostModel, CostModelCache
from dkfac.comm.fusion import (
    plan_buckets_alpha_beta,
    plan_buckets_by_size,
    predict_timeline,
)
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import DistributedStrategy
from dkfac.strategies.factor_inverses import EVERY_WORKER, FactorKey, update_factor_inverses
from dkfac.strategies.factor_placement import (
    FactorPlacement,
    SlotCosts,
    destination_boundaries,
    keeps_factor,
)
from dkfac.strategies.local import precondition_here
from dkfac.strategies.pipeline import FactorPipeline, ready_order_of

logger = logging.getLogger(__name__)


class PipelinedStrategy(DistributedStrategy):
    """Factor collectives launched from the hooks; factors decomposed where the plan says.

    Args:
        comm: communicator on a process group of its own (see :mod:`.pipeline`).
        recorder: accounting.
        inverse_method: the preconditioner's method (the cost model times it).
        inv_dtype: dtype of the decompositions.
        cost_model: the cluster's measured costs; a :class:`CostModelCache` to take them from
            (measured there on first use, then reused by later strategies); ``None`` measures
            them in :meth:`setup`.
        profile_steps: factor-update windows whose ready times are measured before the
            fusion plan is re-planned with the alpha-beta merge rule (0: keep the size plan).
    """

    #: Every rank keeps every running factor (SPD) or only its own (PAD).
    factors_everywhere: bool = True

    def __init__(
        self,
        comm: Communicator,
        recorder: StepRecorder,
        *,
        inverse_method: str = "eigen",
        inv_dtype: torch.dtype = torch.float32,
        cost_model: ClusterCostModel | CostModelCache | None = None,
        profile_steps: int = 5,
    ) -> None:
        self.comm = comm
        self.recorder = recorder
        self.inverse_method = inverse_method
        self.inv_dtype = inv_dtype
        self.cost: ClusterCostModel | None = (
            cost_model if isinstance(cost_model, ClusterCostModel) else None
        )
        self._cost_cache = cost_model if isinstance(cost_model, CostModelCache) else None
        self.profile_steps = profile_steps
        self.factor_steps = 0
        self.layers: list[LayerCurvature] = []
        self.measured_ready: list[float] | None = None

    # -- planning ----------------------------------------------------------------------------
    def setup(self, layers: Sequence[LayerCurvature], *, accumulation_steps: int = 1) -> None:
        """Measure the cluster (unless given or cached), place the factors, plan by size.

        A factor is handed to the pipeline when its statistics of the window are complete:
        at first after ``accumulation_steps`` statistics, then after as many as the previous
        window had (a layer that runs several times per pass has several per pass).
        """
        self.layers = list(layers)
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        if self.cost is None:
            cache = self._cost_cache or CostModelCache()
            device = self.layers[0].block.weight.device
            largest = max(max(layer.block.a_dim, layer.block.g_dim) for layer in self.layers)
            self.cost = cache.get(
                self.inverse_method, self.inv_dtype, device, self.comm.group, largest_dim=largest
            )
            logger.info("%s: cost model %s", self.name, self.cost.as_dict())
        self.cost_problems = self.cost.problems()
        if self.cost_problems:
            message = (
                f"strategy={self.name!r}: the cost model cannot be planned with "
                f"({'; '.join(self.cost_problems)}); factors are placed by size (d³) and the "
                "fusion stays planned by size"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        placement = self.place_factors(
            [(layer.block.a_dim, layer.block.g_dim) for layer in self.layers],
            self.comm.world_size,
            self.cost,
            inverse_method=self.inverse_method,
            inv_dtype=self.inv_dtype,
            factor_dtype=self.comm.comm_dtype or self.layers[0].factor_dtype,
            cap_bytes=self.comm.bucket_cap_bytes,
        )
        self.slots = placement.costs.slots
        self.wire = placement.costs.wire
        self.decomposition_s = placement.costs.decomposition_s
        self.destination = placement.destination
        self.decomposer = placement.decomposer
        self._slot_of = {(slot.layer, slot.side): i for i, slot in enumerate(self.slots)}
        self.expected_updates = [accumulation_steps] * len(self.slots)
        self.pipeline = FactorPipeline(
            self.comm,
            self.recorder,
            self.slots,
            placement.buckets,
            [self.destination[bucket[0]] for bucket in placement.buckets],
        )

    @classmethod
    def place_factors(
        cls,
        dims: Sequence[tuple[int, int]],
        world_size: int,
        cost: ClusterCostModel,
        *,
        inverse_method: str,
        inv_dtype: torch.dtype,
        factor_dtype: torch.dtype,
        cap_bytes: int,
    ) -> FactorPlacement:
        """The placement and size-first fusion plan of layers ``dims`` (pure: no process group).

        Args:
            dims: ``(d_A, d_G)`` of each layer, in registration order.
            world_size: number of workers.
            cost: the cost model the placement is planned with.
            inverse_method: ``"eigen"`` or ``"inverse"``.
            inv_dtype: dtype of the decompositions.
            factor_dtype: dtype the factors travel in.
            cap_bytes: largest fused collective.
        """
        slots = ready_order_of(dims)
        element = torch.empty((), dtype=factor_dtype).element_size()
        wire = [slot.packed_bytes(element) for slot in slots]
        size_based = bool(cost.problems())
        costs = SlotCosts(
            slots=slots,
            wire=wire,
            decomposition_s=[
                float(slot.dim) ** 3 if size_based else cost.decomposition.seconds(slot.dim)
                for slot in slots
            ],
            cost=cost,
            inverse_method=inverse_method,
            inv_dtype=inv_dtype,
            world_size=world_size,
            size_based=size_based,
        )
        destination = cls.plan_destinations(costs)
        decomposer = cls.plan_decomposers(costs, destination)
        boundaries = destination_boundaries(destination, range(len(slots)))
        buckets = plan_buckets_by_size(wire, cap_bytes, boundaries)
        return FactorPlacement(costs, destination, decomposer, buckets)

    @staticmethod
    @abstractmethod
    def plan_destinations(costs: SlotCosts) -> list[int | None]:
        """Per slot: the rank its factor is reduced to, or ``None`` for an allreduce."""

    @staticmethod
    @abstractmethod
    def plan_decomposers(costs: SlotCosts, destination: Sequence[int | None]) -> list[int]:
        """Per slot: the rank that decomposes the factor, or ``EVERY_WORKER``."""

    def replan_order(self, ready: Sequence[float]) -> list[int]:
        """Slot indices in the order the plan walks them after profiling."""
        return list(range(len(self.slots)))

    def _boundaries(self, order: Sequence[int]) -> list[int]:
        """Positions in ``order`` where the destination changes (a bucket must start)."""
        return destination_boundaries(self.destination, order)

    def _replan(self) -> None:
        """Alpha-beta merge plan from the median ready times, agreed (max) over ranks."""
        assert self.cost is not None
        medians = self.pipeline.median_ready_times()
        device = self.layers[0].block.weight.device
        agreed = torch.tensor(medians, dtype=torch.float64, device=device)
        self.comm.allreduce([agreed], phase="factor_comm", maximum=True, exact=True).wait()
        ready = agreed.tolist()
        order = self.replan_order(ready)
        positions = plan_buckets_alpha_beta(
            [ready[i] for i in order],
            [self.wire[i] for i in order],
            self.cost.collective,
            self.comm.bucket_cap_bytes,
            self._boundaries(order),
        )
        buckets = [[order[p] for p in bucket] for bucket in positions]
        self.pipeline.set_plan(buckets, [self.destination[bucket[0]] for bucket in buckets])
        self.measured_ready = ready
        logger.info(
            "%s: fusion re-planned from %d profiled windows: %d buckets",
            self.name,
            len(self.pipeline.profile),
            len(buckets),
        )

    # -- factors -----------------------------------------------------------------------------
    def statistic_added(self, layer: LayerCurvature, side: str, loss_reduction: str) -> None:
        """Hand the factor to the pipeline once the window's expected statistics are in.

        Statistics that come after the hand-over are not lost: ``update_factors`` sends them
        as an exact correction (:meth:`FactorStatistics.late`).
        """
        index = self._index[id(layer)]
        stats = layer.statistics(side)
        if (
            not stats.handed_over
            and stats.updates == self.expected_updates[self._slot_of[(index, side)]]
        ):
            self._hand_over(index, layer, side, loss_reduction)

    def _hand_over(self, index: int, layer: LayerCurvature, side: str, loss_reduction: str) -> None:
        summed = layer.statistics(side).hand_over(loss_reduction)
        self.pipeline.ready(index, side, summed.total, summed.count)

    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Wait for the factor collectives, correct for late statistics, fold where kept.

        Statistics the hooks did not hand over (fewer than expected this window) go now; the
        pipeline keeps the plan order. Each factor is folded when some worker had statistics
        for it, as under ``strategy="local"``.
        """
        for slot in self.slots:
            layer = self.layers[slot.layer]
            stats = layer.statistics(slot.side)
            if stats.has_statistics and not stats.handed_over:
                self._hand_over(slot.layer, layer, slot.side, loss_reduction)
        late = [
            self.layers[slot.layer].statistics(slot.side).late(loss_reduction)
            for slot in self.slots
        ]
        profile = self.factor_steps < self.profile_steps
        for index, received in enumerate(self.pipeline.finish(self.layers, profile, late)):
            slot = received.slot
            if fold and received.count > 0 and self.keeps(index):
                layer = self.layers[slot.layer]
                layer.fold_factor(slot.side, received.total / received.count, decay)
        for index, slot in enumerate(self.slots):
            # The next window is expected to look like this one (a layer that did not run
            # keeps its expectation).
            updates = self.layers[slot.layer].statistic_updates(slot.side)
            if updates:
                self.expected_updates[index] = updates
        for layer in self.layers:
            layer.clear_statistics()
        self.factor_steps += 1
        if self.profile_steps and self.factor_steps == self.profile_steps:
            if self.cost_problems:  # the merge rule needs alpha and beta
                logger.info("%s: fusion kept by size (no usable cost model)", self.name)
            else:
                self._replan()

    def after_load(self, layers: Sequence[LayerCurvature]) -> None:
        """Forget loaded running factors that another rank owns (PAD after a resume)."""
        for index, slot in enumerate(self.slots):
            if not self.keeps(index):
                self.layers[slot.layer].set_factor(slot.side, None)

    def keeps(self, slot: int) -> bool:
        """Whether this rank holds the running average of factor slot ``slot``."""
        return keeps_factor(self.destination[slot], self.comm.rank)

    # -- decompositions and preconditioning ---------------------------------------------------
    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Owners decompose their factors, results broadcast (fused per owner)."""
        owners: dict[FactorKey, int] = {
            (slot.layer, slot.side): owner
            for slot, owner in zip(self.slots, self.decomposer, strict=True)
        }
        update_factor_inverses(
            self.comm,
            self.recorder,
            self.layers,
            owners,
            damping,
            method,
            dtype,
            factors_everywhere=self.factors_everywhere,
        )

    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Every worker preconditions every layer with the shared decompositions."""
        return precondition_here(self.recorder, layers, grads, damping)

    # -- inspection --------------------------------------------------------------------------
    def plan(self) -> dict[str, Any]:
        """Owner per factor, buckets in launch order, and the predicted times behind them."""
        assert self.cost is not None
        names = [f"{self.layers[slot.layer].name}/{slot.side.upper()}" for slot in self.slots]
        bucket_of = {i: k for k, bucket in enumerate(self.pipeline.buckets) for i in bucket}
        ready = self.measured_ready or [0.0] * len(self.slots)
        timeline = predict_timeline(ready, self.wire, self.pipeline.buckets, self.cost.collective)
        factors = [
            {
                "layer": self.layers[slot.layer].name,
                "factor": slot.side.upper(),
                "dim": slot.dim,
                "wire_bytes": self.wire[i],
                "reduced_to": "all" if self.destination[i] is None else self.destination[i],
                "decomposed_by": "all"
                if self.decomposer[i] == EVERY_WORKER
                else self.decomposer[i],
                "bucket": bucket_of[i],
                "predicted_decomposition_s": self.decomposition_s[i],
                "measured_ready_s": None if self.measured_ready is None else ready[i],
            }
            for i, slot in enumerate(self.slots)
        ]
        buckets = [
            {
                "factors": [names[i] for i in bucket],
                "collective": "allreduce" if destination is None else "reduce",
                "destination": "all" if destination is None else destination,
                "wire_bytes": sum(self.wire[i] for i in bucket),
                "predicted_s": timing.end - timing.start,
                "predicted_start_s": timing.start if self.measured_ready is not None else None,
            }
            for bucket, destination, timing in zip(
                self.pipeline.buckets, self.pipeline.destinations, timeline, strict=True
            )
        ]
        loads = [0.0] * self.comm.world_size
        for seconds, owner in zip(self.decomposition_s, self.decomposer, strict=True):
            for rank in range(self.comm.world_size) if owner == EVERY_WORKER else (owner,):
                loads[rank] += seconds
        return {
            "strategy": self.name,
            "cost_model": self.cost.as_dict(),
            "cost_model_problems": list(self.cost_problems),
            "fusion": "alpha-beta (profiled)" if self.measured_ready is not None else "size",
            "factors": factors,
            "buckets": buckets,
            "predicted_decomposition_load_s": loads,
        }
