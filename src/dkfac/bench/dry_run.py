"""``dkfac bench --layers resnet50``: the strategies' bytes, decomposition work and memory.

A dry run: no training, no process group. From a model's layer shapes, every strategy's
per-worker accounting of one second-order update (one factor update + one decomposition +
one preconditioning) is computed by :mod:`dkfac.strategies.accounting`, which calls the
strategies' own planners, grouping and packing rules. The report gives DP-KFAC's ratios to
D-KFAC (how many times less it sends and holds) and, when a targets file was given, whether
they meet its :class:`~dkfac.bench.targets.DryRunTarget` (``benchmarks/targets.json``: the
DP-KFAC paper's figures, docs/strategies.md).

SPD-KFAC and PAD-KFAC place factors with a cost model, which a dry run cannot measure: it
uses the NOMINAL constants of :data:`NOMINAL_COST_MODEL` (or the ones given on the command
line) and says so in its output. They change only where spd/pad put factors, never the bytes
of dkfac, kaisa or dp.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.configs import INVERSE_METHOD, environment, strategy_key
from dkfac.bench.targets import NO_TARGETS_LINE, DryRunTarget
from dkfac.bench.verdicts import evaluate_dry_run_target, format_dry_run_target, format_times
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel, CubicCost
from dkfac.comm.wire import element_size, wire_bytes
from dkfac.curvature.factor_side import diagonal_flags
from dkfac.strategies.accounting import DryRunSettings, account_strategy, summarize_accounts
from dkfac.strategies.layer_shapes import LayerShape, resnet50_layer_shapes
from dkfac.strategies.registry import strategy_names

MB = 1e6
#: Width the prose lines of the printed report are wrapped to.
WIDTH = 110
#: Unit of the decomposition work column: 10⁹ ``d³``.
GIGA = 1e9

#: Nominal constants for the spd/pad placement of a dry run: NOT measured. alpha: 50 µs
#: start-up per collective; beta: a ring allreduce on 100 Gb/s links (2 bytes sent per payload
#: byte at 12.5 GB/s); decomposition: 1 ms fixed plus 1e-11 s·d³ (a 4096-wide eigh in about
#: 0.7 s). Measure a real cluster with ``dkfac.comm.CostModelCache().get(...)``.
NOMINAL_COST_MODEL = ClusterCostModel(AlphaBeta(5e-5, 1.6e-10), CubicCost(1e-3, 1e-11))

#: Default world size of a dry run (the paper's 64 GPUs).
DRY_RUN_NPROCS = 64

COUNTED = (
    "counted per worker, one second-order update (one factor update + one decomposition + one "
    "preconditioning, a (1,1) step), K-FAC's own collectives only: factor_comm (dkfac, kaisa, "
    "spd: allreduce of the packed upper triangles of every factor + float64 counts; pad: "
    "reduce of each factor to its owner), inverse_comm (decomposition broadcasts from the "
    "owners: Q and lambda + a validity flag per factor; pad sharing decompositions with the "
    "inverse method also exchanges traces), grad_comm (broadcasts of preconditioned gradients: "
    "kaisa f<1, dp, and pad, whose share='auto' sends them instead of decompositions when they "
    "are fewer bytes per step, as at a (1,1) step). "
    "EXCLUDED: DDP's gradient allreduce (the same for every strategy, shown on its own line) "
    "and one-off collectives (spd/pad's re-plan after profiling, cost-model calibration)."
)
UNITS = (
    "sent = comm_stats() wire_bytes: bytes a worker sends with bandwidth-optimal collectives "
    "(allreduce 2(P-1)/P, reduce and broadcast (P-1)/P of the payload); payload = comm_stats() "
    "bytes (the collectives' sizes); decomp = sum of d^3 over the factors a worker decomposes "
    "(1e9); memory = running factors (full d x d) + decompositions a worker holds; MB = 1e6 "
    "bytes; max and mean over the P workers."
)


def dry_run_models() -> dict[str, Callable[[], list[LayerShape]]]:
    """Layer lists a dry run knows, by ``--layers`` name."""
    return {"resnet50": resnet50_layer_shapes}


def dry_run_configurations(
    world_size: int, strategies: Sequence[str]
) -> list[tuple[str, str, float]]:
    """``(label, strategy, grad_worker_fraction)``; kaisa at ``f = 1/P`` and ``f = 1``."""
    configs: list[tuple[str, str, float]] = []
    for strategy in strategy_names(distributed=True):
        if strategy not in strategies:
            continue
        if strategy == "kaisa":
            configs.append((f"kaisa f=1/{world_size}", "kaisa", 1.0 / world_size))
            configs.append(("kaisa f=1", "kaisa", 1.0))
        else:
            configs.append((strategy, strategy, 1.0))
    return configs


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def dry_run_ratios(
    rows: Sequence[Mapping[str, Any]], ddp_sent: Mapping[int, int]
) -> list[dict[str, Any]]:
    """DP-KFAC against D-KFAC per world size: how many times less it sends and holds (max).

    Args:
        rows: The dry run's summary rows.
        ddp_sent: Per world size, the bytes a worker sends in DDP's gradient allreduce.

    Returns:
        Per world size, ``nprocs``, ``evaluated`` (whether both dkfac and dp were counted) and,
        when they were, the ratios (``None`` where dp's side is zero).

    """
    ratios: list[dict[str, Any]] = []
    for nprocs in sorted({row["nprocs"] for row in rows}):
        found = {row["key"]: row for row in rows if row["nprocs"] == nprocs}
        base, dp = found.get("dkfac"), found.get("dp")
        if base is None or dp is None:
            ratios.append({"nprocs": nprocs, "evaluated": False})
            continue
        ddp = ddp_sent[nprocs]
        ratios.append(
            {
                "nprocs": nprocs,
                "evaluated": True,
                "communication": _ratio(base["wire_bytes"]["max"], dp["wire_bytes"]["max"]),
                "communication_payload": _ratio(
                    base["payload_bytes"]["max"], dp["payload_bytes"]["max"]
                ),
                "communication_with_ddp_allreduce": _ratio(
                    base["wire_bytes"]["max"] + ddp, dp["wire_bytes"]["max"] + ddp
                ),
                "memory": _ratio(base["memory_bytes"]["max"], dp["memory_bytes"]["max"]),
                "memory_mean": _ratio(base["memory_bytes"]["mean"], dp["memory_bytes"]["mean"]),
                "decomposition_work": _ratio(
                    base["decomposition_work"]["max"], dp["decomposition_work"]["max"]
                ),
            }
        )
    return ratios


def dry_run_report(
    layers: str,
    nprocs: Sequence[int],
    strategies: Sequence[str],
    *,
    cost_model: ClusterCostModel = NOMINAL_COST_MODEL,
    bucket_cap_mb: float = 25.0,
    target: DryRunTarget | None = None,
    targets_file: str | None = None,
) -> dict[str, Any]:
    """The dry-run report (JSON-ready): one summary row per world size and configuration.

    Args:
        layers: The layer list (:func:`dry_run_models`).
        nprocs: The world sizes.
        strategies: The strategies counted.
        cost_model: The constants of spd/pad's placement.
        bucket_cap_mb: The fusion bucket.
        target: The ratios DP-KFAC must reach; ``None``: ``target`` and ``dry_run_target``
            of the report are ``None`` (nothing is evaluated).
        targets_file: The file ``target`` was read from (recorded as ``targets_file``).

    Returns:
        The report.

    Raises:
        ValueError: an unknown layer list, or a world size below 2.
    """
    models = dry_run_models()
    if layers not in models:
        raise ValueError(f"--layers {layers!r}: choose from {', '.join(models)}")
    if min(nprocs) < 2:
        raise ValueError("a dry run needs world sizes of at least 2")
    shapes = models[layers]()
    grad_dtype = torch.float32
    parameters = sum(s.a_dim * s.g_dim for s in shapes)
    gradient_bytes = parameters * element_size(grad_dtype)  # what DDP allreduces (these layers)
    rows: list[dict[str, Any]] = []
    ddp_sent: dict[int, int] = {}
    for world_size in nprocs:
        settings = DryRunSettings(
            world_size,
            inverse_method=INVERSE_METHOD,
            bucket_cap_mb=bucket_cap_mb,
            grad_dtype=grad_dtype,
            cost_model=cost_model,
        )
        for label, strategy, fraction in dry_run_configurations(world_size, strategies):
            accounts = account_strategy(strategy, shapes, settings, grad_worker_fraction=fraction)
            key = strategy_key(strategy, round(1 / fraction))
            rows.append(
                {
                    "dry_run": True,
                    "model": layers,
                    "nprocs": world_size,
                    "key": key,
                    "label": label,
                    "strategy": strategy,
                    "grad_worker_fraction": fraction,
                    **summarize_accounts(accounts),
                }
            )
        ddp_sent[world_size] = wire_bytes("allreduce", gradient_bytes, world_size)
    return {
        "benchmark": "dry_run",
        "environment": environment(),
        "settings": {
            "layers": layers,
            "layer_count": len(shapes),
            "preconditioned_parameters": parameters,
            "nprocs": list(nprocs),
            "strategies": list(strategies),
            "inverse_method": INVERSE_METHOD,
            "factor_dtype": "float32",
            "inv_dtype": "float32",
            "grad_dtype": "float32",
            "bucket_cap_mb": bucket_cap_mb,
            "cost_model": {**cost_model.as_dict(), "measured": False},
            "counted": COUNTED,
            "units": UNITS,
            # Nothing is timed in a dry run (kept for the `dkfac bench` chart subtitle).
            "batch_size_per_worker": None,
            "rounds": None,
            "iters": None,
            "iters_long": None,
            "quick": False,
        },
        "layers": [
            {"name": s.name, "a_dim": int(s.a_dim), "g_dim": int(s.g_dim), **diagonal_flags(s.dims)}
            for s in shapes
        ],
        "launches": [],
        "summary": rows,
        "ddp_gradient_allreduce": {
            str(p): {"payload_bytes": gradient_bytes, "wire_bytes": sent}
            for p, sent in ddp_sent.items()
        },
        "targets_file": targets_file,
        "dry_run_target": None if target is None else dataclasses.asdict(target),
        "target": None
        if target is None
        else evaluate_dry_run_target(dry_run_ratios(rows, ddp_sent), target),
    }


def format_dry_run_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The fixed-width table of a dry run's rows."""
    header = (
        f"{'P':>3} {'strategy':<14} {'sent MB max':>11} {'mean':>9} {'payload MB max':>14} "
        f"{'mean':>9} {'decomp 1e9 max':>14} {'mean':>8} {'mem MB max':>10} {'mean':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['nprocs']:>3} {row['label']:<14} "
            f"{row['wire_bytes']['max'] / MB:>11.2f} {row['wire_bytes']['mean'] / MB:>9.2f} "
            f"{row['payload_bytes']['max'] / MB:>14.2f} {row['payload_bytes']['mean'] / MB:>9.2f} "
            f"{row['decomposition_work']['max'] / GIGA:>14.2f} "
            f"{row['decomposition_work']['mean'] / GIGA:>8.2f} "
            f"{row['memory_bytes']['max'] / MB:>10.2f} {row['memory_bytes']['mean'] / MB:>9.2f}"
        )
    return "\n".join(lines)


def format_dry_run(report: Mapping[str, Any]) -> str:
    """Everything a dry run prints: setting, table, what is counted, constants, ratios."""
    settings = report["settings"]
    cost = settings["cost_model"]
    prose = [
        f"DRY RUN (no training, no process group): {settings['layers']} "
        f"({settings['layer_count']} preconditioned layers, "
        f"{settings['preconditioned_parameters']:,} parameters), P in "
        f"{', '.join(map(str, settings['nprocs']))}, K-FAC {settings['inverse_method']}, "
        f"float32 factors, decompositions and gradients, {settings['bucket_cap_mb']:g} MiB "
        "buckets; the strategies' own planners and packing rules",
    ]
    lines = [_wrap(line) for line in prose] + ["", format_dry_run_table(report["summary"]), ""]
    prose = [
        settings["counted"],
        settings["units"],
        f"cost model for the spd/pad placement only, NOMINAL (not measured): alpha = "
        f"{cost['alpha_s']:g} s, beta = {cost['beta_s_per_byte']:g} s/byte, decomposition = "
        f"{cost['decomposition_c0_s']:g} s + {cost['decomposition_c3_s']:g} s * d^3",
    ]
    for p, ddp in report["ddp_gradient_allreduce"].items():
        prose.append(
            f"DDP gradient allreduce at P={p} (excluded above, the same for every strategy): "
            f"{ddp['wire_bytes'] / MB:.2f} MB sent per worker ({ddp['payload_bytes'] / MB:.2f} "
            "MB payload, preconditioned layers' parameters only)"
        )
    lines += [_wrap(line) for line in prose] + [""]
    ddp_sent = {int(p): ddp["wire_bytes"] for p, ddp in report["ddp_gradient_allreduce"].items()}
    verdicts = {v["nprocs"]: v for v in report.get("target") or []}
    target = report.get("dry_run_target")
    for ratios in dry_run_ratios(report["summary"], ddp_sent):
        p = ratios["nprocs"]
        if not ratios["evaluated"]:
            lines.append(f"ratios dp vs dkfac at P={p}: not evaluated (needs dkfac and dp)")
            continue
        times = {k: format_times(v) for k, v in ratios.items() if k not in ("nprocs", "evaluated")}
        lines.append(
            _wrap(
                f"ratios dp vs dkfac at P={p} (dkfac / dp, max per worker): communication "
                f"{times['communication']} less sent (payload "
                f"{times['communication_payload']}; with DDP's gradient allreduce counted for "
                f"both {times['communication_with_ddp_allreduce']}), memory {times['memory']} "
                f"less (mean {times['memory_mean']}), decomposition work "
                f"{times['decomposition_work']} (not a target)"
            )
        )
        if target is not None and p in verdicts:
            lines.append(_wrap(format_dry_run_target(verdicts[p], target)))
    if target is None:
        lines.append(NO_TARGETS_LINE)
    return "\n".join(lines)


def _wrap(line: str) -> str:
    """A prose line wrapped to :data:`WIDTH`, continuation lines indented."""
    return textwrap.fill(line, WIDTH, subsequent_indent="  ")


def write_dry_run_chart(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Bars of bytes sent and memory per worker (max) per strategy; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not rows:
        return None
    labels = [f"P={row['nprocs']} {row['label']}" for row in rows]
    panels = (
        ("wire_bytes", "MB sent per worker (max), one second-order update"),
        ("memory_bytes", "MB of factors + decompositions per worker (max)"),
    )
    figure, axes = plt.subplots(1, 2, figsize=(13, 1.6 + 0.45 * len(rows)), sharey=True)
    positions = list(range(len(rows)))
    for axis, (key, title) in zip(axes, panels, strict=True):
        values = [row[key]["max"] / MB for row in rows]
        axis.barh(positions, values, color="#1f77b4", height=0.65)
        for position, value in zip(positions, values, strict=True):
            axis.text(value, position, f" {value:,.0f}", va="center", fontsize=9)
        axis.set_title(title, fontsize=10)
        axis.set_xlim(0, 1.25 * max(values))
        axis.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(positions, labels, fontsize=10)
    axes[0].invert_yaxis()
    model = rows[0]["model"]
    figure.suptitle(f"dkfac bench dry run: {model} (computed from layer shapes, not measured)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
