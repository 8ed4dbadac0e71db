"""DDP against DeAR (fixed and auto bucket sizes): iteration time, where it goes, and overlap.

Launches its own workers for each world size with torchrun (gloo, one intra-op thread per
process, synthetic data fixed per rank), on ResNet-32 (3x32x32) and MLP-6 (six 1024-wide
``nn.Linear``: 25 MB of gradients for little compute, the communication-bound case). Per
model, configurations run interleaved in rounds, each with a freshly built model and optimizer
(SGD, momentum 0.9, lr 0.1): DDP (``bucket_cap_mb`` 25), DeAR with a fixed bucket size, and
DeAR ``"auto"`` (its size search runs inside the warm-up and is reported). Per iteration:
wall time (max over ranks) and the host time of forward, backward and the optimizer step; for
DeAR also its exposed waits (reduce-scatter in ``step()``, all-gather in forward pre-hooks).
Rank 0 of the last round writes a Chrome trace of DeAR per model and world size.

Usage::

    .venv/bin/python benchmarks/dear.py                  # ResNet-32 and MLP-6, P = 2 and 4
    .venv/bin/python benchmarks/dear.py --quick          # smoke run (MLP-6, P = 2, few iters)

Prints a table and the target verdict (DeAR at least 10% faster than DDP at P = 4 on MLP-6)
and writes JSON (default ``benchmarks/results/dear.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dkfac
from dkfac.bench.configs import LR, MODEL_LABELS, MODELS, MOMENTUM, environment
from dkfac.bench.models import batch_loss, model_batch
from dkfac.comm import destroy_process_groups

#: Where results go by default: under the working folder, outside the source tree.
RESULTS = Path("runs")
#: Bucket sizes (MiB): DDP's default, and DeAR's fixed size for the comparison.
DDP_BUCKET_MB = 25.0
DEAR_FIXED_MB = 25.0
#: Steps ``auto`` may spend searching (range 1-64 MiB, 5 timed iterations per size).
AUTO_RANGE_MB = (1.0, 64.0)
AUTO_TRIALS = 5


def configurations() -> list[dict[str, Any]]:
    """The measured configurations, in the order of the first round."""
    return [
        {"name": "DDP", "sync": "ddp", "bucket": DDP_BUCKET_MB},
        {"name": f"DeAR {DEAR_FIXED_MB:g} MB", "sync": "dear", "bucket": DEAR_FIXED_MB},
        {"name": "DeAR auto", "sync": "dear", "bucket": "auto"},
    ]


# -- worker ------------------------------------------------------------------------------------
def time_window(
    config: dict[str, Any], model_name: str, batch: int, warmup: int, iters: int, trace: str
) -> dict[str, Any]:
    """Warm up and time ``iters`` iterations of ``config`` on this rank; all ranks' numbers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = model_batch(model_name, batch, 1000 + rank)
    torch.manual_seed(0)
    net: nn.Module = MODELS[model_name]()
    net.train()
    dear: dkfac.DeAR | None = None
    if config["sync"] == "ddp":
        model: nn.Module = DistributedDataParallel(net, bucket_cap_mb=config["bucket"])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        step = optimizer.step
    else:
        model = net
        dear = dkfac.DeAR(
            net,
            lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
            bucket_cap_mb=config["bucket"],
            auto_range_mb=AUTO_RANGE_MB,
            auto_trial_steps=AUTO_TRIALS,
        )
        step = dear.step

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": []}
    waits: dict[str, list[float]] = {"grad_reduce_scatter": [], "grad_all_gather": []}

    def iteration(record: bool) -> None:
        t0 = time.perf_counter()
        if dear is None:
            optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(model(x), y)
        t1 = time.perf_counter()
        torch.autograd.backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        if record:
            spans = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}
            for name, seconds in spans.items():
                phases[name].append(seconds)
            if dear is not None:
                timings = dear.timings()
                for name in waits:
                    waits[name].append(timings[name])

    for _ in range(warmup):
        iteration(record=False)
    while dear is not None and dear.searching:  # "auto": the size search ends on every rank
        iteration(record=False)  # at the same step (its decision is agreed over ranks)
    dist.barrier()
    for _ in range(iters):
        iteration(record=True)
    if dear is not None:
        dear.finish()
        if trace:
            dear.export_trace(trace)
    local = torch.tensor([statistics.median(phases["total"]), sum(phases["total"])])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    result = {
        "config": config["name"],
        "model": model_name,
        "nprocs": world,
        "median_s": float(local[0]),
        "mean_s": float(local[1]) / iters,
        "phases_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items()},
        "waits_ms": {k: 1e3 * statistics.median(v) for k, v in waits.items() if v},
        "bucket_mb": dear.bucket_cap_mb if dear is not None else config["bucket"],
        "tuning": dear.tuning if dear is not None else [],
    }
    if dear is not None:
        dear.remove()
    return result


