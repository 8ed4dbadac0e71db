"""Summaries of time-to-target runs: the median over seeds, its spread, failures counted."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from dkfac.bench.text_table import fixed_width_table

__all__ = ["format_table", "grid_score", "lost_progress", "summarize"]

#: A run collapsed when a measurement falls back from its best so far by more than this share
#: of the way from its start to its target (a blown-up validation loss that stays finite).
COLLAPSE = 0.5


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


def lost_progress(points: Sequence[Sequence[float]], target: float) -> bool:
    """Whether a run collapsed: lost more than half of the way to its target that it had made.

    Progress is measured in shares of the way from the first measurement to the target, so
    it reads the same for a loss and an accuracy; a run that falls back from its best
    measurement so far by more than :data:`COLLAPSE` of the way has broken down even if its
    values stay finite (a validation loss blown up by one bad step), and noise of a few
    percent does not count. Non-finite values are divergence, counted apart.

    Args:
        points: ``(seconds, steps, metric)`` per measurement, the first at the start.
        target: the workload's target value of the metric.
    """
    start = points[0][2]
    way = target - start
    if not (math.isfinite(start) and way):
        return False
    best = 0.0
    for point in points[1:]:
        progress = (point[2] - start) / way
        if not math.isfinite(progress):
            return False
        best = max(best, progress)
        if best - progress > COLLAPSE:
            return True
    return False


def summarize(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Seeds of one method: how many reached, median and range of seconds and steps.

    Failures are counted twice over: ``diverged`` (the loss or metric stopped being finite)
    and ``collapsed`` (:func:`lost_progress`; a run that collapsed and then reached the
    target still counts as reached).

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
        "collapsed": sum(bool(t.get("collapsed")) for t in traces),
        "median_s": statistics.median(seconds) if typical else None,
        "min_s": seconds[0] if seconds else None,
        "max_s": seconds[-1] if seconds else None,
        "median_steps": statistics.median(steps) if typical else None,
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (workload, P, method): reached, failed, median seconds [range], median steps.

    ``failed`` is ``diverged+collapsed`` (:func:`summarize`).
    """
    header = ["workload", "P", "method", "reached", "failed", "median s", "range s", "steps"]
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
                f"{summary['diverged']}+{summary.get('collapsed', 0)}",
                "not" if summary["median_s"] is None else f"{summary['median_s']:.2f}",
                "-" if low is None else f"{low:.2f}-{high:.2f}",
                "-" if summary["median_steps"] is None else f"{summary['median_steps']:g}",
                "-" if versus is None else f"{versus:+.0%}",
            ]
        )
    widths = [12, 2, 26, 7, 8, 9, 13, 6, 16]
    return fixed_width_table([*header, "vs best baseline"], widths, body, left=3)
