"""Summaries of time-to-target runs: the median over seeds, its spread, failures counted."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from dkfac.bench.text_table import fixed_width_table

__all__ = ["format_table", "grid_score", "summarize"]


def grid_score(trace: dict[str, Any], higher_is_better: bool) -> tuple[float, float]:
    """How a learning rate of the grid ranks: seconds to target, then the best value reached.

    Smaller is better: an unreached or diverged run scores infinite seconds, and among those
    the one that came closest wins (its best metric, negated where higher is better).
    """
    values = [p[2] for p in trace["points"] if math.isfinite(p[2])]
    if not values:
        return math.inf, math.inf
    best = max(values) if higher_is_better else min(values)
    closeness = -best if higher_is_better else best
    if trace["diverged"] or trace["reached_s"] is None:
        return math.inf, closeness
    return float(trace["reached_s"]), closeness


def summarize(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Seeds of one method: how many reached, median and range of seconds and steps.

    The median is over the runs that reached the target; with fewer than half reaching it,
    the method's median time is ``None`` (it does not reach the target in a typical run).
    """
    reached = [t for t in traces if t["reached_s"] is not None and not t["diverged"]]
    seconds = sorted(float(t["reached_s"]) for t in reached)
    steps = sorted(int(t["reached_step"]) for t in reached)
    typical = 2 * len(reached) > len(traces)
    return {
        "runs": len(traces),
        "reached": len(reached),
        "diverged": sum(bool(t["diverged"]) for t in traces),
        "median_s": statistics.median(seconds) if typical else None,
        "min_s": seconds[0] if seconds else None,
        "max_s": seconds[-1] if seconds else None,
        "median_steps": statistics.median(steps) if typical else None,
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (workload, P, method): reached, median seconds [range], median steps."""
    header = ["workload", "P", "method", "reached", "diverged", "median s", "range s", "steps"]
    body = []
    for row in rows:
        summary = row["summary"]
        low, high = summary["min_s"], summary["max_s"]
        versus = row.get("versus_best_baseline")
        body.append(
            [
                row["workload"],
                str(row["world_size"]),
                row["method"],
                f"{summary['reached']}/{summary['runs']}",
                str(summary["diverged"]),
                "not" if summary["median_s"] is None else f"{summary['median_s']:.2f}",
                "-" if low is None else f"{low:.2f}-{high:.2f}",
                "-" if summary["median_steps"] is None else f"{summary['median_steps']:g}",
                "-" if versus is None else f"{versus:+.0%}",
            ]
        )
    widths = [12, 2, 26, 7, 8, 9, 13, 6, 16]
    return fixed_width_table([*header, "vs best baseline"], widths, body, left=3)
