"""``dkfac simulate``: predict each strategy's time per iteration on a cluster that is not here.

The compute comes from a profile (``--profile FILE``, or ``--profile-here``: measured now on
this machine), the network from ``--network RATE[,DELAY]`` or an allreduce ``--calibration``
(the ``cost_model`` that ``pre.plan()`` reports, with the world size it was measured at).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.link_shape import LinkShape
from dkfac.cli.config import ConfigError
from dkfac.comm.cost_model import AlphaBeta
from dkfac.sim.command import (
    DEFAULT_STRATEGIES,
    SimulateOptions,
    format_table,
    parse_schedules,
    parse_world_sizes,
    profile_models,
    run_simulation,
    strategies_of,
    write_chart,
)
from dkfac.sim.network import LinkModel
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import GRADIENT_SYNCS


def add_simulate_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``simulate`` subcommand and its options."""
    parser = sub.add_parser(
        "simulate",
        help="predict each strategy's time per iteration against the world size, from a "
        "compute profile and a network",
        description="Simulate one training step of SGD and each K-FAC strategy per world "
        "size with the strategies' own planners and collectives; print the table and write "
        "OUT/simulate.json and OUT/simulate.png.",
    )
    parser.add_argument(
        "--model",
        default="resnet32",
        choices=profile_models(),
        help="model to profile with --profile-here (default: resnet32)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="compute profile JSON (from --save-profile)")
    source.add_argument(
        "--profile-here",
        action="store_true",
        help="measure --model's compute profile on this machine first",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default: 32)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads while profiling here (default: 1, as a benchmark worker)",
    )
    parser.add_argument(
        "--amp",
        default="none",
        choices=("none", "bf16"),
        help="with --profile-here: the forward pass under torch.autocast in bfloat16, as "
        "dkfac train --amp bf16 runs it (default: none)",
    )
    parser.add_argument("--save-profile", help="write the measured profile to this JSON file")
    network = parser.add_mutually_exclusive_group()
    network.add_argument(
        "--network",
        default="10gbit",
        help="each worker's link, RATE[,DELAY] in tc units, e.g. 10gbit,50us (default: 10gbit)",
    )
    network.add_argument(
        "--calibration",
        help="JSON with alpha_s, beta_s_per_byte (an allreduce line, as pre.plan()['cost_model']"
        " reports) and world_size",
    )
    parser.add_argument(
        "--world-sizes",
        default="2-64",
        help="comma list, or LOW-HIGH: LOW and its doublings up to HIGH (default 2-64)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated, from {', '.join(DEFAULT_STRATEGIES)} (default: all)",
    )
    parser.add_argument(
        "--schedules", default="1:1,10:100", help="K-FAC f:i pairs (default: 1:1,10:100)"
    )
    parser.add_argument(
        "--backend", default="nccl", choices=("nccl", "gloo"), help="(default: nccl)"
    )
    parser.add_argument(
        "--grad-sync",
        default="ddp",
        choices=GRADIENT_SYNCS,
        help="gradient averaging of every row: ddp (allreduce buckets) or dear (DeAR: "
        "reduce-scatters under backward, all-gathers under the next forward) (default: ddp)",
    )
    parser.add_argument(
        "--kaisa-fraction",
        type=float,
        default=None,
        help="KAISA's grad_worker_fraction (default: 1/P at each P)",
    )
    parser.add_argument(
        "--out",
        default=os.path.join("runs", "simulate"),
        help="folder of simulate.json and simulate.png (default: runs/simulate)",
    )


def _link(args: argparse.Namespace) -> tuple[LinkModel, str]:
    """The link of ``--network`` or ``--calibration`` and how to name it."""
    if args.calibration:
        try:
            with open(args.calibration, encoding="utf-8") as handle:
                data = json.load(handle)
            fit = AlphaBeta(float(data["alpha_s"]), float(data["beta_s_per_byte"]))
            world_size = int(data["world_size"])
            return LinkModel.from_allreduce_fit(fit, world_size), f"calibration {args.calibration}"
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"--calibration {args.calibration}: {error}") from None
    try:
        shape = LinkShape.parse(args.network)
    except ValueError as error:
        raise ConfigError(f"--network {args.network}: {error}") from None
    return LinkModel.from_link_shape(shape), args.network


def _profile(args: argparse.Namespace) -> ComputeProfile:
    """The compute profile of ``--profile``, or measured here (``--profile-here``)."""
    if args.profile:
        if args.amp != "none":
            raise ConfigError(
                "--amp applies to --profile-here only: a saved profile was measured as it was"
            )
        try:
            return ComputeProfile.load(args.profile)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--profile {args.profile}: {error}") from None
    from dkfac.bench.models import MODELS, batch_loss, model_batch
    from dkfac.sim.profiling import measure_profile

    if args.batch_size < 1 or args.threads < 1:
        raise ConfigError("--batch-size and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MODELS[args.model]()
    print(f"profiling {args.model}, batch {args.batch_size}, {args.threads} thread(s)...")
    profile = measure_profile(
        model,
        model_batch(args.model, args.batch_size, 0),
        batch_loss,
        device=f"{args.model} on this machine, {args.threads} thread(s)",
        autocast=torch.bfloat16 if args.amp == "bf16" else None,
    )
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"profile: {args.save_profile}")
    return profile


def cmd_simulate(args: argparse.Namespace) -> int:
    """``dkfac simulate``: the table, ``simulate.json`` and ``simulate.png`` under ``--out``."""
    link, network = _link(args)
    try:
        options = SimulateOptions(
            world_sizes=parse_world_sizes(args.world_sizes),
            strategies=strategies_of(args.strategies),
            schedules=parse_schedules(args.schedules),
            backend=args.backend,
            kaisa_fraction=args.kaisa_fraction,
            gradient_sync=args.grad_sync,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {args.out}: cannot write there ({error.strerror})") from None
    profile = _profile(args)
    model = args.model if args.profile_here else profile.device
    report = run_simulation(profile, link, options, model=model, network=network)
    print(format_table(report))
    json_path = out / "simulate.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    chart = write_chart(report, out / "simulate.png")
    print(f"\nresults: {json_path}")
    print(f"chart: {chart}" if chart else "chart: skipped (needs matplotlib, the cli extra)")
    return 0
