"""Cost of the distributed K-FAC strategies (``dkfac``, ``kaisa``) against DDP + SGD.

A thin front end of ``dkfac bench`` (:mod:`dkfac.cli.bench`, which launches
``python -m torch.distributed.run ... -m dkfac.cli.bench_worker`` per world size; the
measurement is described in :mod:`dkfac.cli.bench_worker`). This script keeps its own defaults
(ResNet-20 and ResNet-32, P in 2 and 4), prints the same table and reference/target lines and
writes the combined report to ``--json`` instead of a results folder with a chart.

Usage::

    .venv/bin/python benchmarks/strategies.py            # full run (tens of minutes)
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
MODELS = "resnet20,resnet32"
NPROCS = "2,4"


def main(argv: list[str] | None = None) -> int:
    """Launch every world size, print the table, write the JSON; return the exit code."""
    parser = argparse.ArgumentParser(
        description="Time DDP + SGD vs dkfac/kaisa K-FAC strategies on CIFAR ResNets (gloo, CPU)."
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
