"""What SPD-KFAC and PAD-KFAC share.

Hook-launched fused factor communication, per-factor decomposition placement from a
calibrated cost model, and re-planning of the fusion after profiling. Both compute exactly
what D-KFAC computes. A subclass only says where each factor's collective goes (allreduce to
all, or reduce to an owner) and who decomposes each factor; PAD also whether the decomposers
broadcast decompositions or preconditioned gradients (:meth:`PipelinedStrategy.share_choice`).
"""

from __future__ import annotations

import logging
import warnings
from abc import abstractmethod
from collections.abc import Sequence

import torch

from dkfac.comm.communicator import Communicator
from dkfac.comm.cost_model import ClusterCostModel, CostModelCache
from dkfac.comm.fusion import (
    plan_buckets_alpha_beta,
    plan_buckets_by_size,
    predict_timeline,
)
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.batching import Batching
from dkfac.curvature.factor_side import decomposition_work, largest_dense_side
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import Strategy
from dkfac.strategies.factor_placement import (
    FactorPlacement,
    ShareChoice,
    SlotCosts,
    destination_boundaries,
    gradient_bytes,
)
from dkfac.strategies.pipeline import ready_order_of
from dkfac.strategies.plan import EVERY_WORKER, Placement
from dkfac.strategies.plan_report import BucketRow, PlanReport

logger = logging.getLogger(__name__)


