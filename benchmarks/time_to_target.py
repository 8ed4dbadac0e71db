"""Wall-clock time to a target: SGD and AdamW (learning rate tuned by a grid) against dkfac.

For each workload (:mod:`dkfac.bench.workloads`: the digits CNN, the deep autoencoder, the
character-level Transformer on the standard library's sources) and each world size:

1. **Grid**: SGD-momentum and AdamW at each learning rate of their grid, on the grid seeds;
   the rate that reaches the target soonest (else comes closest) is kept. The grid is
   reported in the JSON.
2. **Runs**: the kept SGD and AdamW, and dkfac with its defaults (one configuration for every
   workload: ``--kfac``), on ``--seeds`` seeds numbered after the grid's, every method's run
   of a seed before the next seed's (drift of the machine's speed shifts all methods alike).

Every run has its own processes (one intra-op thread each) and stops at the target or the
workload's time budget (:mod:`dkfac.bench.target_run`). Output: a table (median seconds to
target over the runs that reached it, their range, failures counted), ``time_to_target.json``
with every trace, and ``time_to_target.png``, the metric against training seconds.

Usage::

    .venv/bin/python benchmarks/time_to_target.py                       # everything
    .venv/bin/python benchmarks/time_to_target.py --workloads digits --seeds 1 --world-sizes 1
    .venv/bin/python benchmarks/time_to_target.py --workloads digits --batch-size 1344  # full batch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from dkfac.bench.configs import git_commit
from dkfac.bench.target_report import format_table, grid_score, summarize
from dkfac.bench.target_run import Method, kfac_method, resolved_keywords, run_method
from dkfac.bench.workloads import WORKLOADS, load_workload

SGD_GRID = (0.03, 0.1, 0.3)
ADAMW_GRID = (1e-3, 3e-3, 1e-2)
#: dkfac's one configuration for every workload: SGD-momentum at this rate, the library's
#: KFACPreconditioner defaults otherwise.
KFAC_DEFAULT = {"optimizer": "sgd", "lr": 0.1, "options": {}}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated P (default 1,2)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the final runs (5)")
    parser.add_argument("--grid-seeds", type=int, default=1, help="seeds of the grid (1)")
    parser.add_argument("--sgd-grid", default=",".join(map(str, SGD_GRID)))
    parser.add_argument("--adamw-grid", default=",".join(map(str, ADAMW_GRID)))
    parser.add_argument(
        "--kfac",
        action="append",
        help='a dkfac configuration, repeatable: {"optimizer", "lr", "options": '
        'KFACPreconditioner keywords, "name"} (default: SGD lr 0.1, the library\'s defaults)',
    )
    parser.add_argument("--strategy", default="dkfac", help="K-FAC strategy at P > 1")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch of every workload run, for every method (default: each workload's)",
    )
    parser.add_argument(
        "--malloc-keep",
        action="store_true",
        help="run every worker with glibc keeping freed memory (MALLOC_MMAP_THRESHOLD_, "
        "MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_): large activations are then not page-faulted "
        "in again every step; the same for every method",
    )
    parser.add_argument("--out", default="runs/time_to_target", help="output folder")
    return parser.parse_args()


#: glibc's allocator told to reuse freed memory instead of returning it to the system
#: (``--malloc-keep``); read by each worker process at its start.
MALLOC_KEEP = {
    "MALLOC_MMAP_THRESHOLD_": "2000000000",
    "MALLOC_TRIM_THRESHOLD_": "2000000000",
    "MALLOC_TOP_PAD_": "100000000",
}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _run(
    workload: str, method: Method, seed: int, world: int, args: argparse.Namespace
) -> dict[str, Any]:
    trace = run_method(
        workload,
        method,
        seed,
        world_size=world,
        strategy=args.strategy,
        batch_size=args.batch_size,
    )
    reached = "not reached" if trace["reached_s"] is None else f"{trace['reached_s']:.2f} s"
    if trace["diverged"]:
        reached = "diverged"
    elif trace["collapsed"]:
        reached += ", collapsed on the way"
    print(f"  P={world} {method.label:24} seed {seed}: {reached}", flush=True)
    return {"method": method.label, "seed": seed, **trace}


def _tuned(
    workload: str, optimizer: str, grid: list[float], args: argparse.Namespace, world: int
) -> tuple[Method, list[dict[str, Any]]]:
    higher = load_workload(workload).higher_is_better
    runs, scores = [], []
    for lr in grid:
        method = Method(optimizer, lr)
        traces = [_run(workload, method, s, world, args) for s in range(args.grid_seeds)]
        runs += traces
        scores.append(max(grid_score(t, higher) for t in traces))
    best = min(range(len(grid)), key=lambda k: (scores[k], k))
    return Method(optimizer, grid[best]), runs


def _plot(rows: list[dict[str, Any]], path: Path, batch_size: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows}, key=WORKLOADS.index)
    figure, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2))
    axes = [axes] if len(workloads) == 1 else list(axes)
    for ax, name in zip(axes, workloads, strict=True):
        workload = load_workload(name, batch_size)
        for row in (r for r in rows if r["workload"] == name):
            trace = row["traces"][0]  # the first seed's curve
            seconds = [p[0] for p in trace["points"]]
            values = [p[2] for p in trace["points"]]
            style = "-" if row["world_size"] == 1 else "--"
            ax.plot(seconds, values, style, label=f"{row['method']} P={row['world_size']}")
        ax.axhline(workload.target, color="grey", linewidth=0.8)
        ax.set_title(
            f"{name} (batch {workload.batch_size}): target {workload.metric} {workload.target:g}"
        )
        ax.set_xlabel("training seconds")
        ax.set_ylabel(workload.metric)
        ax.legend(fontsize=7)
    figure.suptitle("Time to target (first seed's curve per method)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    args = _parse()
    warnings.filterwarnings("ignore", "strategy='local' in a process group")
    kfacs = [json.loads(text) for text in (args.kfac or [json.dumps(KFAC_DEFAULT)])]
    try:
        kfac_methods = [kfac_method(kfac) for kfac in kfacs]
    except ValueError as error:
        raise SystemExit(str(error)) from None
    labels = [method.label for method in kfac_methods]
    if len(set(labels)) < len(labels):
        raise SystemExit(
            f'--kfac configurations need distinct names (give each a "name"): {labels}'
        )
    if args.malloc_keep:
        os.environ.update(MALLOC_KEEP)  # the spawned workers inherit it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    grids: list[dict[str, Any]] = []
    started = time.time()
    for workload in args.workloads.split(","):
        for world in (int(p) for p in args.world_sizes.split(",")):
            print(f"{workload}, P={world}: grid", flush=True)
            sgd, sgd_grid = _tuned(workload, "sgd", _floats(args.sgd_grid), args, world)
            adamw, adamw_grid = _tuned(workload, "adamw", _floats(args.adamw_grid), args, world)
            grids.append({"workload": workload, "world_size": world, "runs": sgd_grid + adamw_grid})
            print(f"{workload}, P={world}: {args.seeds} seeds each", flush=True)
            methods = (sgd, adamw, *kfac_methods)
            # Seeds after the grid's (a baseline's grid run chose its rate on its seed), and
            # methods interleaved within each seed: a machine that slows down or speeds up
            # during the run (this one's step times move by 30% between runs) then shifts
            # every method alike instead of the methods that happened to run last.
            finals = range(args.grid_seeds, args.grid_seeds + args.seeds)
            traces: dict[str, list[dict[str, Any]]] = {method.label: [] for method in methods}
            for seed in finals:
                for method in methods:
                    traces[method.label].append(_run(workload, method, seed, world, args))
            group = [
                {
                    "workload": workload,
                    "world_size": world,
                    "method": method.label,
                    "kfac": method.kfac,
                    "summary": summarize(traces[method.label]),
                    "traces": traces[method.label],
                }
                for method in methods
            ]
            medians = [r["summary"]["median_s"] for r in group if not r["kfac"]]
            best = min((m for m in medians if m is not None), default=None)
            for row in group:
                mine = row["summary"]["median_s"]
                if row["kfac"] and best is not None and mine is not None:
                    row["versus_best_baseline"] = mine / best - 1
            rows += group
    table = format_table(rows)
    print(table)
    record = {
        "benchmark": "time_to_target",
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "python": sys.version,
        "platform": platform.platform(),
        "seconds": time.time() - started,
        "malloc": MALLOC_KEEP if args.malloc_keep else "the system's defaults",
        "workloads": {
            workload.name: {
                "metric": workload.metric,
                "target": workload.target,
                "budget_s": workload.budget_s,
                "batch_size": workload.batch_size,
            }
            for workload in (load_workload(n, args.batch_size) for n in args.workloads.split(","))
        },
        "kfac": kfacs,
        # Each configuration's keyword arguments as it ran them, resolved at this commit (a
        # recipe's, the adaptive rule's defaults).
        "kfac_resolved": {method.label: resolved_keywords(method) for method in kfac_methods},
        "grids": grids,
        "rows": rows,
        "table": table,
    }
    (out / "time_to_target.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    _plot(rows, out / "time_to_target.png", args.batch_size)
    print(f"JSON: {out / 'time_to_target.json'}\nchart: {out / 'time_to_target.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
