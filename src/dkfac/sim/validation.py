"""The simulator against measurements: each row of an emulated-cluster benchmark, predicted.

``benchmarks/network.py`` writes, per link rate, the measured time per iteration of DDP + SGD,
DeAR + SGD and every K-FAC strategy on the emulated cluster
(:mod:`dkfac.bench.emulated_cluster`). For each such row :func:`compare_rows` simulates the
same run (strategy, KAISA fraction, PAD's share, schedule, gradient averaging and DeAR's
bucket cap, P, gloo, the rate's shaped link and delay, the benchmark's bucket cap) with a
compute profile of one worker at the benchmark's batch size and reports the relative
error. Measured: the median iteration at (1, 1), the amortised one for periodic schedules
(whose median is a step without K-FAC work).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from dkfac.bench.link_shape import LinkShape
from dkfac.sim.network import LinkModel
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import SGD, SimulatedCluster, SimulatedRun
from dkfac.sim.timeline import simulate

#: Largest relative error the issue allows at P = 2 (and at P = 4: :data:`TOLERANCE_P4`).
TOLERANCE_P2 = 0.15
TOLERANCE_P4 = 0.25


def run_of(row: Mapping[str, Any]) -> SimulatedRun | None:
    """The simulated run of a benchmark summary row.

    ``None`` for ``auto``: its choice is validated as the strategy it chose.
    """
    if row.get("strategy") == "auto":
        return None
    sync = str(row.get("gradient_sync") or "ddp")
    cap = dear_bucket_cap_mb(row) if sync == "dear" else None
    template = SimulatedRun(SGD, gradient_sync=sync)
    if cap is not None:
        template = replace(template, dear_bucket_cap_mb=cap)
    if row["strategy"] is None:
        return template
    return replace(
        template,
        strategy=row["strategy"],
        grad_worker_fraction=float(row.get("grad_worker_fraction") or 1.0),
        factor_update_steps=int(row["factor_update_steps"]),
        inv_update_steps=int(row["inv_update_steps"]),
        inverse_method=row.get("inverse_method") or "eigen",
        share=row.get("pad_share") or "auto",  # what PAD decided when it ran
    )


def dear_bucket_cap_mb(row: Mapping[str, Any]) -> float | None:
    """The bucket cap a DeAR row ran with; ``None`` where the row does not say.

    The middle of its rounds' caps: its search may settle differently from round to round.
    """
    caps = [float(cap) for cap in row.get("dear_bucket_cap_mb") or () if cap is not None]
    return statistics.median_low(caps) if caps else None


def measured_seconds(row: Mapping[str, Any]) -> float:
    """The measured time per iteration the prediction is compared with."""
    periodic = (row.get("inv_update_steps") or 1) > 1
    return float(row["amortized_s"] if periodic else row["median_s"])


def compare_rows(
    rows: Iterable[Mapping[str, Any]],
    profiles: Mapping[str, ComputeProfile],
    settings: Mapping[str, Any],
    *,
    source: str = "",
) -> list[dict[str, Any]]:
    """Per measured row with a profile of its model: measured, predicted, relative error.

    ``settings`` are the benchmark's (its JSON's ``"settings"``): batch size per worker,
    bucket cap and each rate's delay.

    Raises:
        ValueError: a profile measured at another batch size than the benchmark ran.
    """
    batch = settings.get("batch_size_per_worker")
    delays = {
        float(link["rate_bit_s"]): float(link.get("delay_s", 0.0))
        for link in settings.get("network", [])
    }
    compared = []
    for row in rows:
        profile = profiles.get(row["model"])
        run = run_of(row)
        if profile is None or run is None:
            continue
        if batch is not None and profile.batch_size != batch:
            raise ValueError(
                f"the {row['model']} profile is of batch size {profile.batch_size}; "
                f"{source or 'the benchmark'} ran {batch} per worker"
            )
        rate = float(row["rate_bit_s"])
        link = LinkModel.from_link_shape(LinkShape(rate, delays.get(rate, 0.0)))
        cluster = SimulatedCluster(
            int(row["nprocs"]),
            link,
            backend=str(settings.get("backend", "gloo")),
            bucket_cap_mb=float(settings.get("bucket_cap_mb", 25.0)),
        )
        prediction = simulate(profile, cluster, run)
        measured = measured_seconds(row)
        compared.append(
            {
                "source": source,
                "model": row["model"],
                "nprocs": row["nprocs"],
                "rate": row["rate"],
                "label": run.label,
                "measured_s": measured,
                "predicted_s": prediction.iteration_s,
                "error": prediction.iteration_s / measured - 1.0,
                "stages_s": prediction.steps[0].stages,
            }
        )
    return compared


def tolerance(nprocs: int) -> float:
    """The error the issue allows at ``nprocs`` workers."""
    return TOLERANCE_P2 if nprocs <= 2 else TOLERANCE_P4


def format_comparison(compared: Sequence[Mapping[str, Any]]) -> str:
    """A table: one row per measured configuration, the error and whether it is within bounds."""
    header = (
        f"{'source':34s} {'rate':>8s} {'P':>2s} {'configuration':30s} "
        f"{'measured':>9s} {'predicted':>9s} {'error':>7s}  within"
    )
    lines = [header, "-" * len(header)]
    for row in compared:
        ok = abs(row["error"]) <= tolerance(int(row["nprocs"]))
        lines.append(
            f"{row['source'][:34]:34s} {row['rate']:>8s} {row['nprocs']:>2d} {row['label']:30s} "
            f"{row['measured_s']:>8.3f}s {row['predicted_s']:>8.3f}s {row['error']:>+7.1%}  "
            f"{'yes' if ok else 'NO'}"
        )
    inside = sum(abs(r["error"]) <= tolerance(int(r["nprocs"])) for r in compared)
    lines.append(f"{inside} of {len(compared)} within the bound (P = 2: 15%, P = 4: 25%)")
    return "\n".join(lines)
