"""Which K-FAC strategy to run: every candidate simulated, the fastest chosen (``"auto"``).

A candidate is a strategy with its options (KAISA's fraction, PAD's share) and a bucket cap.
:func:`rank_candidates` predicts each one's time per iteration on the cluster with the run's
schedule (:func:`~dkfac.sim.timeline.simulate`) and sorts them; ties keep the candidates'
order, so the answer depends only on the inputs and every rank that ranks the same inputs
chooses the same strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import SimulatedCluster, SimulatedRun
from dkfac.sim.timeline import simulate

#: Strategies ``"auto"`` chooses among, in the order ties are broken.
AUTO_STRATEGIES: tuple[str, ...] = ("dkfac", "kaisa", "spd", "pad", "dp")
#: Bucket caps (MiB) ``"auto"`` tries.
AUTO_BUCKET_CAPS_MB: tuple[float, ...] = (25.0, 4.0)


@dataclass(frozen=True)
class Candidate:
    """One configuration ``"auto"`` may choose: the run's options and the bucket cap."""

    run: SimulatedRun
    bucket_cap_mb: float

    @property
    def label(self) -> str:
        """The run's label and the cap."""
        return f"{self.run.label} cap={self.bucket_cap_mb:g}MiB"


@dataclass(frozen=True)
class RankedCandidate:
    """A candidate and its predicted time per iteration (averaged over the schedule)."""

    candidate: Candidate
    iteration_s: float
    stages_s: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the label, the options, the predicted seconds, the first step's stages."""
        run = self.candidate.run
        return {
            "label": self.candidate.label,
            "strategy": run.strategy,
            "grad_worker_fraction": run.grad_worker_fraction,
            "share": run.share,
            "bucket_cap_mb": self.candidate.bucket_cap_mb,
            "iteration_s": self.iteration_s,
            "stages_s": self.stages_s,
        }


def kaisa_fractions(world_size: int) -> list[float]:
    """KAISA's fractions the world allows, from memory-optimal ``1/P`` to ``1`` (``f·P | P``)."""
    return [groups / world_size for groups in range(1, world_size + 1) if world_size % groups == 0]


def candidates(
    template: SimulatedRun,
    world_size: int,
    *,
    strategies: Sequence[str] = AUTO_STRATEGIES,
    bucket_caps_mb: Sequence[float] = AUTO_BUCKET_CAPS_MB,
    max_fractions: int = 4,
) -> list[Candidate]:
    """Every configuration to rank: each strategy with the schedule and method of ``template``.

    KAISA is tried at up to ``max_fractions`` of its allowed fractions (both ends and evenly
    between, ``1`` excluded: there it is D-KFAC); the bucket caps apply to every strategy.

    Raises:
        ValueError: an unknown strategy, no strategy, or no bucket cap.
    """
    if max_fractions < 2:
        raise ValueError(f"max_fractions={max_fractions}: expected at least 2 (both ends)")
    unknown = sorted(set(strategies) - set(AUTO_STRATEGIES))
    if unknown or not strategies or not bucket_caps_mb:
        raise ValueError(
            f"auto chooses among {', '.join(AUTO_STRATEGIES)} with at least one bucket cap; "
            f"got strategies {list(strategies)} and caps {list(bucket_caps_mb)}"
        )
    runs = []
    for strategy in strategies:
        if strategy == "kaisa":
            fractions = kaisa_fractions(world_size)[:-1]  # f = 1 is D-KFAC
            if len(fractions) > max_fractions:
                step = (len(fractions) - 1) / (max_fractions - 1)
                fractions = [fractions[round(k * step)] for k in range(max_fractions)]
            runs += [replace(template, strategy="kaisa", grad_worker_fraction=f) for f in fractions]
        else:
            runs.append(replace(template, strategy=strategy, grad_worker_fraction=1.0))
    return [Candidate(run, cap) for run in runs for cap in bucket_caps_mb]


def rank_candidates(
    profile: ComputeProfile, cluster: SimulatedCluster, options: Sequence[Candidate]
) -> list[RankedCandidate]:
    """Every candidate's predicted time on ``cluster``, fastest first (ties: given order)."""
    ranked = []
    for candidate in options:
        capped = replace(cluster, bucket_cap_mb=candidate.bucket_cap_mb)
        prediction = simulate(profile, capped, candidate.run)
        ranked.append(
            RankedCandidate(candidate, prediction.iteration_s, dict(prediction.steps[0].stages))
        )
    order = sorted(range(len(ranked)), key=lambda k: (ranked[k].iteration_s, k))
    return [ranked[k] for k in order]
