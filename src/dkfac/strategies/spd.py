"""``strategy="spd"``: SPD-KFAC (Shi, Zhang, Li, ICDCS 2021), docs/strategies.md.

* Pipelining with tensor fusion: each factor's summed statistic is handed over in the hook
  that completes it (A in the forward hook, G in the backward hook) and its bucket's
  asynchronous allreduce starts as soon as the bucket is complete, under the rest of the
  forward/backward pass. Buckets are planned first by size (``bucket_cap_mb``), then, after
  ``profile_steps`` measured windows, by the alpha-beta merge rule on the measured ready times
  (:func:`~dkfac.comm.fusion.plan_buckets_alpha_beta`).
* Load-balanced decompositions: a factor whose decomposition is predicted cheaper than
  receiving its result (its share ``β·bytes`` of a fused broadcast) is decomposed by every
  worker; the others go to owners by longest-processing-time on the predicted decomposition
  time, results broadcast fused.

Every worker keeps every running factor (allreduce), as in D-KFAC: the same factor bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from dkfac.strategies.factor_placement import SlotCosts, decomposition_bytes
from dkfac.strategies.pipelined import PipelinedStrategy
from dkfac.strategies.placement import longest_processing_time
from dkfac.strategies.plan import EVERY_WORKER


class SPDStrategy(PipelinedStrategy):
    """SPD-KFAC: hook-launched fused allreduces, redundant-or-LPT decompositions."""

    name = "spd"

    @staticmethod
    def plan_destinations(costs: SlotCosts) -> list[int | None]:
        """Allreduce every factor."""
        if costs.share != "decompositions":  # redundant decomposers have no one gradient owner
            raise ValueError(f"strategy='spd' shares decompositions, not {costs.share}")
        return [None] * len(costs.slots)

    @staticmethod
    def plan_decomposers(costs: SlotCosts, destination: Sequence[int | None]) -> list[int]:
        """Redundant where decomposing beats receiving; LPT on predicted time otherwise.

        A worker either decomposes a factor itself (``c0 + c3·d³``) or receives it in one of
        the owners' fused broadcasts, where one more factor costs ``β·bytes`` (the start-up
        ``α`` is shared by the whole bucket, so charging it to each factor would make far too
        many factors redundant).
        """
        beta = costs.cost.collective.beta
        placed = [
            i
            for i, slot in enumerate(costs.slots)
            if costs.size_based  # no usable times: every factor to an owner, LPT on d³
            or beta * decomposition_bytes(slot.dim, costs.inverse_method, costs.inv_dtype)
            <= costs.decomposition_s[i]
        ]
        owners = longest_processing_time(
            [costs.decomposition_s[i] for i in placed], costs.world_size
        )
        decomposer = [EVERY_WORKER] * len(costs.slots)
        for i, owner in zip(placed, owners, strict=True):
            decomposer[i] = owner
        return decomposer

    def replan_order(self, ready: Sequence[float]) -> list[int]:
        """Slots sorted by their agreed measured ready time (registration order breaks ties)."""
        return sorted(range(len(ready)), key=lambda i: (ready[i], i))
