"""Combine the timed windows of ``dkfac bench``: across ranks, then across rounds.

:func:`reduce_window` turns every rank's raw window of one configuration into one JSON-ready
window (the slowest rank's times, the mean phases and bytes, the largest K-FAC memory);
:func:`summarize` reduces the rounds per model and configuration by their medians, with the
overhead of every configuration but DDP + SGD (K-FAC, DeAR + SGD) taken against the SGD window
of the same round.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dkfac.bench.configs import PHASES, SGD, Configuration, count_schedule_hits

#: ``comm_stats()`` phase prefix -> name of the byte split (DeAR's gradient halves are grad).
BYTE_SPLIT: Mapping[str, str] = MappingProxyType(
    {
        "factor_comm": "factor",
        "inverse_comm": "inverse",
        "grad_comm": "grad",
        "grad_reduce_scatter": "grad",
        "grad_all_gather": "grad",
    }
)


def split_bytes(bytes_per_step: dict[str, float]) -> dict[str, float]:
    """Total bytes per step and its factor / inverse / grad (/ other) parts."""
    parts = {"total": 0.0, "factor": 0.0, "inverse": 0.0, "grad": 0.0, "other": 0.0}
    for key, value in bytes_per_step.items():
        parts["total"] += value
        parts[BYTE_SPLIT.get(key.split("/", 1)[0], "other")] += value
    return parts


def _mean_overlap(ranks: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per phase, in-flight/exposed/hidden seconds per step, averaged over the ranks."""
    phases = sorted({phase for r in ranks for phase in r.get("overlap_s", {})})
    return {
        phase: {
            part: statistics.fmean(
                r.get("overlap_s", {}).get(phase, {}).get(part, 0.0) for r in ranks
            )
            for part in ("in_flight_s", "exposed_s", "hidden_s")
        }
        for phase in phases
    }


