"""``dkfac bench``: the cost of the K-FAC strategies against DDP + SGD.

The strategies are ``dkfac``, ``kaisa``, ``spd`` (SPD-KFAC) and ``pad`` (PAD-KFAC); the models
the CIFAR ResNets ``resnet20`` and ``resnet32`` and ``mlp6``, a 6-layer MLP with 1024-wide
layers (the communication-bound case).

For every world size ``P`` in ``--nprocs`` this process starts its own workers with
``python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker``
(``OMP_NUM_THREADS=1``, a timeout per launch), collects the JSON report that rank 0 writes and
combines the launches into one report. What a worker measures is described in
:mod:`dkfac.bench.worker`; the table, the reference line, the two targets (dkfac's
overhead; spd and pad against dkfac) and the chart are in :mod:`dkfac.bench.report`.
``benchmarks/strategies.py`` is a thin front end of this module.

``--layers resnet50`` launches nothing: it is a dry run that computes each strategy's bytes
per worker, decomposition work and memory of one second-order update from the model's layer
shapes (:mod:`dkfac.bench.dry_run`), at ``P = 64`` unless ``--nprocs`` says otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dkfac
from dkfac.bench.configs import (
    INPUT_SHAPES,
    INVERSE_METHOD,
    LR,
    MODELS,
    MOMENTUM,
    NUM_CLASSES,
    SCHEDULES,
    STRATEGIES,
    environment,
)
from dkfac.bench.dry_run import (
    DRY_RUN_NPROCS,
    NOMINAL_COST_MODEL,
    dry_run_models,
    dry_run_report,
)
from dkfac.bench.report import MB, summary_rows
from dkfac.bench.targets import REFERENCE, evaluate_pipelined_target, evaluate_target
from dkfac.cli.config import ConfigError
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel, CubicCost

WORKER_MODULE = "dkfac.bench.worker"

#: Defaults of a full run and of ``--quick`` (models and world sizes come from the front end).
FULL_DEFAULTS: dict[str, Any] = {
    "rounds": 2,
    "warmup": 3,
    "iters": 10,
    "iters_long": 100,
    "timeout": 3600.0,
}
QUICK_DEFAULTS: dict[str, Any] = {
    "nprocs": "2",
    "models": "resnet20",
    "rounds": 1,
    "warmup": 2,
    "iters": 3,
    "iters_long": 10,
    "timeout": 300.0,
}


@dataclass(frozen=True)
class BenchOptions:
    """A validated benchmark request."""

    models: tuple[str, ...]
    nprocs: tuple[int, ...]
    rounds: int
    warmup: int
    iters: int
    iters_long: int
    timeout: float
    strategies: tuple[str, ...] = STRATEGIES
    schedules: tuple[tuple[int, int], ...] = SCHEDULES
    batch_size: int = 32
    seed: int = 0
    bucket_cap_mb: float = 25.0
    quick: bool = False
    layers: str | None = None
    cost_model: ClusterCostModel = NOMINAL_COST_MODEL

    def worker_argv(self, out: Path) -> list[str]:
        """The options of :mod:`dkfac.bench.worker`, rank 0 writing to ``out``."""
        return [
            "--out",
            str(out),
            "--models",
            ",".join(self.models),
            "--strategies",
            ",".join(self.strategies),
            "--schedules",
            ",".join(f"{f}:{i}" for f, i in self.schedules),
            "--rounds",
            str(self.rounds),
            "--warmup",
            str(self.warmup),
            "--iters",
            str(self.iters),
            "--iters-long",
            str(self.iters_long),
            "--batch-size",
            str(self.batch_size),
            "--seed",
            str(self.seed),
            "--bucket-cap-mb",
            str(self.bucket_cap_mb),
        ]

    def settings(self) -> dict[str, Any]:
        """The ``settings`` block of the report."""
        return {
            "nprocs": list(self.nprocs),
            "models": list(self.models),
            "strategies": list(self.strategies),
            "rounds": self.rounds,
            "warmup": self.warmup,
            "iters": self.iters,
            "iters_long": self.iters_long,
            "batch_size_per_worker": self.batch_size,
            "seed": self.seed,
            "bucket_cap_mb": self.bucket_cap_mb,
            "timeout_s": self.timeout,
            "quick": self.quick,
            "backend": "gloo",
            "threads_per_process": 1,
            "inverse_method": INVERSE_METHOD,
            "lr": LR,
            "momentum": MOMENTUM,
            "input_shapes": {model: list(INPUT_SHAPES[model]) for model in self.models},
            "num_classes": NUM_CLASSES,
            "schedules": [list(s) for s in self.schedules],
            "gc_disabled_in_window": True,
            "mb": MB,
        }


def add_bench_options(parser: argparse.ArgumentParser, *, models: str, nprocs: str) -> None:
    """The benchmark's options; ``models`` and ``nprocs`` are the defaults of a full run."""
    parser.add_argument(
        "--models",
        default=None,
        help=f"models, comma-separated, from {', '.join(MODELS)} (default {models})",
    )
    parser.add_argument(
        "--nprocs", default=None, help=f"world sizes to launch, comma-separated (default {nprocs})"
    )
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="K-FAC strategies besides the SGD reference, comma-separated, from "
        f"{', '.join(STRATEGIES)} (spd = SPD-KFAC, pad = PAD-KFAC); kaisa runs with fraction "
        f"1/P (and 1/2 when P > 2 is even) (default {','.join(STRATEGIES)})",
    )
    default_schedules = ",".join(f"{f}:{i}" for f, i in SCHEDULES)
    parser.add_argument(
        "--schedules",
        default=default_schedules,
        help="K-FAC factor_update_steps:inv_update_steps pairs, comma-separated "
        f"(default {default_schedules})",
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
        help="timed iterations of the periodic configurations such as (10,100); a multiple of "
        "100 covers whole inverse periods (default 100, quick 10)",
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
        "--quick",
        action="store_true",
        help="smoke test: resnet20, P=2, 1 round, 2 warm-up, iters 3, iters-long 10 (every "
        "strategy of --strategies)",
    )
    dry = parser.add_argument_group(
        "dry run",
        "--layers computes, without training or a process group, each strategy's bytes per "
        "worker, decomposition work and factor + decomposition memory of one second-order "
        "update from the model's layer shapes, with the strategies' own planners (P from "
        f"--nprocs, default {DRY_RUN_NPROCS}); the cost model below only places spd/pad's "
        "factors and is nominal, not measured",
    )
    dry.add_argument(
        "--layers",
        choices=sorted(dry_run_models()),
        default=None,
        help="dry run on this model's layer shapes instead of timing (resnet50: ImageNet "
        "ResNet-50, 53 Conv2d + the Linear classifier)",
    )
    nominal = NOMINAL_COST_MODEL
    dry.add_argument(
        "--alpha",
        type=float,
        default=None,
        help=f"collective start-up in s (default {nominal.collective.alpha:g})",
    )
    dry.add_argument(
        "--beta",
        type=float,
        default=None,
        help=f"collective s per payload byte (default {nominal.collective.beta:g})",
    )
    dry.add_argument(
        "--decomposition-c0",
        type=float,
        default=None,
        help=f"fixed s per decomposition (default {nominal.decomposition.c0:g})",
    )
    dry.add_argument(
        "--decomposition-c3",
        type=float,
        default=None,
        help=f"s per d^3 of a decomposition (default {nominal.decomposition.c3:g})",
    )


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _parse_schedules(value: str) -> tuple[tuple[int, int], ...]:
    schedules: list[tuple[int, int]] = []
    for item in _csv(value):
        try:
            f, i = (int(part) for part in item.split(":"))
        except ValueError:
            raise ConfigError(
                f"--schedules: {item!r} is not factor_steps:inverse_steps (e.g. 10:100)"
            ) from None
        if f < 1 or i < 1 or i % f != 0:
            raise ConfigError(
                f"--schedules: {item!r} needs steps >= 1 and inverse steps a multiple of the "
                "factor steps"
            )
        if (f, i) not in schedules:
            schedules.append((f, i))
    if not schedules:
        raise ConfigError("--schedules needs at least one factor_steps:inverse_steps pair")
    return tuple(schedules)


