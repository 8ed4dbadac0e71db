"""The options of ``dkfac bench``: the command-line flags, their defaults, their validation.

:func:`add_bench_options` declares the flags on a parser (``dkfac bench`` and
``benchmarks/strategies.py`` share them); :func:`options_from_args` fills in the defaults of a
full run or of ``--quick`` and turns the parsed flags into a validated :class:`BenchOptions`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from dkfac.bench.configs import (
    AUTO_WITH_DEAR,
    INPUT_SHAPES,
    INVERSE_METHOD,
    KFAC_WITH_DEAR,
    LR,
    MODELS,
    MOMENTUM,
    NUM_CLASSES,
    SCHEDULES,
    STRATEGIES,
    STRATEGY_CHOICES,
    TOKEN_VOCABULARIES,
    comma_separated,
    dear_settings,
    parse_schedules,
)
from dkfac.bench.dry_run import DRY_RUN_NPROCS, NOMINAL_COST_MODEL
from dkfac.bench.dry_run_options import add_dry_run_options, cost_model_from_args
from dkfac.bench.link_shape import LinkShape
from dkfac.bench.report import MB
from dkfac.bench.targets import BenchTargets, load_targets
from dkfac.cli.config import ConfigError
from dkfac.cli.device import DEVICES, DeviceError, LocalSlot, backend_for, resolve_device
from dkfac.comm.cost_model import ClusterCostModel

#: Defaults of a full run and of ``--quick`` (models and world sizes come from the front end).
FULL_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "rounds": 2,
        "warmup": 3,
        "iters": 10,
        "iters_long": 100,
        "timeout": 3600.0,
    }
)
QUICK_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "nprocs": "2",
        "models": "resnet20",
        "rounds": 1,
        "warmup": 2,
        "iters": 3,
        "iters_long": 10,
        "timeout": 300.0,
    }
)


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
    targets: BenchTargets | None = None
    network: LinkShape | None = None
    #: Where every worker runs: "cuda" (GPU ``LOCAL_RANK`` each, NCCL) or "cpu" (gloo).
    device: str = "cpu"

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
            "--device",
            self.device,
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
            "device": self.device,
            "backend": backend_for(torch.device(self.device)),
            "threads_per_process": 1,
            "inverse_method": INVERSE_METHOD,
            "lr": LR,
            "momentum": MOMENTUM,
            "input_shapes": {model: list(INPUT_SHAPES[model]) for model in self.models},
            "token_vocabularies": {
                model: TOKEN_VOCABULARIES[model]
                for model in self.models
                if model in TOKEN_VOCABULARIES
            },
            "num_classes": NUM_CLASSES,
            "dear": dear_settings(self.strategies),
            "schedules": [list(s) for s in self.schedules],
            "gc_disabled_in_window": True,
            "mb": MB,
            "network": None if self.network is None else self.network.as_dict(),
        }


def add_bench_options(
    parser: argparse.ArgumentParser, *, models: str, nprocs: str, targets: Path | None = None
) -> None:
    """The benchmark's options.

    Args:
        parser: The parser to add them to.
        models: The models of a full run.
        nprocs: The world sizes of a full run.
        targets: The default of ``--targets`` (``None``: measurements only unless given).
    """
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
        help="what to time besides the DDP + SGD reference, comma-separated, from "
        f"{', '.join(STRATEGY_CHOICES)}: dear = SGD with DeAR's gradient averaging instead of "
        "DDP (no K-FAC, its bucket size searched in the warm-up); the others are K-FAC "
        "strategies (spd = SPD-KFAC, pad = PAD-KFAC, dp = DP-KFAC, auto = the one "
        "dkfac.AutoOptions chooses; STRATEGY+dear = that strategy with DeAR averaging the "
        "gradients, kaisa at 1/P); kaisa runs with fraction "
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
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: a GPU per worker (NCCL) if there is one for the largest --nprocs, else "
        "the CPU (gloo); cpu; cuda (an error without enough GPUs) (default auto)",
    )
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
    parser.add_argument(
        "--targets",
        metavar="FILE",
        default=None if targets is None else str(targets),
        help="JSON file of the reference and the targets to check the measurements against, "
        "e.g. benchmarks/targets.json; without it only the measurements are reported "
        f"(default {'none' if targets is None else targets})",
    )
    add_dry_run_options(parser)
    parser.add_argument(
        "--network",
        metavar="RATE[,DELAY]",
        default=None,
        help="run each worker in its own network namespace on an emulated cluster whose "
        "links carry RATE each way (tc units: 100mbit, 1gbit) and, where the kernel has netem, "
        "add DELAY (e.g. 50us); needs root (CAP_NET_ADMIN). Default: this machine's loopback",
    )


def _network_from_args(args: argparse.Namespace) -> LinkShape | None:
    """The emulated cluster's link of ``--network``; ``None`` for loopback.

    Raises:
        ConfigError: a bad rate or delay, or ``--network`` with a dry run.
    """
    text = getattr(args, "network", None)
    if text is None:
        return None
    if getattr(args, "layers", None) is not None:
        raise ConfigError("--network times runs on an emulated cluster; a dry run times nothing")
    try:
        return LinkShape.parse(text)
    except ValueError as error:
        raise ConfigError(f"--network: {error}") from None


def _targets_from_args(args: argparse.Namespace) -> BenchTargets | None:
    """The targets file of ``--targets``, read and validated; ``None`` when not given.

    Raises:
        ConfigError: the file does not exist, or :func:`load_targets` refuses it.
    """
    path = getattr(args, "targets", None)
    if path is None:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"--targets: {path}: no such file")
    try:
        return load_targets(path)
    except ValueError as error:
        raise ConfigError(f"--targets: {error}") from None


def options_from_args(args: argparse.Namespace, *, models: str, nprocs: str) -> BenchOptions:
    """Fill in the defaults (which depend on ``--quick`` and ``--layers``) and validate.

    Raises:
        ConfigError: a bad option, with the one line the user sees.
    """
    layers = getattr(args, "layers", None)
    cost_model = cost_model_from_args(args)
    network = _network_from_args(args)
    targets = _targets_from_args(args)
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
    model_names = comma_separated(values["models"])
    unknown = [m for m in model_names if m not in MODELS]
    if unknown or not model_names:
        raise ConfigError(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    try:
        world_sizes = [int(p) for p in comma_separated(values["nprocs"])]
    except ValueError:
        raise ConfigError(
            f"--nprocs must be comma-separated integers, got {values['nprocs']!r}"
        ) from None
    if not world_sizes or min(world_sizes) < 1:
        raise ConfigError("--nprocs needs at least one world size >= 1")
    if layers is not None and min(world_sizes) < 2:
        raise ConfigError("--nprocs: a dry run (--layers) needs world sizes of at least 2")
    strategies = comma_separated(args.strategies)
    unknown = [s for s in strategies if s not in STRATEGY_CHOICES]
    if unknown or not strategies:
        raise ConfigError(
            f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGY_CHOICES)} (SGD "
            "is always measured as the reference)"
        )
    if layers is not None and (
        not set(strategies) & set(STRATEGIES) or set(strategies) & {*KFAC_WITH_DEAR, AUTO_WITH_DEAR}
    ):
        raise ConfigError("--strategies: a dry run (--layers) counts K-FAC strategies only")
    for name, minimum in (("rounds", 1), ("warmup", 0), ("iters", 1), ("iters_long", 1)):
        if values[name] < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {minimum}")
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be at least 1")
    if values["timeout"] <= 0:
        raise ConfigError("--timeout must be positive")
    if args.bucket_cap_mb <= 0:
        raise ConfigError("--bucket-cap-mb must be positive")
    schedules = parse_schedules(args.schedules)  # refused before the device is chosen (logged)
    # One device for every world size (a report mixing GPUs and CPUs compares neither). An
    # emulated cluster shapes TCP between CPU workers (NCCL would bypass the link) and a
    # dry run times nothing: both on the CPU.
    choice = getattr(args, "device", "cpu")
    if network is not None or layers is not None:
        if choice == "cuda":
            raise ConfigError("--device cuda is not allowed with --network or --layers")
        choice = "cpu"
    try:
        gpus = torch.cuda.device_count()
        device = resolve_device(choice, LocalSlot(0, max(world_sizes)), gpus).type
    except DeviceError as error:
        raise ConfigError(str(error).replace("--nproc ", "--nprocs ")) from None
    return BenchOptions(
        models=tuple(dict.fromkeys(model_names)),
        nprocs=tuple(dict.fromkeys(world_sizes)),
        rounds=values["rounds"],
        warmup=values["warmup"],
        iters=values["iters"],
        iters_long=values["iters_long"],
        timeout=float(values["timeout"]),
        strategies=tuple(s for s in STRATEGY_CHOICES if s in strategies),
        schedules=schedules,
        batch_size=args.batch_size,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        quick=args.quick,
        layers=layers,
        cost_model=cost_model,
        targets=targets,
        network=network,
        device=device,
    )
