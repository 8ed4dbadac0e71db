"""DDP + SGD, DeAR + SGD and the K-FAC strategies on an emulated cluster, at several link rates.

A thin front end of ``dkfac bench --network RATE`` (:func:`dkfac.bench.command.run_bench`, one
run per rate; the measurement is described in :mod:`dkfac.bench.worker`): P = 2 workers
(``--nprocs``: 4 share this machine's two cores, two per core), each in its own network
namespace with a full-duplex link shaped to the rate (:mod:`dkfac.bench.emulated_cluster`;
needs root or CAP_NET_ADMIN), on ResNet-32 and the
Transformer language model, timing DDP + SGD, DeAR + SGD (``dear``) and every K-FAC strategy
(``dkfac``; ``kaisa`` at f = 1/P; ``spd``; ``pad``; ``dp``) at schedules (1,1) and (10,100).

Prints, per model, the median iteration time per rate (and its change from DDP + SGD at that
rate), then per rate the phases (factor_comm, inverse_comm, grad_comm, K-FAC compute) and bytes
per step (:mod:`dkfac.bench.network_report`); writes ``network.json`` (every launch of every
rate, with its rate) and ``network.png`` (median iteration time against the rate, one line per
configuration, one panel per model) to ``--out``.

Usage::

    .venv/bin/python benchmarks/network.py                       # 20, 50, 400 Mbit/s
    .venv/bin/python benchmarks/network.py --rates 100mbit,1gbit --models transformer
    .venv/bin/python benchmarks/network.py --quick               # smoke test: 1 Gbit/s, ResNet-20

Where no namespace can be made, it prints why in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from dkfac.bench.command import run_bench, write_json
from dkfac.bench.configs import (
    AUTO,
    AUTO_WITH_DEAR,
    KFAC_WITH_DEAR,
    STRATEGY_CHOICES,
    comma_separated,
)
from dkfac.bench.emulated_cluster import ClusterUnavailableError, unavailable_reason
from dkfac.bench.link_shape import LinkShape
from dkfac.bench.network_report import (
    combine_rates,
    failed_rates,
    format_rate_tables,
    write_rate_chart,
)
from dkfac.bench.options import BenchOptions, options_from_args
from dkfac.cli.config import ConfigError

#: Rates of a full run, where D-KFAC's factor communication is about 40%, 35% and 15% of its
#: ResNet-32 (1,1) iteration (docs/benchmarks.md), and of ``--quick``.
RATES = "20mbit,50mbit,400mbit"
QUICK_RATE = "1gbit"
MODELS = "resnet32,transformer"
#: By default every choice but auto and K-FAC with DeAR (on request).
STRATEGIES = ",".join(
    s for s in STRATEGY_CHOICES if s not in (AUTO, AUTO_WITH_DEAR, *KFAC_WITH_DEAR)
)
SCHEDULES = "1:1,10:100"
#: World size: two workers, two cores, one worker per core.
NPROCS = "2"
#: Seconds per launch (one rate, every model and round) of a full run: at 30 Mbit/s one
#: Transformer K-FAC (1,1) iteration moves about 67 MB (about 18 s), beyond dkfac bench's hour.
TIMEOUT_S = 6 * 3600.0
DEFAULT_OUT = Path("runs") / "bench_network"


def parse_rates(value: str) -> list[tuple[str, LinkShape]]:
    """``"30mbit,100mbit"`` as distinct ``(text, link)`` pairs, slowest first.

    Raises:
        ConfigError: a rate ``tc`` would not read as bits per second, or none at all.
    """
    links: dict[str, LinkShape] = {}
    for text in comma_separated(value):
        try:
            links.setdefault(text, LinkShape.parse(text))
        except ValueError as error:
            raise ConfigError(f"--rates: {error}") from None
    if not links:
        raise ConfigError("--rates needs at least one rate, e.g. 100mbit")
    return sorted(links.items(), key=lambda item: item[1].rate_bit_s)


def build_parser() -> argparse.ArgumentParser:
    """The script's options; those of ``dkfac bench`` keep its names and meaning."""
    parser = argparse.ArgumentParser(
        description="Time DDP + SGD, DeAR + SGD and the K-FAC strategies with P workers on "
        "an emulated cluster whose links are shaped to each rate (needs CAP_NET_ADMIN)."
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="link rates, comma-separated, in tc's bit units (default "
        f"{RATES}; --quick: {QUICK_RATE})",
    )
    parser.add_argument("--models", default=None, help=f"models (default {MODELS}; quick resnet20)")
    parser.add_argument(
        "--strategies",
        default=STRATEGIES,
        help="dear, K-FAC strategies and auto besides DDP + SGD, from "
        f"{','.join(STRATEGY_CHOICES)} (default {STRATEGIES})",
    )
    parser.add_argument(
        "--schedules", default=SCHEDULES, help=f"K-FAC f:i pairs (default {SCHEDULES})"
    )
    parser.add_argument(
        "--nprocs",
        default=NPROCS,
        help=f"workers, one world size (default {NPROCS}; more than the cores share them)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2, quick 1)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default 3, quick 2)"
    )
    parser.add_argument(
        "--iters", type=int, default=None, help="timed iterations at (1,1) (default 10, quick 3)"
    )
    parser.add_argument(
        "--iters-long",
        type=int,
        default=None,
        help="timed iterations of periodic schedules (default 100, quick 10)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="batch size per worker (default 32)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds allowed per launch, i.e. per rate (default {TIMEOUT_S:g}, quick 300)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: one rate ({QUICK_RATE}), resnet20, 1 round, few iterations",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder of network.json and network.png (default {DEFAULT_OUT})",
    )
    # What dkfac bench's options need and this script keeps fixed.
    parser.set_defaults(seed=0, bucket_cap_mb=25.0)
    return parser


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The options of every rate's ``run_bench`` (no link yet), with this script's defaults.

    Raises:
        ConfigError: a bad option, in one line.
    """
    if args.timeout is None and not args.quick:
        args.timeout = TIMEOUT_S
    return options_from_args(args, models=MODELS, nprocs=args.nprocs)


def main(argv: list[str] | None = None) -> int:
    """Run every rate, print the tables, write the JSON and the chart; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = bench_options(args)
        rates = parse_rates(args.rates or (QUICK_RATE if args.quick else RATES))
    except ConfigError as error:
        parser.error(str(error))
    reason = unavailable_reason()
    if reason is not None:
        print(f"error: no emulated cluster on this machine: {reason}", file=sys.stderr)
        return 2
    runs: list[tuple[str, LinkShape, dict[str, Any]]] = []
    json_path = args.out / "network.json"
    try:
        for text, link in rates:
            print(f"== {link.label()} ==", file=sys.stderr, flush=True)
            runs.append((text, link, run_bench(dataclasses.replace(options, network=link))))
            # Written after every rate: a long run stopped at a slow rate keeps the others.
            write_json(combine_rates(options.settings(), runs), json_path)
    except (ClusterUnavailableError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = combine_rates(options.settings(), runs)
    print(format_rate_tables(result))
    path = write_json(result, json_path)
    chart = write_rate_chart(result, args.out / "network.png")
    print(f"\nJSON: {path}")
    print(f"chart: {chart}" if chart else "chart: skipped (needs matplotlib)")
    failed = failed_rates(result)
    if failed:
        print(f"launches failed at {', '.join(failed)} (see network.json)", file=sys.stderr)
    return 1 if failed or not result["summary"] else 0


if __name__ == "__main__":
    sys.exit(main())