def _cost_model_from_args(args: argparse.Namespace) -> ClusterCostModel:
    """The dry run's cost model: the nominal constants, with those given on the command line."""
    given = {
        name: getattr(args, name, None)
        for name in ("alpha", "beta", "decomposition_c0", "decomposition_c3")
    }
    if getattr(args, "layers", None) is None:
        flags = [
            f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None
        ]
        if flags:
            raise ConfigError(f"{', '.join(flags)}: options of a dry run, which needs --layers")
        return NOMINAL_COST_MODEL
    for name, value in given.items():
        if value is not None and not value >= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value!r}")
    nominal = NOMINAL_COST_MODEL

    def pick(name: str, default: float) -> float:
        value = given[name]
        return default if value is None else float(value)

    return ClusterCostModel(
        AlphaBeta(pick("alpha", nominal.collective.alpha), pick("beta", nominal.collective.beta)),
        CubicCost(
            pick("decomposition_c0", nominal.decomposition.c0),
            pick("decomposition_c3", nominal.decomposition.c3),
        ),
    )


def options_from_args(args: argparse.Namespace, *, models: str, nprocs: str) -> BenchOptions:
    """Fill in the defaults (which depend on ``--quick`` and ``--layers``) and validate.

    Raises:
        ConfigError: a bad option, with the one line the user sees.
    """
    layers = getattr(args, "layers", None)
    cost_model = _cost_model_from_args(args)
    if layers is not None:
        if args.quick:
            raise ConfigError("--quick times a small run; a dry run (--layers) times nothing")
        nprocs = str(DRY_RUN_NPROCS)
    defaults = (
        QUICK_DEFAULTS if args.quick else {**FULL_DEFAULTS, "models": models, "nprocs": nprocs}
    )
    values = {
        name: default if getattr(args, name) is None else getattr(args, name)
        for name, default in defaults.items()
    }
    model_names = _csv(values["models"])
    unknown = [m for m in model_names if m not in MODELS]
    if unknown or not model_names:
        raise ConfigError(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    try:
        world_sizes = [int(p) for p in _csv(values["nprocs"])]
    except ValueError:
        raise ConfigError(
            f"--nprocs must be comma-separated integers, got {values['nprocs']!r}"
        ) from None
    if not world_sizes or min(world_sizes) < 1:
        raise ConfigError("--nprocs needs at least one world size >= 1")
    if layers is not None and min(world_sizes) < 2:
        raise ConfigError("--nprocs: a dry run (--layers) needs world sizes of at least 2")
    strategies = _csv(args.strategies)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ConfigError(
            f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)} (SGD is "
            "always measured as the reference)"
        )
    for name, minimum in (("rounds", 1), ("warmup", 0), ("iters", 1), ("iters_long", 1)):
        if values[name] < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {minimum}")
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be at least 1")
    if values["timeout"] <= 0:
        raise ConfigError("--timeout must be positive")
    if args.bucket_cap_mb <= 0:
        raise ConfigError("--bucket-cap-mb must be positive")
    return BenchOptions(
        models=tuple(dict.fromkeys(model_names)),
        nprocs=tuple(dict.fromkeys(world_sizes)),
        rounds=values["rounds"],
        warmup=values["warmup"],
        iters=values["iters"],
        iters_long=values["iters_long"],
        timeout=float(values["timeout"]),
        strategies=tuple(s for s in STRATEGIES if s in strategies),
        schedules=_parse_schedules(args.schedules),
        batch_size=args.batch_size,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        quick=args.quick,
        layers=layers,
        cost_model=cost_model,
    )


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


