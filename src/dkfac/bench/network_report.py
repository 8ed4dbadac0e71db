"""``dkfac bench`` at several link rates: the combined report, its tables and its chart.

``benchmarks/network.py`` runs :func:`dkfac.bench.command.run_bench` once per rate on an
emulated cluster (:mod:`dkfac.bench.emulated_cluster`) and hands the reports here:
:func:`combine_rates` makes one JSON-ready report of them (every launch, with the rate it ran
at), :func:`format_rate_tables` the tables per model (median iteration time per rate, then per
rate the phases and bytes per step) and :func:`write_rate_chart` the median iteration time
against the rate, one line per configuration and one panel per model. The tables and the
chart read only the combined report, so a saved JSON can be rendered again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dkfac.bench.configs import MODEL_LABELS, SGD, environment
from dkfac.bench.link_shape import LinkShape
from dkfac.bench.report import MB, schedule_of
from dkfac.bench.text_table import fixed_width_table
from dkfac.bench.verdicts import format_ms

#: Phases of the per-rate tables: K-FAC's communication, DeAR's or K-FAC's gradient waits,
#: and K-FAC's own compute (``factor_compute + inverse_compute + precondition``).
RATE_PHASES: tuple[str, ...] = ("factor_comm", "inverse_comm", "grad_comm", "compute")
COMPUTE_PHASES: tuple[str, ...] = ("factor_compute", "inverse_compute", "precondition")


def combine_rates(
    settings: Mapping[str, Any], runs: Sequence[tuple[str, LinkShape, Mapping[str, Any]]]
) -> dict[str, Any]:
    """One report of ``run_bench``'s reports at several rates (JSON-ready).

    Args:
        settings: The settings shared by every rate (``BenchOptions.settings()``); its
            ``network`` entry is replaced by the list of rates.
        runs: ``(rate as given, its link, run_bench's report)`` per rate.

    Returns:
        ``benchmark: "network"``, the environment, the settings, ``runs`` (per rate: the rate as
        given, its label, its link and the whole report, launches included) and ``summary``:
        every summary row of every rate with ``rate``, ``rate_bit_s`` and ``link`` added.
    """
    summary = []
    for text, link, report in runs:
        for row in report["summary"]:
            summary.append({"rate": text, "rate_bit_s": link.rate_bit_s, "link": link.label()})
            summary[-1] |= row
    return {
        "benchmark": "network",
        "environment": environment(),
        "settings": {
            **settings,
            "network": [link.as_dict() for _, link, _ in runs],
            "rates": [text for text, _, _ in runs],
        },
        "runs": [
            {
                "rate": text,
                "rate_bit_s": link.rate_bit_s,
                "label": link.label(),
                "link": link.as_dict(),
                "report": report,
            }
            for text, link, report in runs
        ],
        "summary": summary,
    }


def failed_rates(result: Mapping[str, Any]) -> list[str]:
    """The rates at which some launch did not exit cleanly with a report."""
    return [
        run["rate"]
        for run in result["runs"]
        if any(not launch["ok"] for launch in run["report"]["launches"])
    ]


def _by_rate(
    result: Mapping[str, Any], model: str
) -> tuple[dict[str, Mapping[str, Any]], dict[tuple[str, str], Mapping[str, Any]]]:
    """``model``'s rows: key -> its first row (in the order measured), and by ``(key, rate)``."""
    first: dict[str, Mapping[str, Any]] = {}
    rows: dict[tuple[str, str], Mapping[str, Any]] = {}
    for row in result["summary"]:
        if row["model"] == model:
            first.setdefault(row["key"], row)
            rows[(row["key"], row["rate"])] = row
    return first, rows


def _rates(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(rate as given, label)`` per run, slowest link first."""
    runs = sorted(result["runs"], key=lambda run: run["rate_bit_s"])
    return [(run["rate"], run["label"]) for run in runs]


def compute_s(row: Mapping[str, Any]) -> float | None:
    """K-FAC's own compute per iteration (``None`` for a row without K-FAC)."""
    if row.get("strategy") is None:
        return None
    phases = row.get("phase_s") or {}
    return sum(float(phases.get(name, 0.0)) for name in COMPUTE_PHASES)


def _phase_cells(row: Mapping[str, Any] | None) -> list[str]:
    """The per-rate table's cells of one row: median, the phases, MB/step."""
    if row is None:
        return ["-"] * (len(RATE_PHASES) + 4)
    phases = row.get("phase_s") or {}
    cells = [format_ms(row["median_s"])]
    for name in RATE_PHASES:
        value = compute_s(row) if name == "compute" else phases.get(name)
        cells.append("-" if value is None else format_ms(value))
    sent = row.get("bytes_per_step")
    cells.append("-" if not sent else f"{sent['total'] / MB:.2f}")
    factor = (row.get("overlap_s") or {}).get("factor_comm")
    if not factor or factor["in_flight_s"] <= 0:
        cells += ["-", "-"]
    else:
        hidden = 100.0 * factor["hidden_s"] / factor["in_flight_s"]
        cells += [format_ms(factor["in_flight_s"]), f"{hidden:.0f}%"]
    return cells


def format_rate_tables(result: Mapping[str, Any]) -> str:
    """Per model: median s/iter per rate (vs DDP + SGD), then per rate phases and bytes."""
    rates = _rates(result)
    nprocs = ", ".join(str(p) for p in result["settings"]["nprocs"])
    blocks = []
    for model in result["settings"]["models"]:
        label_of, rows = _by_rate(result, model)
        keys = list(label_of)
        name = MODEL_LABELS.get(model, model)
        width = max([12, *(len(label_of[key]["label"]) for key in keys)])
        header = ["config", "(f,i)", *(label for _, label in rates)]
        widths = [width, 8, *(max(16, len(label)) for _, label in rates)]
        body = []
        for key in keys:
            cells = [label_of[key]["label"], schedule_of(label_of[key])]
            for rate, _ in rates:
                row, sgd = rows.get((key, rate)), rows.get((SGD.key, rate))
                if row is None:
                    cells.append("-")
                elif key == SGD.key or sgd is None:
                    cells.append(f"{row['median_s']:.4f}")
                else:
                    change = 100.0 * (row["median_s"] / sgd["median_s"] - 1.0)
                    cells.append(f"{row['median_s']:.4f} ({change:+.0f}%)")
            body.append(cells)
        blocks += [
            f"{name}, P={nprocs}: median s/iter per link rate (vs SGD (DDP) at that rate)",
            fixed_width_table(header, widths, body),
            "",
        ]
        for rate, label in rates:
            header = ["config", "(f,i)", "median ms", *RATE_PHASES, "MB/step", "f_flight", "hidden"]
            widths = [width, 8, 9, *(max(7, len(p)) for p in RATE_PHASES), 8, 8, 6]
            body = [
                [
                    label_of[key]["label"],
                    schedule_of(label_of[key]),
                    *_phase_cells(rows.get((key, rate))),
                ]
                for key in keys
            ]
            blocks += [
                f"{name} at {label}: ms per iteration by phase",
                fixed_width_table(header, widths, body),
            ]
            blocks.append("")
    blocks += [
        "median = median per-iteration time (max over ranks), median over rounds; (+x%) its "
        "change from SGD (DDP)'s median at the same rate (negative: faster);",
        "factor_comm, inverse_comm, grad_comm = mean ms per iteration waiting on K-FAC's "
        "collectives (SGD (DeAR): grad_comm = its exposed reduce-scatter and all-gather waits); "
        "compute = K-FAC's factor_compute + inverse_compute + precondition;",
        "MB/step = payload bytes per iteration of the recorded collectives / 1e6 (DDP's own "
        "gradient allreduce is not recorded: '-' for SGD (DDP), and not in the K-FAC rows; "
        "K-FAC + DeAR rows count DeAR's gradients, and their grad_comm is K-FAC's own);",
        "f_flight = ms per iteration K-FAC's factor collectives were in flight (launch to "
        "completion, union); hidden = the share of it while the training thread was not "
        "waiting on them (under forward/backward; pre.comm_overlap()).",
    ]
    return "\n".join(blocks)


def write_rate_chart(result: Mapping[str, Any], path: Path) -> Path | None:
    """Median s/iter against the link rate: one panel per model, one line per configuration.

    Both axes are logarithmic (rates and times span decades). Returns ``None`` without
    matplotlib or without rows.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        return None
    models = [m for m in result["settings"]["models"] if _by_rate(result, m)[0]]
    if not models:
        return None
    rates = {run["rate"]: run["rate_bit_s"] / 1e6 for run in result["runs"]}
    figure, panels = plt.subplots(1, len(models), figsize=(6.4 * len(models), 4.8), squeeze=False)
    handles: dict[str, Any] = {}
    colours: dict[str, str] = {}  # one colour per configuration label, a line style per schedule
    for axes, model in zip(panels[0], models, strict=True):
        first, rows = _by_rate(result, model)
        for key, row in first.items():
            points = sorted(
                (rates[rate], measured["median_s"])
                for (measured_key, rate), measured in rows.items()
                if measured_key == key
            )
            reference = key == SGD.key
            colour = colours.setdefault(
                row["label"], "black" if reference else f"C{len(colours) % 10}"
            )
            schedule = "" if row["strategy"] is None else f" {schedule_of(row)}"
            (line,) = axes.plot(
                [x for x, _ in points],
                [y for _, y in points],
                marker="o",
                linestyle="-" if schedule in ("", " (1,1)") else "--",
                color=colour,
                linewidth=2.2 if reference else 1.5,
            )
            handles.setdefault(f"{row['label']}{schedule}", line)
        axes.set_xscale("log")
        axes.set_yscale("log")
        # Ticks at the measured rates, times as plain seconds: log axes otherwise label powers.
        axes.set_xticks(
            sorted(set(rates.values())), [f"{r:g}" for r in sorted(set(rates.values()))]
        )
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.set_title(MODEL_LABELS.get(model, model), fontsize=11)
        axes.set_xlabel("link rate per worker, each direction (Mbit/s)")
        axes.set_ylabel("median s per iteration")
        axes.grid(which="both", alpha=0.3)
    nprocs = ", ".join(str(p) for p in result["settings"]["nprocs"])
    figure.suptitle(
        f"dkfac bench on an emulated cluster (P={nprocs}, gloo): iteration time vs link rate",
        fontsize=12,
    )
    figure.legend(
        list(handles.values()),
        list(handles),
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=9,
        frameon=False,
        title="configuration (f,i)",
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
