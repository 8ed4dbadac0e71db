"""Cost of the distributed K-FAC strategies (dkfac, kaisa, spd, pad, dp) against DDP + SGD.

A thin front end of ``dkfac bench`` (:mod:`dkfac.bench.command`, which launches
``python -m torch.distributed.run ... -m dkfac.bench.worker`` per world size; the
measurement is described in :mod:`dkfac.bench.worker`). This script keeps its own defaults:
ResNet-20, ResNet-32 and MLP-6 (a 6-layer MLP with 1024-wide layers, the communication-bound
case), P in 2 and 4, every strategy (``dkfac``; ``kaisa`` at f = 1/P, and 1/2 when P > 2
is even; ``spd`` = SPD-KFAC; ``pad`` = PAD-KFAC; ``dp`` = DP-KFAC) at schedules (1,1) and
(10,100). It prints the same table and, read from ``benchmarks/targets.json`` unless
``--targets`` names another file (``dkfac bench`` reads none unless given one), the reference
line and both targets (dkfac's ResNet-20 P=2 overhead; spd and pad at least 10% faster than
dkfac per factor-update iteration at P=4, with the phase breakdown of every comparison), and
writes the combined report to ``--json`` instead of a results folder with a chart.

``--layers resnet50`` is a dry run instead (no training, no process group, seconds): from
ImageNet ResNet-50's layer shapes it computes, with the strategies' own planners and packing
rules, each strategy's bytes per worker, decomposition work and factor + decomposition memory
of one second-order update at P = 64 (``--nprocs`` to change), prints the table and the
dp vs dkfac ratios against the dry-run target of the targets file (the DP-KFAC paper's
2.79x / 1.14x), and writes ``results/resnet50_dry_run.json`` (:mod:`dkfac.bench.dry_run`).

Usage::

    .venv/bin/python benchmarks/strategies.py            # full run (long: every model, P, strategy)
    .venv/bin/python benchmarks/strategies.py --quick    # smoke test (ResNet-20, P=2)
    .venv/bin/python benchmarks/strategies.py --layers resnet50   # dry run, P=64
    .venv/bin/dkfac bench --quick --targets benchmarks/targets.json --out runs/bench
                                                         # the same, plus bench.png
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dkfac.bench.command import failed_launches, run_bench, write_json
from dkfac.bench.configs import PHASES
from dkfac.bench.options import add_bench_options, options_from_args
from dkfac.bench.report import format_summary
from dkfac.cli.config import ConfigError

__all__ = ["PHASES", "main"]

#: Default output, under the working folder (outside the source tree).
DEFAULT_JSON = Path("runs") / "strategies.json"
#: Where a dry run (``--layers NAME``) writes by default: ``NAME_dry_run.json``.
RESULTS = DEFAULT_JSON.parent
#: The reference and the targets checked by default (``--targets`` to change), as a path
#: relative to where the script runs, so reports carry no machine-specific directory.
DEFAULT_TARGETS = Path(os.path.relpath(Path(__file__).resolve().parent / "targets.json"))
MODELS = "resnet20,resnet32,mlp6"
NPROCS = "2,4"


def main(argv: list[str] | None = None) -> int:
    """Launch every world size, print the table, write the JSON; return the exit code."""
    parser = argparse.ArgumentParser(
        description="Time DDP + SGD vs the dkfac/kaisa/spd/pad/dp K-FAC strategies on CIFAR "
        "ResNets and a wide 6-layer MLP (gloo, CPU), or (--layers) compute their bytes, "
        "decomposition work and memory from a model's layer shapes."
    )
    add_bench_options(parser, models=MODELS, nprocs=NPROCS, targets=DEFAULT_TARGETS)
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"output JSON (default {DEFAULT_JSON}; with --layers NAME: "
        f"{RESULTS / 'NAME_dry_run.json'})",
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
    json_path = args.json
    if json_path is None:
        json_path = RESULTS / f"{options.layers}_dry_run.json" if options.layers else DEFAULT_JSON
    path = write_json(report, json_path)
    print(f"\nJSON: {path}")
    return 1 if failed_launches(report) else 0


if __name__ == "__main__":
    sys.exit(main())
