"""Cost of the distributed K-FAC strategies (``dkfac``, ``kaisa``) against DDP + SGD.

The script has two modes.

* **Launcher** (the default, run without a ``torch.distributed`` environment): for every
  world size ``P`` in ``--nprocs`` it starts its own workers with
  ``python -m torch.distributed.run --standalone --nproc_per_node=P <this script> --worker``
  (``OMP_NUM_THREADS=1``, a timeout per launch), collects the JSON report that rank 0 writes,
  prints one combined table and writes the combined JSON to ``--json``.
* **Worker** (``--worker``, started by the launcher through torchrun): gloo process group,
  one intra-op thread, a fixed synthetic batch per rank (3x32x32, ``--batch-size`` per
  worker), SGD (momentum 0.9, lr 0.1) on a DDP-wrapped CIFAR ResNet. Configurations:

  - SGD alone (DDP, no K-FAC);
  - ``strategy="dkfac"``;
  - ``strategy="kaisa"`` with ``grad_worker_fraction`` 1/P (and 1/2 when P > 2 is even);

  the K-FAC ones each at ``(factor_update_steps, inv_update_steps)`` in ``(1, 1)`` and
  ``(10, 100)``, all with ``inverse_method="eigen"``.

Every configuration gets a freshly built model (same seed), its own warm-up and then a timed
window that starts after a ``dist.barrier()``. A window of the periodic ``(10, 100)``
configurations spans ``--iters-long`` iterations (default 100: exactly one decomposition and
ten factor updates, so the rare expensive steps appear in their real proportion); SGD and
``(1, 1)`` use ``--iters``. The configurations run interleaved in rounds (the order rotates
from round to round) so a slow phase of the machine hits all of them; the overhead of a
K-FAC configuration is computed inside a round against that round's SGD window and then
reduced by the median over rounds.

Reported per configuration:

* amortized s/iter = window wall time (max over ranks) / iterations, median over rounds;
* median s/iter = median over the window of the per-iteration time (max over ranks);
* overhead = amortized - amortized SGD of the same round (seconds and %), median over rounds;
* phase breakdown = mean of ``pre.timings()`` per iteration over the window (mean over ranks);
* bytes per step = sum of ``pre.comm_stats()`` bytes per iteration averaged over the window
  (mean over ranks), also split into the factor / inverse / gradient phases;
* factor + decomposition memory = bytes of ``pre.factors()`` plus every ``layer.inverse``
  held on a rank, at the end of the window (max over ranks).

Usage::

    .venv/bin/python benchmarks/strategies.py            # full run (tens of minutes)
    .venv/bin/python benchmarks/strategies.py --quick    # smoke test (ResNet-20, P=2)
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import dkfac
from dkfac.models import resnet20, resnet32

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
LR = 0.1
MOMENTUM = 0.9
INVERSE_METHOD = "eigen"
MB = 1e6
SCRIPT = Path(__file__).resolve()
DEFAULT_JSON = SCRIPT.parent / "results" / "strategies.json"

MODELS: dict[str, Callable[..., nn.Module]] = {"resnet20": resnet20, "resnet32": resnet32}
MODEL_LABELS = {"resnet20": "ResNet-20", "resnet32": "ResNet-32"}

#: Phases of ``pre.timings()`` shown in the table, in the order of a K-FAC step.
PHASES: tuple[str, ...] = (
    "factor_comm",
    "inverse_comm",
    "grad_comm",
    "factor_compute",
    "inverse_compute",
    "precondition",
)
#: ``comm_stats()`` phase prefix -> name of the byte split.
BYTE_SPLIT = {"factor_comm": "factor", "inverse_comm": "inverse", "grad_comm": "grad"}

SCHEDULES: tuple[tuple[int, int], ...] = ((1, 1), (10, 100))

REFERENCE_LINE = (
    "kfac-pytorch 0.4.2 on this machine class (ResNet-20, batch 32, P=2, gloo, 1 "
    "thread/process): SGD 0.242 s/iter, K-FAC (1,1) 1.251 s/iter -> overhead 1.009 s; target: "
    "dkfac overhead at (1,1), P=2 <= 0.505 s"
)
REFERENCE: dict[str, Any] = {
    "library": "kfac-pytorch 0.4.2",
    "setting": "ResNet-20, batch 32, P=2, gloo, 1 thread/process",
    "sgd_s_per_iter": 0.242,
    "kfac_1_1_s_per_iter": 1.251,
    "overhead_s": 1.009,
    "line": REFERENCE_LINE,
}
TARGET: dict[str, Any] = {
    "model": "resnet20",
    "nprocs": 2,
    "config": "dkfac_1_1",
    "max_overhead_s": 0.505,
}


# --------------------------------------------------------------------------------------------
# configurations
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Configuration:
    """One measured setup: DDP + SGD alone, or with a K-FAC preconditioner."""

    key: str
    label: str
    strategy: str | None = None
    grad_worker_fraction: float = 1.0
    fraction_label: str = "1"
    factor_update_steps: int = 1
    inv_update_steps: int = 1

    @property
    def kfac(self) -> bool:
        """Whether this configuration builds a ``dkfac.KFACPreconditioner``."""
        return self.strategy is not None

    @property
    def periodic(self) -> bool:
        """Whether the expensive K-FAC work happens only on some iterations."""
        return self.kfac and (self.factor_update_steps > 1 or self.inv_update_steps > 1)

    @property
    def schedule(self) -> str:
        """``"(f,i)"`` of a K-FAC configuration, ``"-"`` for SGD."""
        if not self.kfac:
            return "-"
        return f"({self.factor_update_steps},{self.inv_update_steps})"

    def to_json(self) -> dict[str, Any]:
        """The configuration as a JSON-ready dict."""
        return {
            "key": self.key,
            "label": self.label,
            "strategy": self.strategy,
            "grad_worker_fraction": self.grad_worker_fraction if self.kfac else None,
            "grad_worker_fraction_label": self.fraction_label if self.kfac else None,
            "factor_update_steps": self.factor_update_steps if self.kfac else None,
            "inv_update_steps": self.inv_update_steps if self.kfac else None,
            "inverse_method": INVERSE_METHOD if self.kfac else None,
        }


SGD = Configuration("sgd", "SGD (DDP)")


def kaisa_fractions(world_size: int) -> list[int]:
    """Denominators ``d`` of the KAISA fractions ``1/d`` measured with ``world_size`` workers.

    Always ``1/P`` (MEM-OPT); also ``1/2`` when ``P > 2`` is even (a hybrid grid).
    """
    denominators = [world_size]
    if world_size > 2 and world_size % 2 == 0:
        denominators.append(2)
    return denominators


def configurations(world_size: int) -> list[Configuration]:
    """SGD, then dkfac and the KAISA fractions, each at every ``(f, i)`` schedule."""
    configs = [SGD]
    for f, i in SCHEDULES:
        configs.append(
            Configuration(f"dkfac_{f}_{i}", "dkfac", "dkfac", 1.0, "1", f, i),
        )
        for d in kaisa_fractions(world_size):
            configs.append(
                Configuration(
                    f"kaisa_1of{d}_{f}_{i}", f"kaisa f=1/{d}", "kaisa", 1.0 / d, f"1/{d}", f, i
                )
            )
    return configs


def count_schedule_hits(period: int, start: int, iters: int) -> int:
    """Number of K-FAC steps ``k`` in ``[start, start + iters)`` with ``k % period == 0``."""
    return sum(1 for k in range(start, start + iters) if k % period == 0)


# --------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------
def make_batch(batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Return one random input batch and random labels drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *IMAGE_SHAPE, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return x, y


def kfac_memory_bytes(pre: dkfac.KFACPreconditioner) -> tuple[int, int]:
    """Bytes of the running factors and of the decompositions this rank holds."""
    factor_bytes = sum(
        t.numel() * t.element_size() for a, g in pre.factors().values() for t in (a, g)
    )
    inverse_bytes = 0
    for layer in pre.layers:
        if layer.inverse is not None:
            inverse_bytes += sum(
                t.numel() * t.element_size() for t in layer.inverse.tensors().values()
            )
    return factor_bytes, inverse_bytes


def time_window(
    config: Configuration,
    model_name: str,
    x: Tensor,
    y: Tensor,
    *,
    warmup: int,
    iters: int,
    seed: int,
    bucket_cap_mb: float,
) -> dict[str, Any]:
    """Build a fresh DDP model for ``config``, warm it up, time ``iters`` iterations.

    Returns this rank's raw numbers; :func:`reduce_window` combines the ranks. The garbage
    collector is paused during the window (for every configuration alike).
    """
    torch.manual_seed(seed)
    net = MODELS[model_name](num_classes=NUM_CLASSES)
    net.train()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pre: dkfac.KFACPreconditioner | None = None
    if config.strategy is not None:
        pre = dkfac.KFACPreconditioner(
            model,
            strategy=config.strategy,
            inverse_method=INVERSE_METHOD,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            grad_worker_fraction=config.grad_worker_fraction,
            bucket_cap_mb=bucket_cap_mb,
        )
    clock = time.perf_counter
    iter_s: list[float] = []
    phase_sums: dict[str, float] = collections.defaultdict(float)
    byte_sums: dict[str, int] = collections.defaultdict(int)
    call_sums: dict[str, int] = collections.defaultdict(int)
    try:
        loss = torch.zeros(())
        for _ in range(warmup):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if pre is not None:
                pre.step()
            optimizer.step()
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            dist.barrier()
            window_start = clock()
            for _ in range(iters):
                t0 = clock()
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                if pre is not None:
                    pre.step()
                optimizer.step()
                iter_s.append(clock() - t0)
                if pre is not None:
                    for phase, seconds in pre.timings().items():
                        phase_sums[phase] += seconds
                    for key, count in pre.comm_stats().items():
                        byte_sums[key] += count["bytes"]
                        call_sums[key] += count["calls"]
            wall_s = clock() - window_start
        finally:
            if gc_was_enabled:
                gc.enable()
        final_loss = float(loss.detach())
        factor_bytes = inverse_bytes = 0
        if pre is not None:
            if pre.steps != warmup + iters:
                raise RuntimeError(
                    f"{config.key}: pre.steps={pre.steps}, expected {warmup + iters}"
                )
            factor_bytes, inverse_bytes = kfac_memory_bytes(pre)
    finally:
        if pre is not None:
            pre.remove()
    return {
        "wall_s": wall_s,
        "iter_s": iter_s,
        "phase_s": {name: value / iters for name, value in phase_sums.items()},
        "bytes_per_step": {key: value / iters for key, value in byte_sums.items()},
        "calls_per_step": {key: value / iters for key, value in call_sums.items()},
        "factor_bytes": factor_bytes,
        "inverse_bytes": inverse_bytes,
        "final_loss": final_loss,
    }


def split_bytes(bytes_per_step: dict[str, float]) -> dict[str, float]:
    """Total bytes per step and its factor / inverse / grad (/ other) parts."""
    parts = {"total": 0.0, "factor": 0.0, "inverse": 0.0, "grad": 0.0, "other": 0.0}
    for key, value in bytes_per_step.items():
        parts["total"] += value
        parts[BYTE_SPLIT.get(key.split("/", 1)[0], "other")] += value
    return parts


def reduce_window(
    config: Configuration, ranks: Sequence[dict[str, Any]], *, warmup: int, iters: int
) -> dict[str, Any]:
    """Combine the raw windows of all ranks into one JSON-ready window."""
    wall_s = max(r["wall_s"] for r in ranks)
    iter_s = [max(values) for values in zip(*(r["iter_s"] for r in ranks), strict=True)]
    phase_names = list(PHASES) + sorted(
        {name for r in ranks for name in r["phase_s"]} - set(PHASES)
    )
    phase_s_per_rank = [{name: r["phase_s"].get(name, 0.0) for name in phase_names} for r in ranks]
    bytes_split_per_rank = [split_bytes(r["bytes_per_step"]) for r in ranks]
    memory_per_rank = [r["factor_bytes"] + r["inverse_bytes"] for r in ranks]
    window: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "wall_s": wall_s,
        "amortized_s": wall_s / iters,
        "median_s": statistics.median(iter_s),
        "iter_s": iter_s,
        "iter_s_rank0": ranks[0]["iter_s"],
        "final_loss": ranks[0]["final_loss"],
        "factor_updates_in_window": None,
        "inverse_updates_in_window": None,
    }
    if config.kfac:
        window |= {
            "factor_updates_in_window": count_schedule_hits(
                config.factor_update_steps, warmup, iters
            ),
            "inverse_updates_in_window": count_schedule_hits(
                config.inv_update_steps, warmup, iters
            ),
            "whole_inverse_periods": iters % config.inv_update_steps == 0,
            "phase_s": {
                name: statistics.fmean(p[name] for p in phase_s_per_rank) for name in phase_names
            },
            "phase_s_per_rank": phase_s_per_rank,
            "bytes_per_step": {
                part: statistics.fmean(b[part] for b in bytes_split_per_rank)
                for part in bytes_split_per_rank[0]
            },
            "bytes_per_step_per_rank": bytes_split_per_rank,
            "comm_per_step_per_rank": [
                {
                    key: {"bytes": r["bytes_per_step"][key], "calls": r["calls_per_step"][key]}
                    for key in sorted(r["bytes_per_step"])
                }
                for r in ranks
            ],
            "kfac_memory_bytes": max(memory_per_rank),
            "kfac_memory_bytes_per_rank": memory_per_rank,
            "factor_bytes_per_rank": [r["factor_bytes"] for r in ranks],
            "inverse_bytes_per_rank": [r["inverse_bytes"] for r in ranks],
        }
    return window


def summarize(
    models: Sequence[str], configs: Sequence[Configuration], rounds: Sequence[dict[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Reduce the rounds per model and configuration (medians over rounds).

    The overhead of a K-FAC configuration is computed inside each round against that round's
    SGD window (amortized times), then reduced by the median over rounds.
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
            if config.kfac:
                pairs = list(zip(windows, sgd, strict=True))
                over_s = [w["amortized_s"] - s["amortized_s"] for w, s in pairs]
                over_pct = [100.0 * (w["amortized_s"] / s["amortized_s"] - 1.0) for w, s in pairs]
                entry |= {
                    "overhead_s": statistics.median(over_s),
                    "overhead_pct": statistics.median(over_pct),
                    "overhead_s_per_round": over_s,
                    "overhead_pct_per_round": over_pct,
                    "whole_inverse_periods": all(w["whole_inverse_periods"] for w in windows),
                    "factor_updates_in_window": windows[0]["factor_updates_in_window"],
                    "inverse_updates_in_window": windows[0]["inverse_updates_in_window"],
                    "phase_s": {
                        name: statistics.median(w["phase_s"][name] for w in windows)
                        for name in windows[0]["phase_s"]
                    },
                    "bytes_per_step": {
                        part: statistics.median(w["bytes_per_step"][part] for w in windows)
                        for part in windows[0]["bytes_per_step"]
                    },
                    "kfac_memory_bytes": max(w["kfac_memory_bytes"] for w in windows),
                }
            entries[config.key] = entry
        summary[model] = entries
    return summary


def worker(args: argparse.Namespace) -> int:
    """Run every round on this rank; rank 0 writes the report to ``args.out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        x, y = make_batch(args.batch_size, args.seed + 1000 * (rank + 1))
        configs = configurations(world_size)
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            shift = index % len(configs)
            order = configs[shift:] + configs[:shift]
            windows: dict[str, dict[str, Any]] = {}
            for model in args.models:
                model_windows: dict[str, Any] = {}
                for config in order:
                    iters = args.iters_long if config.periodic else args.iters
                    raw = time_window(
                        config,
                        model,
                        x,
                        y,
                        warmup=args.warmup,
                        iters=iters,
                        seed=args.seed,
                        bucket_cap_mb=args.bucket_cap_mb,
                    )
                    gathered: list[Any] = [None] * world_size
                    dist.all_gather_object(gathered, raw)
                    window = reduce_window(config, gathered, warmup=args.warmup, iters=iters)
                    model_windows[config.key] = window
                    if rank == 0:
                        print(
                            f"[P={world_size}] round {index + 1}/{args.rounds} {model} "
                            f"{config.label:<14} {config.schedule:<8} amortized "
                            f"{window['amortized_s']:.4f} s/iter, median "
                            f"{window['median_s']:.4f} s/iter",
                            file=sys.stderr,
                            flush=True,
                        )
                        if not math.isfinite(window["final_loss"]):
                            print(f"warning: {config.key}: non-finite loss", file=sys.stderr)
                windows[model] = {c.key: model_windows[c.key] for c in configs}
            rounds.append({"round": index, "order": [c.key for c in order], "windows": windows})
        if rank == 0:
            report = {
                "world_size": world_size,
                "backend": dist.get_backend(),
                "environment": environment(),
                "configurations": [c.to_json() for c in configs],
                "rounds": rounds,
                "summary": summarize(args.models, configs, rounds),
            }
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Describe the software and machine the numbers were measured on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "torch_version": torch.__version__,
        "dkfac_version": dkfac.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(affinity(0)) if affinity is not None else None,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Launch:
    """Outcome of one torchrun launch."""

    nprocs: int
    command: list[str]
    returncode: int | None
    timed_out: bool
    wall_s: float
    output_tail: list[str]
    report: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        """Whether the launch exited cleanly and produced a report."""
        return self.returncode == 0 and not self.timed_out and self.report is not None

    def to_json(self) -> dict[str, Any]:
        """The launch as a JSON-ready dict (the output tail only when it failed)."""
        return {
            "nprocs": self.nprocs,
            "command": self.command,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "wall_s": self.wall_s,
            "ok": self.ok,
            "output_tail": None if self.ok else self.output_tail,
            "report": self.report,
        }


