"""The results of ``dkfac bench``: summary rows, the table, the printed summary, the chart.

The targets the summary reports (only when a targets file was given) are evaluated in
:mod:`dkfac.bench.verdicts`. The chart stacks the phases of every configuration
(:func:`write_chart`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dkfac.bench.configs import (
    DEAR_SGD,
    INVERSE_METHOD,
    LR,
    MODEL_LABELS,
    MOMENTUM,
    PHASES,
    SGD,
    uses_dear,
)
from dkfac.bench.dry_run import format_dry_run, write_dry_run_chart
from dkfac.bench.targets import NO_TARGETS_LINE
from dkfac.bench.verdicts import format_ms, format_pipelined_target, format_target

MB = 1e6

#: Stacked segments of the chart, bottom to top: (key, legend label, colour, hatch).
CHART_SEGMENTS: tuple[tuple[str, str, str, str], ...] = (
    ("other", "forward+backward, DDP, optimizer (other)", "#c7c7c7", ""),
    ("factor_compute", "factor_compute", "#1f77b4", ""),
    ("factor_comm", "factor_comm", "#9ecae1", "///"),
    ("inverse_compute", "inverse_compute", "#2ca02c", ""),
    ("inverse_comm", "inverse_comm", "#a1d99b", "///"),
    ("precondition", "precondition", "#9467bd", ""),
    ("grad_comm", "grad_comm", "#ff9f4a", "///"),
)


def summary_rows(
    launches: Sequence[tuple[int, Mapping[str, Any] | None]], models: Sequence[str]
) -> list[dict[str, Any]]:
    """One flat row per (model, P, configuration) from ``(P, worker report)`` pairs."""
    rows = []
    for model in models:
        for nprocs, report in launches:
            if report is None:
                continue
            for key, entry in report["summary"].get(model, {}).items():
                rows.append({"model": model, "nprocs": nprocs, "key": key, **entry})
    return rows


def schedule_of(row: Mapping[str, Any]) -> str:
    """``"(f,i)"`` of a K-FAC row, ``"-"`` for SGD."""
    if row["strategy"] is None:
        return "-"
    return f"({row['factor_update_steps']},{row['inv_update_steps']})"


def phase_cell(row: Mapping[str, Any], name: str) -> str:
    """A phase's ms per iteration, or ``-`` where the row does not record it (DeAR's K-FAC)."""
    value = row.get("phase_s", {}).get(name)
    return "-" if value is None else format_ms(value)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Render the summary rows as a fixed-width table."""
    # As wide as the longest model name (``transformer``), at least as wide as ``resnet20``.
    model_width = max([8, *(len(row["model"]) for row in rows)])
    columns: list[tuple[str, int]] = [
        ("model", model_width),
        ("P", 2),
        ("config", max([11, *(len(row["label"]) for row in rows)])),
        ("(f,i)", 8),
        ("amort s/it", 10),
        ("median s/it", 11),
        ("overhead s", 10),
        ("overhead %", 10),
        ("f_comm", 7),
        ("i_comm", 7),
        ("g_comm", 7),
        ("f_comp", 7),
        ("i_comp", 7),
        ("precond", 7),
        ("MB/step", 7),
        ("mem MB", 7),
    ]
    left = {"model", "config", "(f,i)"}

    def line(cells: Sequence[str]) -> str:
        return " ".join(
            f"{cell:<{width}}" if name in left else f"{cell:>{width}}"
            for cell, (name, width) in zip(cells, columns, strict=True)
        )

    header = line([name for name, _ in columns])
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = [
            row["model"],
            str(row["nprocs"]),
            row["label"],
            schedule_of(row),
            f"{row['amortized_s']:.4f}",
            f"{row['median_s']:.4f}",
        ]
        if row["overhead_s"] is not None:
            cells += [f"{row['overhead_s']:+.4f}", f"{row['overhead_pct']:+.1f}%"]
            cells += [phase_cell(row, name) for name in PHASES]
            memory = row.get("kfac_memory_bytes")
            cells += [
                f"{row['bytes_per_step']['total'] / MB:.2f}",
                "-" if memory is None else f"{memory / MB:.2f}",
            ]
        else:
            cells += ["-"] * (len(columns) - len(cells))
        lines.append(line(cells))
    lines += [
        "amort = window wall time (max over ranks) / iterations, median over rounds; median = "
        "median per-iteration time (max over ranks);",
        "overhead = amort - amort SGD of the same round (median over rounds; negative: faster); "
        "f_comm .. precond = mean ms per iteration of pre.timings() (mean over ranks);",
        "MB/step = comm_stats() payload bytes per iteration / 1e6 (mean over ranks); mem MB = "
        "factors + decompositions held per worker / 1e6 (max over ranks).",
    ]
    if any(row["key"] == DEAR_SGD.key for row in rows):
        lines.append(
            "SGD (DeAR): DeAR averages the gradients instead of DDP, no K-FAC; g_comm = its "
            "exposed reduce-scatter and all-gather waits (dear.timings()), MB/step its gradients."
        )
    if any(row.get("gradient_sync") == DEAR_SGD.key and row.get("strategy") for row in rows):
        lines.append(
            "K-FAC + DeAR: DeAR averages the gradients, gathered before preconditioning; g_comm "
            "is K-FAC's own (as in the DDP rows), MB/step adds DeAR's gradients (DDP's are not "
            "counted)."
        )
    return "\n".join(lines)