def _worker_env() -> dict[str, str]:
    """One thread per worker, and the workers import this very copy of ``dkfac``."""
    package_root = str(Path(dkfac.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=package_root if not path else os.pathsep.join([package_root, path]),
    )


def launch(nprocs: int, options: BenchOptions, folder: Path) -> Launch:
    """Run the workers for ``nprocs`` processes through torchrun; collect rank 0's report."""
    out = folder / f"strategies_p{nprocs}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nprocs}",
        "-m",
        WORKER_MODULE,
        *options.worker_argv(out),
    ]
    print(f"launching P={nprocs}: {' '.join(command)}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_worker_env(),
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
        returncode: int | None = process.wait(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"P={nprocs}: timed out after {options.timeout} s, stopping", file=sys.stderr)
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


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Launch every world size in turn; the combined report (JSON-ready).

    With ``options.layers`` nothing is launched: the report is the dry run's
    (:func:`dkfac.bench.dry_run.dry_run_report`, ``"benchmark": "dry_run"``).

    Raises:
        ConfigError: this process is itself a rank of a torch.distributed launch.
    """
    if options.layers is not None:
        return dry_run_report(
            options.layers,
            options.nprocs,
            options.strategies,
            cost_model=options.cost_model,
            bucket_cap_mb=options.bucket_cap_mb,
        )
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        raise ConfigError(
            "started inside a torch.distributed launch; run the benchmark directly, it "
            "launches its own workers"
        )
    launches: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="dkfac_bench_") as folder:
        for nprocs in options.nprocs:
            launches.append(launch(nprocs, options, Path(folder)))
    rows = summary_rows([(item.nprocs, item.report) for item in launches], options.models)
    return {
        "benchmark": "strategies",
        "environment": environment(),
        "settings": options.settings(),
        "launches": [item.to_json() for item in launches],
        "summary": rows,
        "reference": REFERENCE,
        "target": evaluate_target(rows),
        "pipelined_target": evaluate_pipelined_target(rows),
    }


def failed_launches(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The launches of ``report`` that did not exit cleanly with a report."""
    return [item for item in report["launches"] if not item["ok"]]


def write_json(report: dict[str, Any], path: Path) -> Path:
    """Write ``report`` (indented JSON) to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