def worker(args: argparse.Namespace) -> None:
    """One rank: every model, every round, every configuration (rotating order)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    configs = configurations()
    for model_name in args.models.split(","):
        for round_index in range(args.rounds):
            shift = round_index % len(configs)
            for config in configs[shift:] + configs[:shift]:
                last = round_index == args.rounds - 1 and config["sync"] == "dear"
                trace = ""
                if last and rank == 0 and args.trace_dir:
                    label = config["name"].replace(" ", "_")
                    trace = str(
                        Path(args.trace_dir) / f"dear_trace_{model_name}_P{world}_{label}.json"
                    )
                result = time_window(
                    config, model_name, args.batch_size, args.warmup, args.iters, trace
                )
                result["round"] = round_index
                rows.append(result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    destroy_process_groups()


# -- launcher and report -----------------------------------------------------------------------
def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over rounds per (model, P, configuration), with the speed-up over DDP."""
    keys = sorted({(r["model"], r["nprocs"]) for r in rows})
    summary = []
    for model, nprocs in keys:
        same = [r for r in rows if r["model"] == model and r["nprocs"] == nprocs]
        ddp = {r["round"]: r["median_s"] for r in same if r["config"] == "DDP"}
        for config in [c["name"] for c in configurations()]:
            mine = [r for r in same if r["config"] == config]
            if not mine:
                continue
            speedups = [ddp[r["round"]] / r["median_s"] for r in mine if r["round"] in ddp]
            summary.append(
                {
                    "model": model,
                    "nprocs": nprocs,
                    "config": config,
                    "median_s": statistics.median(r["median_s"] for r in mine),
                    "rounds_s": [r["median_s"] for r in mine],
                    "speedup_vs_ddp": statistics.median(speedups) if speedups else None,
                    "phases_ms": {
                        k: statistics.median(r["phases_ms"][k] for r in mine)
                        for k in mine[0]["phases_ms"]
                    },
                    "waits_ms": {
                        k: statistics.median(r["waits_ms"][k] for r in mine)
                        for k in mine[0]["waits_ms"]
                    },
                    "bucket_mb": [r["bucket_mb"] for r in mine],
                    "tuning": mine[-1]["tuning"],
                }
            )
    return summary


def format_table(summary: list[dict[str, Any]]) -> str:
    """The table printed at the end (and recorded in docs/benchmarks.md)."""
    header = (
        f"{'model':<9}{'P':>2} {'config':<13}{'median s/it':>12}{'vs DDP':>8}{'fwd ms':>8}"
        f"{'bwd ms':>8}{'step ms':>8}{'RS wait':>8}{'AG wait':>8}  bucket MB"
    )
    lines = [header, "-" * len(header)]
    for row in summary:
        waits = row["waits_ms"]
        speedup = row["speedup_vs_ddp"]
        lines.append(
            f"{row['model']:<9}{row['nprocs']:>2} {row['config']:<13}{row['median_s']:>12.4f}"
            f"{(f'{speedup:.2f}x' if speedup else '-'):>8}"
            f"{row['phases_ms']['forward']:>8.1f}{row['phases_ms']['backward']:>8.1f}"
            f"{row['phases_ms']['step']:>8.1f}"
            f"{waits.get('grad_reduce_scatter', float('nan')):>8.1f}"
            f"{waits.get('grad_all_gather', float('nan')):>8.1f}"
            f"  {','.join(f'{b:g}' if isinstance(b, float) else str(b) for b in row['bucket_mb'])}"
        )
    lines.append(
        "median s/it: median per-iteration wall time (max over ranks), median over rounds; "
        "vs DDP: DDP time / this time in the same round (median); fwd/bwd/step: host ms "
        "(DeAR's forward includes waiting for all-gathers and applying updates, its step the "
        "reduce-scatter waits); RS/AG wait: DeAR's exposed waits (ms, median)."
    )
    return "\n".join(lines)


def verdicts(summary: list[dict[str, Any]]) -> list[str]:
    """The issue's target: DeAR at least 10% faster than DDP at P = 4 on MLP-6."""
    out = []
    for row in summary:
        if row["model"] == "mlp6" and row["nprocs"] == 4 and row["config"] != "DDP":
            speedup = row["speedup_vs_ddp"] or 0.0
            verdict = "MET" if speedup >= 1.10 else "NOT MET"
            out.append(
                f"target {row['config']} vs DDP, {MODEL_LABELS['mlp6']}, P=4 (>= 1.10x): "
                f"{speedup:.2f}x: {verdict}"
            )
    return out


def launch(args: argparse.Namespace) -> int:
    """Run the workers for every world size, print the table and verdicts, write the JSON."""
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    trace_dir = Path(args.json).parent
    trace_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for nprocs in [int(p) for p in args.nprocs.split(",")]:
            out = Path(folder) / f"rows{nprocs}.json"
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nprocs}", __file__, "--worker", "--out", str(out),
                "--models", args.models, "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--iters", str(args.iters),
                "--batch-size", str(args.batch_size), "--trace-dir", str(trace_dir),
            ]  # fmt: skip
            started = time.perf_counter()
            done = subprocess.run(command, env=env, check=False, timeout=args.timeout)
            if done.returncode != 0:
                print(f"error: the P={nprocs} run failed (exit {done.returncode})", file=sys.stderr)
                return 1
            rows += json.loads(out.read_text())
            print(f"P={nprocs}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    summary = summarise(rows)
    print(format_table(summary))
    for line in verdicts(summary):
        print(line)
    report = {"environment": environment(), "args": vars(args), "summary": summary, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the options; run as the launcher or (under torchrun) as one worker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet32,mlp6")
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", default=str(RESULTS / "dear.json"))
    parser.add_argument("--quick", action="store_true", help="MLP-6, P=2, 1 round, few iters")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.models, args.nprocs, args.rounds, args.warmup, args.iters = "mlp6", "2", 1, 2, 3
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; expected from {sorted(MODELS)}")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
