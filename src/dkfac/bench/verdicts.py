"""The verdicts of ``dkfac bench`` against its targets, and their rendering.

The targets come from a file (:func:`dkfac.bench.targets.load_targets`) and are passed in:
:func:`evaluate_target` checks one configuration's overhead over SGD
(:class:`~dkfac.bench.targets.OverheadTarget`), :func:`evaluate_pipelined_target` strategies
against a baseline per factor-update iteration (:class:`~dkfac.bench.targets.PipelinedTarget`),
:func:`evaluate_dry_run_target` a dry run's DP-KFAC vs D-KFAC ratios
(:class:`~dkfac.bench.targets.DryRunTarget`).
Verdicts are plain data (JSON-ready, stored as is in the report); ``format_*`` render them from
the verdict alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dkfac.bench.configs import MODEL_LABELS, SGD, kfac_configuration
from dkfac.bench.targets import DryRunTarget, OverheadTarget, PipelinedTarget

#: Phases compared by the pipelined target, plus ``other`` (the rest of the iteration).
TARGET_PHASES: tuple[str, ...] = (
    "factor_comm",
    "factor_compute",
    "inverse_compute",
    "inverse_comm",
    "precondition",
)


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with one decimal (the tables' unit)."""
    return f"{1e3 * seconds:.1f}"


def evaluate_target(rows: Sequence[Mapping[str, Any]], target: OverheadTarget) -> dict[str, Any]:
    """Whether the overhead of ``target.config`` (its model and P) meets the target.

    Args:
        rows: The summary rows of :func:`dkfac.bench.report.summary_rows`.
        target: The configuration and its limit.

    Returns:
        The target's fields plus ``measured_overhead_s`` and ``met`` (both ``None`` when the
        configuration was not run) and, when it was, the overhead per round and the K-FAC
        and SGD seconds per iteration.

    """
    verdict: dict[str, Any] = {
        **dataclasses.asdict(target),
        "measured_overhead_s": None,
        "met": None,
    }
    found = {
        row["key"]: row
        for row in rows
        if row["model"] == target.model and row["nprocs"] == target.nprocs
    }
    row = found.get(target.config)
    if row is not None:
        measured = row["overhead_s"]
        verdict |= {
            "measured_overhead_s": measured,
            "measured_overhead_s_per_round": row["overhead_s_per_round"],
            "measured_kfac_s_per_iter": row["amortized_s"],
            "measured_sgd_s_per_iter": found[SGD.key]["amortized_s"],
            "met": bool(measured <= target.max_overhead_s),
        }
    return verdict


def format_target(
    verdict: Mapping[str, Any], reference_line: str, *, like_for_like: bool, quick: bool
) -> str:
    """Render the reference line and whether the overhead target is met.

    Args:
        verdict: The result of :func:`evaluate_target`.
        reference_line: The reference's line (:attr:`dkfac.bench.targets.Reference.line`),
            printed first.
        like_for_like: Whether the run used the reference's batch size (else a note).
        quick: Whether this was a ``--quick`` run (adds a note).

    Returns:
        The lines, joined.

    """
    lines = [reference_line]
    config = kfac_configuration(verdict["config"], verdict["nprocs"])
    model = MODEL_LABELS.get(verdict["model"], verdict["model"])
    what = f"{config.label} {model} P={verdict['nprocs']} {config.schedule}"
    measured = verdict["measured_overhead_s"]
    if measured is None:
        lines.append(f"measured: {what} was not run -> target not evaluated")
        return "\n".join(lines)
    status = "MET" if verdict["met"] else "NOT MET"
    per_round = ", ".join(f"{v:.3f}" for v in verdict["measured_overhead_s_per_round"])
    lines.append(
        f"measured: {what} {verdict['measured_kfac_s_per_iter']:.3f} s/iter, "
        f"SGD {verdict['measured_sgd_s_per_iter']:.3f} s/iter -> overhead {measured:.3f} s "
        f"(rounds: {per_round}) <= {verdict['max_overhead_s']} s: {status}"
    )
    if not like_for_like:
        lines.append("note: batch size differs from the reference setting")
    if quick:
        lines.append("note: --quick run, too few iterations for a meaningful comparison")
    return "\n".join(lines)