class PipelinedStrategy(Strategy):
    """Factor collectives launched from the hooks; factors decomposed where the plan says.

    Args:
        comm: communicator on a process group of its own (see :mod:`.pipeline`).
        recorder: accounting.
        inverse_method: the preconditioner's method (the cost model times it).
        inv_dtype: dtype of the decompositions.
        factor_dtype: dtype of the running factors (they travel in ``comm.comm_dtype`` if set);
            ``None``: the layers' own, read in :meth:`setup`.
        grad_dtype: dtype of the preconditioned gradients (the same rule; before
            :meth:`setup` float32), which PAD may broadcast.
        cost_model: the cluster's measured costs; a :class:`CostModelCache` to take them from
            (measured there on first use, then reused by later strategies); ``None`` measures
            them in :meth:`setup`.
        profile_steps: factor-update windows whose ready times are measured before the
            fusion plan is re-planned with the alpha-beta merge rule (0: keep the size plan).
    """

    starts_work_from_hooks = True

    def __init__(
        self,
        comm: Communicator,
        recorder: StepRecorder,
        *,
        inverse_method: str = "eigen",
        inv_dtype: torch.dtype = torch.float32,
        factor_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        cost_model: ClusterCostModel | CostModelCache | None = None,
        profile_steps: int = 5,
    ) -> None:
        super().__init__(recorder, comm)
        self.comm: Communicator = comm
        self.inverse_method = inverse_method
        self.inv_dtype = inv_dtype
        self.factor_dtype = factor_dtype
        self.grad_dtype = grad_dtype
        self.cost: ClusterCostModel | None = (
            cost_model if isinstance(cost_model, ClusterCostModel) else None
        )
        self._cost_cache = cost_model if isinstance(cost_model, CostModelCache) else None
        self.profile_steps = profile_steps
        self.factor_steps = 0
        self.measured_ready: list[float] | None = None

    # -- planning ----------------------------------------------------------------------------
    def setup(
        self,
        layers: Sequence[LayerCurvature],
        *,
        accumulation_steps: int = 1,
        batching: Batching | None = None,
    ) -> None:
        """Measure the cluster (unless given or cached), place the factors, plan by size.

        A factor is handed to the pipeline when its statistics of the window are complete:
        at first after ``accumulation_steps`` statistics, then after as many as the previous
        window had (a layer that runs several times per pass has several per pass).
        """
        if self.cost is None:
            cache = self._cost_cache or CostModelCache()
            device = layers[0].block.weight.device
            largest = largest_dense_side(
                side for layer in layers for side in (layer.block.a_dim, layer.block.g_dim)
            )
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
        if self.factor_dtype is None:
            self.factor_dtype = layers[0].factor_dtype
        if self.grad_dtype is None:
            self.grad_dtype = layers[0].block.weight.dtype
        self.factor_placement = self.plan_factors(
            [(layer.block.a_dim, layer.block.g_dim) for layer in layers]
        )
        super().setup(layers, accumulation_steps=accumulation_steps, batching=batching)
        self._slot_of = {route.key: i for i, route in enumerate(self.placement.factors)}
        self.expected_updates = [accumulation_steps] * len(self.placement.factors)

    def place(self, dims: Sequence[tuple[int, int]]) -> Placement:
        """The cost-model placement with the size-first fusion plan (see :meth:`place_factors`)."""
        return self.plan_factors(dims).placement()

    def plan_factors(self, dims: Sequence[tuple[int, int]]) -> FactorPlacement:
        """Destinations, decomposers and the size-first fusion for layers of ``dims``."""
        if self.cost is None or self.factor_dtype is None:
            raise RuntimeError(
                f"strategy={self.name!r} places factors with a cost model and the factors' "
                "dtype: set up the strategy (or give both) first"
            )
        return self.place_factors(
            dims,
            self.world_size,
            self.cost,
            inverse_method=self.inverse_method,
            inv_dtype=self.inv_dtype,
            factor_dtype=self.comm.comm_dtype or self.factor_dtype,
            cap_bytes=self.comm.bucket_cap_bytes,
            share=self.share_choice(dims),
            grad_dtype=self.grad_wire_dtype,
        )

    @property
    def grad_wire_dtype(self) -> torch.dtype:
        """The dtype preconditioned gradients travel in (float32 until :meth:`setup`)."""
        return self.comm.comm_dtype or self.grad_dtype or torch.float32

    def share_choice(self, dims: Sequence[tuple[int, int]]) -> ShareChoice | None:
        """What the decomposers broadcast; ``None``: their decompositions (PAD may choose)."""
        return None

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
        share: ShareChoice | None = None,
        grad_dtype: torch.dtype = torch.float32,
    ) -> FactorPlacement:
        """The placement and size-first fusion plan of layers ``dims`` (pure: no process group).

        Args:
            dims: ``(d_A, d_G)`` of each layer, in registration order.
            world_size: number of workers.
            cost: the cost model the placement is planned with.
            inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
            inv_dtype: dtype of the decompositions.
            factor_dtype: dtype the factors travel in.
            cap_bytes: largest fused collective.
            share: what the decomposers broadcast (PAD's
                :func:`~dkfac.strategies.factor_placement.choose_share`); ``None``:
                their decompositions.
            grad_dtype: dtype preconditioned gradients travel in.
        """
        slots = ready_order_of(dims)
        element = torch.empty((), dtype=factor_dtype).element_size()
        wire = [slot.packed_bytes(element) for slot in slots]
        size_based = bool(cost.problems())
        costs = SlotCosts(
            slots=slots,
            wire=wire,
            decomposition_s=[
                decomposition_work(slot.dim) if size_based else cost.decomposition.seconds(slot.dim)
                for slot in slots
            ],
            cost=cost,
            inverse_method=inverse_method,
            inv_dtype=inv_dtype,
            world_size=world_size,
            size_based=size_based,
            share="decompositions" if share is None else share.mode,
            gradient_wire=tuple(gradient_bytes(a, g, grad_dtype) for a, g in dims),
        )
        destination = cls.plan_destinations(costs)
        decomposer = cls.plan_decomposers(costs, destination)
        boundaries = destination_boundaries(destination, range(len(slots)))
        buckets = plan_buckets_by_size(wire, cap_bytes, boundaries)
        return FactorPlacement(costs, destination, decomposer, buckets, share)

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
        return list(range(len(ready)))

    def fusion_for_ready(self, factors: FactorPlacement, ready: Sequence[float]) -> list[list[int]]:
        """The alpha-beta merge plan for slots whose factors are ready at ``ready`` (seconds).

        Used after profiling with the median ready times agreed over ranks, and by the
        simulator with the ready times it predicts.
        """
        assert self.cost is not None, "planned with a cost model"
        order = self.replan_order(ready)
        positions = plan_buckets_alpha_beta(
            [ready[i] for i in order],
            [factors.costs.wire[i] for i in order],
            self.cost.collective,
            self.comm.bucket_cap_bytes,
            destination_boundaries(factors.destination, order),
        )
        return [[order[p] for p in bucket] for bucket in positions]

    def _replan(self) -> None:
        """Alpha-beta merge plan from the median ready times, agreed (max) over ranks."""
        assert self.cost is not None and self.runner.pipeline is not None
        medians = self.runner.pipeline.median_ready_times()
        device = self.layers[0].block.weight.device
        agreed = torch.tensor(medians, dtype=torch.float64, device=device)
        self.comm.allreduce([agreed], phase="factor_comm", maximum=True, exact=True).wait()
        ready = agreed.tolist()
        buckets = self.fusion_for_ready(self.factor_placement, ready)
        self.runner.set_buckets(buckets)
        self.measured_ready = ready
        logger.info(
            "%s: fusion re-planned from %d profiled windows: %d buckets",
            self.name,
            len(self.runner.pipeline.profile),
            len(buckets),
        )

    # -- factors -----------------------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        """Whether the first ``profile_steps`` factor updates (the size plan) are not over."""
        return self.factor_steps < self.profile_steps

    def statistic_added(self, layer: LayerCurvature, side: str, loss_reduction: str) -> None:
        """Hand the factor to the pipeline once the window's expected statistics are in.

        Statistics that come after the hand-over are not lost: ``update_factors`` sends them
        as an exact correction (:meth:`FactorStatistics.late`).
        """
        index = self.index(layer)
        stats = layer.statistics(side)
        if (
            not stats.handed_over
            and stats.updates == self.expected_updates[self._slot_of[(index, side)]]
        ):
            self.runner.hand_over(self.layers, index, side, loss_reduction)

    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Finish the factor collectives (the runner), then learn the next window's shape.

        The next window is expected to look like this one (a layer that did not run keeps its
        expectation); after ``profile_steps`` windows the fusion is re-planned.
        """
        for index, route in enumerate(self.placement.factors):
            updates = layers[route.layer].statistic_updates(route.side)
            if updates:
                self.expected_updates[index] = updates
        profile = self.factor_steps < self.profile_steps
        self.runner.exchange_factors(layers, decay, loss_reduction, fold=fold, profile=profile)
        self.factor_steps += 1
        if self.profile_steps and self.factor_steps == self.profile_steps:
            if self.cost_problems:  # the merge rule needs alpha and beta
                logger.info("%s: fusion kept by size (no usable cost model)", self.name)
            else:
                self._replan()

    # -- inspection --------------------------------------------------------------------------
    def plan(self) -> PlanReport:
        """Owner per factor, buckets in launch order, and the predicted times behind them."""
        assert self.cost is not None
        placement, costs = self.placement, self.factor_placement.costs
        names = [f"{self.layers[r.layer].name}/{r.side.upper()}" for r in placement.factors]
        bucket_of = {i: k for k, bucket in enumerate(placement.buckets) for i in bucket}
        ready = self.measured_ready or [0.0] * len(placement.factors)
        timeline = predict_timeline(ready, costs.wire, placement.buckets, self.cost.collective)
        factors = placement.describe([layer.name for layer in self.layers])
        for i, row in enumerate(factors):
            row["wire_bytes"] = costs.wire[i]
            row["bucket"] = bucket_of[i]
            row["predicted_decomposition_s"] = costs.decomposition_s[i]
            row["measured_ready_s"] = None if self.measured_ready is None else ready[i]
        buckets: list[BucketRow] = []
        destinations = placement.bucket_destinations()
        for bucket, destination, timing in zip(
            placement.buckets, destinations, timeline, strict=True
        ):
            buckets.append(
                {
                    "factors": [names[i] for i in bucket],
                    "collective": "allreduce" if destination is None else "reduce",
                    "destination": "all" if destination is None else destination,
                    "wire_bytes": sum(costs.wire[i] for i in bucket),
                    "predicted_s": timing.end - timing.start,
                    "predicted_start_s": timing.start if self.measured_ready is not None else None,
                }
            )
        loads = [0.0] * self.world_size
        for seconds, route in zip(costs.decomposition_s, placement.factors, strict=True):
            owner = route.decomposed_by
            for rank in range(self.world_size) if owner == EVERY_WORKER else (owner,):
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
