"""``strategy="dkfac"``: D-KFAC (Pauloski et al., SC20), the MPD-KFAC baseline.

Factors are allreduced (packed, fused) so every worker holds the global running factors; each
layer's owner (LPT on ``d³``) decomposes it and broadcasts the result to all workers (fused);
every worker preconditions every layer. This is KAISA with ``grad_worker_fraction=1``.
"""

from __future__ import annotations

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.strategies.kaisa import KAISAStrategy
from dkfac.strategies.registry import KAISAOptions


class DKFACStrategy(KAISAStrategy):
    """D-KFAC: decompositions broadcast to every worker; no gradient traffic."""

    name = "dkfac"

    def __init__(self, comm: Communicator, recorder: StepRecorder) -> None:
        super().__init__(comm, recorder, KAISAOptions(grad_worker_fraction=1.0))