def _target_phases(row: Mapping[str, Any]) -> dict[str, float]:
    """Seconds per iteration of :data:`TARGET_PHASES` and ``other`` for one K-FAC row.

    ``other`` is the median iteration time less every recorded phase (forward, backward, DDP,
    optimizer); the phases are window means and the iteration time a median, so it is an
    estimate.
    """
    recorded = {name: float(value) for name, value in row.get("phase_s", {}).items()}
    phases = {name: recorded.get(name, 0.0) for name in TARGET_PHASES}
    return phases | {"other": float(row["median_s"]) - sum(recorded.values())}


def evaluate_pipelined_target(
    rows: Sequence[Mapping[str, Any]], target: PipelinedTarget
) -> dict[str, Any]:
    """Whether the target's strategies are fast enough against its baseline.

    For every model measured at ``target.nprocs`` with ``target.schedule`` ``(f,i)``, the
    median iteration time (``median_s``) of each strategy's ``<strategy>_f_i`` row is compared
    with the baseline's: ``speedup = baseline / strategy - 1``, met when
    ``speedup >= target.min_speedup``. Every comparison carries the per-phase seconds of both
    rows so that a miss can be explained.

    Args:
        rows: The summary rows of :func:`dkfac.bench.report.summary_rows`.
        target: What is compared and the least speedup.

    Returns:
        The target's fields (:meth:`~dkfac.bench.targets.PipelinedTarget.as_verdict`) plus
        ``evaluated``, ``reason`` (why it was not evaluated, else ``None``), ``comparisons``
        (one dict per model and strategy) and ``met`` (every comparison met; ``None`` when
        not evaluated).

    """
    nprocs, (f, i) = target.nprocs, target.schedule
    verdict: dict[str, Any] = {
        **target.as_verdict(),
        "evaluated": False,
        "reason": None,
        "comparisons": [],
        "met": None,
    }
    at_nprocs = [row for row in rows if row["nprocs"] == nprocs]
    if not at_nprocs:
        verdict["reason"] = f"P={nprocs} was not run"
        return verdict
    comparisons: list[dict[str, Any]] = []
    for model in dict.fromkeys(row["model"] for row in at_nprocs):
        found = {row["key"]: row for row in at_nprocs if row["model"] == model}
        baseline = found.get(f"{target.baseline}_{f}_{i}")
        if baseline is None:
            continue
        baseline_phases = _target_phases(baseline)
        for strategy in target.strategies:
            row = found.get(f"{strategy}_{f}_{i}")
            if row is None:
                continue
            speedup = baseline["median_s"] / row["median_s"] - 1.0
            phases = _target_phases(row)
            comparisons.append(
                {
                    "model": model,
                    "strategy": strategy,
                    "key": row["key"],
                    "baseline_key": baseline["key"],
                    "strategy_s": row["median_s"],
                    "baseline_s": baseline["median_s"],
                    "speedup": speedup,
                    "speedup_pct": 100.0 * speedup,
                    "met": bool(speedup >= target.min_speedup),
                    "phase_s": phases,
                    "baseline_phase_s": baseline_phases,
                    "phase_delta_s": {
                        name: phases[name] - baseline_phases[name] for name in phases
                    },
                }
            )
    if not comparisons:
        strategies = "/".join(target.strategies)
        verdict["reason"] = (
            f"{target.baseline} and {strategies} at ({f},{i}) were not both run at P={nprocs}"
        )
        return verdict
    return verdict | {
        "evaluated": True,
        "comparisons": comparisons,
        "met": all(c["met"] for c in comparisons),
    }


def _signed_ms(seconds: float) -> str:
    return f"{1e3 * seconds:+.1f}"