def worker_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """The arguments a worker needs (every default already resolved by the launcher)."""
    return [
        "--worker",
        "--out",
        str(out),
        "--models",
        ",".join(args.models),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--iters-long",
        str(args.iters_long),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--bucket-cap-mb",
        str(args.bucket_cap_mb),
    ]


def _stop(process: subprocess.Popen[str]) -> None:
    """Terminate the launch's process group (torchrun and its workers), then kill it."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(nprocs: int, args: argparse.Namespace, folder: Path) -> Launch:
    """Run the workers for ``nprocs`` processes through torchrun; collect rank 0's report."""
    out = folder / f"strategies_p{nprocs}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nprocs}",
        str(SCRIPT),
        *worker_argv(args, out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"launching P={nprocs}: {' '.join(command)}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        returncode: int | None = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"P={nprocs}: timed out after {args.timeout} s, stopping", file=sys.stderr)
        _stop(process)
        returncode = process.poll()
    except BaseException:
        _stop(process)
        raise
    reader.join(timeout=10.0)
    wall_s = time.perf_counter() - start
    report = None
    if out.exists() and not timed_out:
        try:
            report = json.loads(out.read_text())
        except json.JSONDecodeError as error:
            tail.append(f"could not read {out}: {error}")
    if returncode != 0 or report is None:
        print(f"P={nprocs}: launch failed (returncode {returncode})", file=sys.stderr)
    return Launch(nprocs, command, returncode, timed_out, wall_s, list(tail), report)


def summary_rows(launches: Sequence[Launch], models: Sequence[str]) -> list[dict[str, Any]]:
    """One flat row per (model, P, configuration), ordered by model, then P."""
    rows = []
    for model in models:
        for item in launches:
            if item.report is None:
                continue
            for key, entry in item.report["summary"].get(model, {}).items():
                rows.append({"model": model, "nprocs": item.nprocs, "key": key, **entry})
    return rows


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render the summary rows as a fixed-width table."""
    columns: list[tuple[str, int]] = [
        ("model", 8),
        ("P", 2),
        ("config", 11),
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
        kfac = row["strategy"] is not None
        schedule = f"({row['factor_update_steps']},{row['inv_update_steps']})" if kfac else "-"
        cells = [
            row["model"],
            str(row["nprocs"]),
            row["label"],
            schedule,
            f"{row['amortized_s']:.4f}",
            f"{row['median_s']:.4f}",
        ]
        if kfac:
            cells += [f"{row['overhead_s']:+.4f}", f"{row['overhead_pct']:+.1f}%"]
            cells += [_ms(row["phase_s"][name]) for name in PHASES]
            cells += [
                f"{row['bytes_per_step']['total'] / MB:.2f}",
                f"{row['kfac_memory_bytes'] / MB:.2f}",
            ]
        else:
            cells += ["-"] * (len(columns) - len(cells))
        lines.append(line(cells))
    lines += [
        "amort = window wall time (max over ranks) / iterations, median over rounds; median = "
        "median per-iteration time (max over ranks);",
        "overhead = amort - amort SGD of the same round (median over rounds); f_comm .. precond "
        "= mean ms per iteration of pre.timings() (mean over ranks);",
        "MB/step = comm_stats() payload bytes per iteration / 1e6 (mean over ranks); mem MB = "
        "factors + decompositions held per worker / 1e6 (max over ranks).",
    ]
    return "\n".join(lines)


def evaluate_target(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Whether the dkfac ResNet-20 P=2 (1,1) overhead meets the target."""
    verdict: dict[str, Any] = {**TARGET, "measured_overhead_s": None, "met": None}
    found = {
        row["key"]: row
        for row in rows
        if row["model"] == TARGET["model"] and row["nprocs"] == TARGET["nprocs"]
    }
    row = found.get(TARGET["config"])
    if row is not None:
        measured = row["overhead_s"]
        verdict |= {
            "measured_overhead_s": measured,
            "measured_overhead_s_per_round": row["overhead_s_per_round"],
            "measured_kfac_s_per_iter": row["amortized_s"],
            "measured_sgd_s_per_iter": found[SGD.key]["amortized_s"],
            "met": bool(measured <= TARGET["max_overhead_s"]),
        }
    return verdict


def format_target(verdict: dict[str, Any], *, like_for_like: bool, quick: bool) -> str:
    """Render the reference line and whether the target is met."""
    lines = [REFERENCE_LINE]
    measured = verdict["measured_overhead_s"]
    if measured is None:
        lines.append("measured: dkfac ResNet-20 P=2 (1,1) was not run -> target not evaluated")
        return "\n".join(lines)
    status = "MET" if verdict["met"] else "NOT MET"
    per_round = ", ".join(f"{v:.3f}" for v in verdict["measured_overhead_s_per_round"])
    lines.append(
        f"measured: dkfac ResNet-20 P=2 (1,1) {verdict['measured_kfac_s_per_iter']:.3f} s/iter, "
        f"SGD {verdict['measured_sgd_s_per_iter']:.3f} s/iter -> overhead {measured:.3f} s "
        f"(rounds: {per_round}) <= {TARGET['max_overhead_s']} s: {status}"
    )
    if not like_for_like:
        lines.append("note: batch size differs from the reference setting")
    if quick:
        lines.append("note: --quick run, too few iterations for a meaningful comparison")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------
def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line and fill in the defaults (which depend on ``--quick``)."""
    parser = argparse.ArgumentParser(
        description="Time DDP + SGD vs dkfac/kaisa K-FAC strategies on CIFAR ResNets (gloo, CPU)."
    )
    parser.add_argument(
        "--nprocs", default=None, help="world sizes to launch, comma-separated (default 2,4)"
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"models, comma-separated, from {', '.join(MODELS)} (default resnet20,resnet32)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2, quick 1)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed iterations per configuration and round (default 3, quick 2)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed iterations of SGD and the (1,1) configurations (default 10, quick 3)",
    )
    parser.add_argument(
        "--iters-long",
        type=int,
        default=None,
        help="timed iterations of the (10,100) configurations; a multiple of 100 covers whole "
        "inverse periods (default 100, quick 10)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="batch size per worker (default 32)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="K-FAC fusion bucket (default 25)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed per torchrun launch (default 3600, quick 300)",
    )
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: resnet20, P=2, 1 round, 2 warm-up, iters 3, iters-long 10",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults: dict[str, Any] = (
        {
            "nprocs": "2",
            "models": "resnet20",
            "rounds": 1,
            "warmup": 2,
            "iters": 3,
            "iters_long": 10,
            "timeout": 300.0,
        }
        if args.quick
        else {
            "nprocs": "2,4",
            "models": "resnet20,resnet32",
            "rounds": 2,
            "warmup": 3,
            "iters": 10,
            "iters_long": 100,
            "timeout": 3600.0,
        }
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.models = _csv(args.models)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    try:
        args.nprocs = [int(p) for p in _csv(args.nprocs)]
    except ValueError:
        parser.error(f"--nprocs must be comma-separated integers, got {args.nprocs!r}")
    if not args.nprocs or min(args.nprocs) < 1:
        parser.error("--nprocs needs at least one world size >= 1")
    for name, minimum in (
        ("batch_size", 1),
        ("rounds", 1),
        ("warmup", 0),
        ("iters", 1),
        ("iters_long", 1),
    ):
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.worker and args.out is None:
        parser.error("--worker needs --out")
    return args


def main(argv: list[str] | None = None) -> int:
    """Launch every world size, print the table, write the JSON; return the exit code."""
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        print(
            "error: started inside a torch.distributed launch without --worker; run this "
            "script directly, it launches its own workers",
            file=sys.stderr,
        )
        return 2
    launches: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="dkfac_strategies_") as folder:
        for nprocs in args.nprocs:
            launches.append(launch(nprocs, args, Path(folder)))
    rows = summary_rows(launches, args.models)
    verdict = evaluate_target(rows)
    env = environment()
    settings = {
        "nprocs": args.nprocs,
        "models": args.models,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "iters_long": args.iters_long,
        "batch_size_per_worker": args.batch_size,
        "seed": args.seed,
        "bucket_cap_mb": args.bucket_cap_mb,
        "timeout_s": args.timeout,
        "quick": args.quick,
        "backend": "gloo",
        "threads_per_process": 1,
        "inverse_method": INVERSE_METHOD,
        "lr": LR,
        "momentum": MOMENTUM,
        "input_shape": list(IMAGE_SHAPE),
        "num_classes": NUM_CLASSES,
        "schedules": [list(s) for s in SCHEDULES],
        "gc_disabled_in_window": True,
        "mb": MB,
    }
    report = {
        "benchmark": "strategies",
        "environment": env,
        "settings": settings,
        "launches": [item.to_json() for item in launches],
        "summary": rows,
        "reference": REFERENCE,
        "target": verdict,
    }
    print(
        f"torch {env['torch_version']}, dkfac {env['dkfac_version']}, cpus {env['cpu_count']}, "
        f"python {env['python_version']}, {env['platform']}, {env['date_utc']}"
    )
    print(
        f"{', '.join(MODEL_LABELS[m] for m in args.models)}; P in "
        f"{', '.join(map(str, args.nprocs))}; gloo, 1 thread/process; batch {args.batch_size} "
        f"per worker; SGD(lr={LR}, momentum={MOMENTUM}) + DDP; K-FAC {INVERSE_METHOD}; rounds "
        f"{args.rounds}, warm-up {args.warmup}, timed iterations {args.iters} (SGD, (1,1)) / "
        f"{args.iters_long} ((10,100))"
    )
    print()
    print(format_table(rows))
    print()
    print(format_target(verdict, like_for_like=args.batch_size == 32, quick=args.quick))
    failed = [item for item in launches if not item.ok]
    for item in failed:
        reason = "timed out" if item.timed_out else f"returncode {item.returncode}"
        print(f"\nlaunch P={item.nprocs} FAILED ({reason}); last output lines:")
        print("\n".join(item.output_tail[-40:]))
    path: Path = args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
