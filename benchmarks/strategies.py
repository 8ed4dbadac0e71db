"""Cost of the distributed K-FAC strategies (dkfac, kaisa, spd, pad, dp) against DDP + SGD.

A thin front end of ``dkfac bench`` (:mod:`dkfac.cli.bench`, which launches
``python -m torch.distributed.run ... -m dkfac.cli.bench_worker`` per world size; the
measurement is described in :mod:`dkfac.cli.bench_worker`). This script keeps its own defaults:
ResNet-20, ResNet-32 and MLP-6 (a 6-layer MLP with 1024-wide layers, the communication-bound
case), P in 2 and 4, every strategy (``dkfac``, ``kaisa``, ``spd`` = SPD-KFAC, ``pad`` =
PAD-KFAC) at schedules (1,1) and (10,100). It prints the same table, the reference line and
both targets (dkfac's ResNet-20 P=2 overhead; spd and pad at least 10% faster than dkfac per
factor-update iteration at P=4, with the phase breakdown of every comparison) and writes the
combined report to ``--json`` instead of a results folder with a chart.

Usage::

    .venv/bin/python benchmarks/strategies.py            # full run (long: every model, P, strategy)
    .venv/bin/python benchmarks/strategies.py --quick    # smoke test (ResNet-20, P=2)
    .venv/bin/dkfac bench --quick --out runs/bench       # the same, plus bench.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dkfac.cli.bench import (
    add_bench_options,
    failed_launches,
    options_from_args,
    run_bench,
    write_json,
)
from dkfac.cli.bench_configs import PHASES
from dkfac.cli.bench_report import format_summary
from dkfac.cli.config import ConfigError

__all__ = ["PHASES", "main"]

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "strategies.json"
MODELS = "resnet20,resnet32,mlp6"
NPROCS = "2,4"


def main(argv: list[str] | None = None) -> int:
    """Launch every world size, print the table, write the JSON; return the exit code."""
    parser = argparse.ArgumentParser(
        description="Time DDP + SGD vs the dkfac/kaisa/spd/pad/dp K-FAC strategies on CIFAR "
        "ResNets and a wide 6-layer MLP (gloo, CPU)."
    )
    add_bench_options(parser, models=MODELS, nprocs=NPROCS)
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args, models=MODELS, nprocs=NPROCS)
    except ConfigError as error:
        parser.error(str(error))
    try:
        report = run_bench(options)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_summary(report))
    path = write_json(report, args.json)
    print(f"\nJSON: {path}")
    return 1 if failed_launches(report) else 0


if __name__ == "__main__":
    sys.exit(main())
