"""``strategy="local"``: everything on this worker, no communication.

The reference every distributed strategy must reproduce on the concatenated global batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from dkfac.comm.recorder import StepRecorder
from dkfac.strategies.base import Strategy
from dkfac.strategies.plan import Placement, layer_owner_routes
from dkfac.strategies.plan_report import PlanReport


class LocalStrategy(Strategy):
    """Single-worker K-FAC (or independent K-FAC per worker when run under DDP)."""

    name = "local"

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__(recorder)

    def place(self, dims: Sequence[tuple[int, int]]) -> Placement:
        """This worker captures, keeps, decomposes and applies every factor."""
        return Placement(1, "none", layer_owner_routes(dims, [0] * len(dims)))

    def plan(self) -> PlanReport:
        """Nothing is placed: one worker does everything (empty lists)."""
        return {"strategy": self.name, "factors": [], "buckets": []}
