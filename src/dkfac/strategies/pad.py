"""``strategy="pad"``: PAD-KFAC (placement-aware D-KFAC, Lin Zhang's thesis), docs/strategies.md.

An allreduce delivers every factor to every worker although only its owner decomposes it.
PAD-KFAC sends each factor with a *reduce* to its owner instead, launched from the hooks like
SPD-KFAC. Only the owner averages, keeps and decomposes a factor. What the owners then
broadcast is the ``share`` option (:class:`~dkfac.strategies.registry.PADOptions`):

* ``"decompositions"``: owners come from the optimal contiguous partition of the ready-ordered
  factor list (A in forward order, G in reverse), minimising the largest per-owner cost
  (predicted reduce + decomposition time), so consecutive factors of one owner travel in one
  fused reduce; decompositions are broadcast fused and every worker preconditions every layer;
* ``"gradients"``: each *layer* has one owner, from the optimal contiguous partition of the
  layers in forward order (cost: both decompositions, both reduces and the broadcast of the
  preconditioned gradient); the owner receives both factors, decomposes them, preconditions
  the layer and broadcasts the result every step, fused per owner. A preconditioned gradient
  is far smaller than the decompositions of its layer (``d_A·d_G`` against about
  ``d_A² + d_G²``), so when decompositions are refreshed every step this moves much less;
* ``"auto"``: whichever moves fewer predicted bytes per step at the run's ``inv_update_steps``
  (:func:`~dkfac.strategies.factor_placement.choose_share`).

Owners are fixed at setup (running averages live on them); profiling only re-plans how each
owner's contiguous block is split into buckets.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.batching import Batching
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.factor_placement import ShareChoice, SlotCosts, choose_share
from dkfac.strategies.pipelined import PipelinedStrategy
from dkfac.strategies.placement import plan_contiguous_partition
from dkfac.strategies.plan_report import PlanReport
from dkfac.strategies.registry import PADShare, check_share

logger = logging.getLogger(__name__)


class PADStrategy(PipelinedStrategy):
    """PAD-KFAC: hook-launched fused reduces to contiguous-partition owners.

    Args:
        comm: communicator on a process group of its own.
        recorder: accounting.
        share: what the owners broadcast: ``"decompositions"``, ``"gradients"`` or ``"auto"``.
        inv_update_steps: steps between decompositions (the schedule's value at the start),
            which ``"auto"`` decides for.
        **pipelined: the options of :class:`PipelinedStrategy`.
    """

    name = "pad"

    def __init__(
        self,
        comm: Communicator,
        recorder: StepRecorder,
        *,
        share: PADShare = "auto",
        inv_update_steps: int = 1,
        **pipelined: Any,
    ) -> None:
        check_share(share)
        super().__init__(comm, recorder, **pipelined)
        self.share = share
        self.inv_update_steps = inv_update_steps

    def share_choice(self, dims: Sequence[tuple[int, int]]) -> ShareChoice:
        """The ``share`` option, resolved with the bytes that travel (``comm_dtype`` if set)."""
        return choose_share(
            self.share,
            dims,
            inverse_method=self.inverse_method,
            inv_dtype=self.comm.comm_dtype or self.inv_dtype,
            grad_dtype=self.grad_wire_dtype,
            inv_update_steps=self.inv_update_steps,
        )

    def setup(
        self,
        layers: Sequence[LayerCurvature],
        *,
        accumulation_steps: int = 1,
        batching: Batching | None = None,
    ) -> None:
        """Place the factors (:meth:`PipelinedStrategy.setup`) and say what is shared, why."""
        super().setup(layers, accumulation_steps=accumulation_steps, batching=batching)
        choice = self._choice()
        logger.info(
            "pad: share=%r: owners broadcast %s (per step: decompositions %d bytes at "
            "inv_update_steps=%d, preconditioned gradients %d bytes)",
            choice.requested,
            "preconditioned gradients" if choice.mode == "gradients" else "decompositions",
            round(choice.decomposition_bytes_per_step),
            choice.inv_update_steps,
            choice.gradient_bytes_per_step,
        )

    def _choice(self) -> ShareChoice:
        choice = self.factor_placement.share
        assert choice is not None, "PAD always resolves its share option"
        return choice

    @staticmethod
    def plan_destinations(costs: SlotCosts) -> list[int | None]:
        """Owner of each slot: optimal contiguous partition of the factors or of the layers.

        Sharing decompositions, the ready-ordered factors are partitioned; sharing gradients,
        the layers in forward order, and both factors of a layer go to its owner.
        """
        beta = 0.0 if costs.size_based else costs.cost.collective.beta  # sizes: d³ alone
        # Start-up times are left out: each owner's block travels in fused collectives, which
        # share one start-up, so it does not grow with the factors (layers) a block holds.
        cost = [
            seconds + beta * nbytes
            for seconds, nbytes in zip(costs.decomposition_s, costs.wire, strict=True)
        ]
        if costs.share == "decompositions":
            return list(plan_contiguous_partition(cost, costs.world_size))
        layer_cost = [beta * nbytes for nbytes in costs.gradient_wire]
        for slot, seconds in zip(costs.slots, cost, strict=True):
            layer_cost[slot.layer] += seconds
        owner = plan_contiguous_partition(layer_cost, costs.world_size)
        return [owner[slot.layer] for slot in costs.slots]

    @staticmethod
    def plan_decomposers(costs: SlotCosts, destination: Sequence[int | None]) -> list[int]:
        """The owner that received the factor decomposes it."""
        return [int(owner) for owner in destination if owner is not None]

    def plan(self) -> PlanReport:
        """:meth:`PipelinedStrategy.plan` and what the owners share (``"share"``)."""
        report = super().plan()
        report["share"] = self._choice().report()
        return report