def format_pipelined_target(verdict: Mapping[str, Any], *, quick: bool = False) -> str:
    """Render the spd/pad vs dkfac verdicts: a heading, then one line per model and strategy.

    A line gives both median iteration times, the speedup and, per phase, the milliseconds of
    dkfac then of the strategy (and the difference). A miss also says by how much it misses
    and which phases got slower.

    Args:
        verdict: The result of :func:`evaluate_pipelined_target`.
        quick: Whether this was a ``--quick`` run (adds a note).

    Returns:
        The lines, joined; a single line when the target was not evaluated.

    """
    f, i = verdict["schedule"]
    minimum = 100.0 * verdict["min_speedup"]
    where = f"P={verdict['nprocs']}, ({f},{i})"
    heading = (
        f"target {'/'.join(verdict['strategies'])} vs {verdict['baseline']} ({where}, >= "
        f"{minimum:.0f}% faster per factor-update iteration)"
    )
    if not verdict["evaluated"]:
        return f"{heading}: not evaluated ({verdict['reason']})"
    comparisons = verdict["comparisons"]
    met = sum(1 for c in comparisons if c["met"])
    lines = [
        f"{heading}: {'MET' if verdict['met'] else 'NOT MET'} ({met} of {len(comparisons)}); "
        "median s/iter (median over rounds), phases dkfac -> strategy in mean ms per "
        "iteration, other = the rest of the iteration (forward, backward, DDP, optimizer)"
    ]
    for c in verdict["comparisons"]:
        speedup = c["speedup_pct"]
        faster = f"{speedup:.1f}% faster" if speedup >= 0 else f"{-speedup:.1f}% slower"
        phases = ", ".join(
            f"{name} {format_ms(c['baseline_phase_s'][name])} -> "
            f"{format_ms(c['phase_s'][name])} ms "
            f"({_signed_ms(c['phase_delta_s'][name])})"
            for name in c["phase_s"]
        )
        status = "MET"
        if not c["met"]:
            allowed_s = c["baseline_s"] / (1.0 + verdict["min_speedup"])
            slower = sorted(
                ((delta, name) for name, delta in c["phase_delta_s"].items() if delta > 0),
                reverse=True,
            )
            why = (
                "slower: " + ", ".join(f"{name} {_signed_ms(delta)} ms" for delta, name in slower)
                if slower
                else "no phase slower, the savings are too small"
            )
            status = f"NOT MET ({format_ms(c['strategy_s'] - allowed_s)} ms/iter short; {why})"
        lines.append(
            f"target {c['strategy']} vs {verdict['baseline']}, "
            f"{MODEL_LABELS.get(c['model'], c['model'])}, {where}: {c['strategy_s']:.3f} vs "
            f"{c['baseline_s']:.3f} s/iter -> {faster} (>= {minimum:.0f}%): {status}; {phases}"
        )
    if quick:
        lines.append("note: --quick run, too few iterations for a meaningful comparison")
    return "\n".join(lines)


def _status(met: bool) -> str:
    return "MET" if met else "NOT MET"


def format_times(value: float | None) -> str:
    """A ratio as ``12.07x``; ``n/a`` for ``None``."""
    return "n/a" if value is None else f"{value:.2f}x"


def evaluate_dry_run_target(
    ratios: Sequence[Mapping[str, Any]], target: DryRunTarget
) -> list[dict[str, Any]]:
    """Whether DP-KFAC's ratios to D-KFAC meet ``target``, per world size.

    Args:
        ratios: Per world size, the result of :func:`dkfac.bench.dry_run.dry_run_ratios`.
        target: The least communication and memory ratios.

    Returns:
        Per world size, the ratios plus ``target`` (the two thresholds),
        ``communication_met``, ``memory_met`` and ``met``; where the ratios were not
        evaluated, only ``nprocs``, ``evaluated`` and ``met`` (``None``).

    """
    verdicts: list[dict[str, Any]] = []
    for entry in ratios:
        if not entry["evaluated"]:
            verdicts.append({"nprocs": entry["nprocs"], "evaluated": False, "met": None})
            continue
        communication, memory = entry["communication"], entry["memory"]
        verdict: dict[str, Any] = {
            **entry,
            "target": {"communication": target.communication, "memory": target.memory},
            "communication_met": communication is not None
            and communication >= target.communication,
            "memory_met": memory is not None and memory >= target.memory,
        }
        verdict["met"] = verdict["communication_met"] and verdict["memory_met"]
        verdicts.append(verdict)
    return verdicts


def format_dry_run_target(verdict: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    """The target line of one world size of a dry run (not wrapped).

    Args:
        verdict: One entry of :func:`evaluate_dry_run_target` (evaluated).
        target: The report's ``dry_run_target`` (the :class:`~dkfac.bench.targets.DryRunTarget`
            as a dict: its ``source`` and ``nprocs`` are printed).

    Returns:
        The line.

    """
    p, thresholds = verdict["nprocs"], verdict["target"]
    communication, memory = thresholds["communication"], thresholds["memory"]
    other_p = (
        "" if p == target["nprocs"] else f" [the target's figures are for P={target['nprocs']}]"
    )
    return (
        f"target ({target['source']}: >= {communication}x less communication and >= "
        f"{memory}x less memory per second-order update than D-KFAC) at P={p}: communication "
        f"{_status(verdict['communication_met'])} ({format_times(verdict['communication'])} vs "
        f"{communication}x), memory {_status(verdict['memory_met'])} "
        f"({format_times(verdict['memory'])} vs {memory}x){other_p}"
    )