def _median_split(windows: Sequence[dict[str, Any]], phase: str) -> dict[str, float]:
    """One round's whole in-flight/exposed/hidden split of ``phase``: the median in flight.

    Whole, so that ``hidden / in_flight`` is one round's share (per-part medians over rounds
    would mix rounds); the lower median when the rounds are even.
    """
    splits = sorted(
        (w.get("overlap_s", {}).get(phase, {}) for w in windows),
        key=lambda split: split.get("in_flight_s", 0.0),
    )
    return dict(splits[(len(splits) - 1) // 2])


def reduce_window(
    config: Configuration, ranks: Sequence[dict[str, Any]], *, warmup: int, iters: int
) -> dict[str, Any]:
    """Combine the raw windows of all ranks into one JSON-ready window.

    ``warmup`` is the requested warm-up; a strategy that profiled longer (spd/pad) or DeAR
    searching its bucket size reports the steps it really took before the window
    (``warmup_steps``), the same on every rank. DDP + SGD records no phases or bytes; DeAR
    its waits and bytes (``dear_bucket_cap_mb`` the bucket size it kept); K-FAC its phases,
    bytes, memory and the updates in the window.
    """
    warmup = ranks[0].get("warmup_steps", warmup)
    wall_s = max(r["wall_s"] for r in ranks)
    iter_s = [max(values) for values in zip(*(r["iter_s"] for r in ranks), strict=True)]
    window: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "wall_s": wall_s,
        "amortized_s": wall_s / iters,
        "median_s": statistics.median(iter_s),
        "iter_s": iter_s,
        "iter_s_rank0": ranks[0]["iter_s"],
        "final_loss": ranks[0]["final_loss"],
        "cost_model": ranks[0].get("cost_model"),
        "fusion_buckets": ranks[0].get("fusion_buckets"),
        "pad_share": ranks[0].get("pad_share"),
        "chosen": ranks[0].get("chosen"),
        "factor_updates_in_window": None,
        "inverse_updates_in_window": None,
    }
    if config.reference:
        return window
    recorded = {name for r in ranks for name in r["phase_s"]}
    # K-FAC rows list every phase of a K-FAC step; DeAR's only what it records.
    first = list(PHASES) if config.kfac else [name for name in PHASES if name in recorded]
    phase_names = [*first, *sorted(recorded - set(first))]
    phase_s_per_rank = [{name: r["phase_s"].get(name, 0.0) for name in phase_names} for r in ranks]
    bytes_split_per_rank = [split_bytes(r["bytes_per_step"]) for r in ranks]
    window |= {
        "phase_s": {
            name: statistics.fmean(p[name] for p in phase_s_per_rank) for name in phase_names
        },
        "phase_s_per_rank": phase_s_per_rank,
        "bytes_per_step": {
            part: statistics.fmean(b[part] for b in bytes_split_per_rank)
            for part in bytes_split_per_rank[0]
        },
        "bytes_per_step_per_rank": bytes_split_per_rank,
        "overlap_s": _mean_overlap(ranks),
        "comm_per_step_per_rank": [
            {
                key: {"bytes": r["bytes_per_step"][key], "calls": r["calls_per_step"][key]}
                for key in sorted(r["bytes_per_step"])
            }
            for r in ranks
        ],
    }
    if config.dear:
        window |= {"dear_bucket_cap_mb": ranks[0].get("dear_bucket_cap_mb")}
    if not config.kfac:
        return window
    memory_per_rank = [r["factor_bytes"] + r["inverse_bytes"] for r in ranks]
    return window | {
        "factor_updates_in_window": count_schedule_hits(config.factor_update_steps, warmup, iters),
        "inverse_updates_in_window": count_schedule_hits(config.inv_update_steps, warmup, iters),
        "whole_inverse_periods": iters % config.inv_update_steps == 0,
        "kfac_memory_bytes": max(memory_per_rank),
        "kfac_memory_bytes_per_rank": memory_per_rank,
        "factor_bytes_per_rank": [r["factor_bytes"] for r in ranks],
        "inverse_bytes_per_rank": [r["inverse_bytes"] for r in ranks],
    }


def summarize(
    models: Sequence[str], configs: Sequence[Configuration], rounds: Sequence[dict[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Reduce the rounds per model and configuration (medians over rounds).

    The overhead of every configuration but DDP + SGD is computed inside each round against
    that round's SGD window (amortized times), then reduced by the median over rounds; it is
    negative when the configuration is faster.
    """
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        entries: dict[str, dict[str, Any]] = {}
        for config in configs:
            windows = [r["windows"][model][config.key] for r in rounds]
            sgd = [r["windows"][model][SGD.key] for r in rounds]
            entry: dict[str, Any] = {
                **config.to_json(),
                "iters": windows[0]["iters"],
                "amortized_s": statistics.median(w["amortized_s"] for w in windows),
                "median_s": statistics.median(w["median_s"] for w in windows),
                "amortized_s_per_round": [w["amortized_s"] for w in windows],
                "overhead_s": None,
                "overhead_pct": None,
                "overhead_s_per_round": None,
                "overhead_pct_per_round": None,
            }
            if config.reference:
                entries[config.key] = entry
                continue
            pairs = list(zip(windows, sgd, strict=True))
            over_s = [w["amortized_s"] - s["amortized_s"] for w, s in pairs]
            over_pct = [100.0 * (w["amortized_s"] / s["amortized_s"] - 1.0) for w, s in pairs]
            entry |= {
                "overhead_s": statistics.median(over_s),
                "overhead_pct": statistics.median(over_pct),
                "overhead_s_per_round": over_s,
                "overhead_pct_per_round": over_pct,
                "phase_s": {
                    name: statistics.median(w["phase_s"][name] for w in windows)
                    for name in windows[0]["phase_s"]
                },
                "bytes_per_step": {
                    part: statistics.median(w["bytes_per_step"][part] for w in windows)
                    for part in windows[0]["bytes_per_step"]
                },
            }
            if config.dear:
                entry["dear_bucket_cap_mb"] = [w["dear_bucket_cap_mb"] for w in windows]
            if config.kfac:
                entry |= {
                    "overlap_s": {
                        phase: _median_split(windows, phase)
                        for phase in windows[0].get("overlap_s", {})
                    },
                    "whole_inverse_periods": all(w["whole_inverse_periods"] for w in windows),
                    "factor_updates_in_window": windows[0]["factor_updates_in_window"],
                    "inverse_updates_in_window": windows[0]["inverse_updates_in_window"],
                    "kfac_memory_bytes": max(w["kfac_memory_bytes"] for w in windows),
                    "pad_share": windows[0].get("pad_share"),
                    "chosen": windows[0].get("chosen"),
                }
            entries[config.key] = entry
        summary[model] = entries
    return summary