def format_summary(report: Mapping[str, Any]) -> str:
    """Everything printed after a run: setting, table, reference line, both targets, failures.

    A report without targets (no ``--targets``) gets the line :data:`NO_TARGETS_LINE`
    instead of the reference line and the targets. A dry run's report (``--layers``) is
    rendered by :func:`~.bench_dry_run.format_dry_run`.
    """
    if report.get("benchmark") == "dry_run":
        return format_dry_run(report)
    env, settings = report["environment"], report["settings"]
    schedules = [tuple(s) for s in settings["schedules"]]
    dear = DEAR_SGD.key in settings["strategies"]
    any_dear = uses_dear(settings["strategies"])
    baselines = ["SGD", "DeAR"] if dear else ["SGD"]
    short = ", ".join([*baselines, *(f"({f},{i})" for f, i in schedules if f == i == 1)])
    long = ", ".join(f"({f},{i})" for f, i in schedules if f > 1 or i > 1) or "none"
    lines = [
        f"torch {env['torch_version']}, dkfac {env['dkfac_version']}, cpus {env['cpu_count']}, "
        f"python {env['python_version']}, {env['platform']}, {env['date_utc']}",
        f"{', '.join(MODEL_LABELS[m] for m in settings['models'])}; P in "
        f"{', '.join(map(str, settings['nprocs']))}; gloo, 1 thread/process; batch "
        f"{settings['batch_size_per_worker']} per worker; SGD(lr={LR}, momentum={MOMENTUM}) + "
        f"{'DDP or DeAR' if any_dear else 'DDP'}; K-FAC {INVERSE_METHOD}; rounds "
        f"{settings['rounds']}, warm-up "
        f"{settings['warmup']}, timed iterations {settings['iters']} ({short}) / "
        f"{settings['iters_long']} ({long})",
        "",
        format_table(report["summary"]),
        "",
    ]
    if report.get("target") is None:
        lines.append(NO_TARGETS_LINE)
    else:
        lines.append(
            format_target(
                report["target"],
                report["reference"]["line"],
                like_for_like=settings["batch_size_per_worker"] == 32,
                quick=settings["quick"],
            )
        )
        pipelined = report.get("pipelined_target")
        if pipelined is not None:
            lines.append(format_pipelined_target(pipelined, quick=settings["quick"]))
    for item in report["launches"]:
        if item["ok"]:
            continue
        reason = "timed out" if item["timed_out"] else f"returncode {item['returncode']}"
        lines += ["", f"launch P={item['nprocs']} FAILED ({reason}); last output lines:"]
        lines += item["output_tail"][-40:]
    return "\n".join(lines)


def phase_ms(row: Mapping[str, Any]) -> dict[str, float]:
    """The chart segments of one row in ms per iteration; ``other`` is the rest of the time."""
    total = 1e3 * row["amortized_s"]
    kfac = {name: 1e3 * float(row.get("phase_s", {}).get(name, 0.0)) for name in PHASES}
    return {"other": max(0.0, total - sum(kfac.values())), **kfac}


def write_chart(
    rows: Sequence[Mapping[str, Any]], path: Path, *, subtitle: str = ""
) -> Path | None:
    """A stacked horizontal bar per configuration (ms/iter by phase); None without matplotlib.

    Rows of a dry run (``--layers``) get :func:`~.bench_dry_run.write_dry_run_chart` instead
    (bytes and memory per worker; ``subtitle`` does not apply).
    """
    if rows and rows[0].get("dry_run"):
        return write_dry_run_chart(rows, path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return None
    if not rows:
        return None
    count = len(rows)
    figure, axes = plt.subplots(figsize=(12, 2.4 + 0.5 * count))
    positions = list(range(count))
    segments = [phase_ms(row) for row in rows]
    left = [0.0] * count
    for key, label, colour, hatch in CHART_SEGMENTS:
        widths = [segment[key] for segment in segments]
        if key != "other" and not any(widths):
            continue
        axes.barh(
            positions,
            widths,
            left=left,
            height=0.68,
            label=label,
            color=colour,
            hatch=hatch,
            edgecolor="white",
            linewidth=0.6,
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    labels = []
    sgd_totals: dict[tuple[str, int], float] = {}
    for row in rows:
        if row["key"] == SGD.key:
            sgd_totals[(row["model"], row["nprocs"])] = 1e3 * row["amortized_s"]
    for position, row, end in zip(positions, rows, left, strict=True):
        group = f"{MODEL_LABELS.get(row['model'], row['model'])} P={row['nprocs']}"
        if row["overhead_pct"] is None:
            labels.append(f"{group}  {row['label']} - reference")
            note = f"{end:,.0f} ms"
        else:
            schedule = "" if row["strategy"] is None else f" {schedule_of(row)}"
            labels.append(f"{group}  {row['label']}{schedule}")
            note = f"{end:,.0f} ms ({row['overhead_pct']:+.0f}% vs SGD)"
        axes.text(
            end,
            position,
            f" {note}",
            va="center",
            ha="left",
            fontsize=9,
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0},
        )
    for index, row in enumerate(rows):
        reference = sgd_totals.get((row["model"], row["nprocs"]))
        if reference is not None:
            axes.vlines(
                reference, index - 0.45, index + 0.45, colors="black", linestyles="dashed", lw=1
            )
    for index in range(1, count):
        previous, current = rows[index - 1], rows[index]
        if (previous["model"], previous["nprocs"]) != (current["model"], current["nprocs"]):
            axes.axhline(index - 0.5, color="grey", lw=0.8)
    axes.set_yticks(positions, labels, fontsize=10)
    axes.set_ylim(count - 0.4, -0.6)  # first row on top, little padding
    axes.set_xlim(0, 1.3 * max(left))
    axes.set_xlabel("ms per iteration (amortized over the timed window)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    title = "dkfac bench: time per iteration by phase"
    axes.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize=11)
    handles, names = axes.get_legend_handles_labels()
    handles.append(Line2D([], [], color="black", linestyle="dashed", lw=1))
    names.append("SGD of the same model and P")
    axes.legend(
        handles, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
