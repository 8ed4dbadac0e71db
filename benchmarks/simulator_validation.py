"""The simulator's predictions against the emulated cluster's measurements (issue 14).

Profiles each measured model on this machine (one worker: one intra-op thread, as the
benchmark's workers; or reads ``--profile MODEL=FILE``), then predicts every row of the given
emulated-cluster results (``benchmarks/network.py`` JSON: P, rate, strategy, schedule) with
``dkfac simulate``'s timeline and prints measured against predicted (:mod:`dkfac.sim.validation`).
Writes ``validation.json`` (the rows and the profiles used) to ``--out``. Measure with the
machine otherwise idle: the profile is the compute the simulator assumes.

Usage::

    .venv/bin/python benchmarks/simulator_validation.py
    .venv/bin/python benchmarks/simulator_validation.py \
        --results benchmarks/results/network_pad_lanes.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

import torch

from dkfac.bench.models import MODELS, batch_loss, model_batch
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.profiling import measure_profile
from dkfac.sim.validation import compare_rows, format_comparison

RESULTS = os.path.join("benchmarks", "results", "network_*.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="*", help=f"network.json files (default {RESULTS})")
    parser.add_argument(
        "--profile", action="append", default=[], metavar="MODEL=FILE", help="a saved profile"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument("--out", default=os.path.join("runs", "sim_validation"))
    args = parser.parse_args(argv)
    paths = args.results or sorted(glob.glob(RESULTS))
    results = {path: json.loads(Path(path).read_text()) for path in paths}
    models = sorted({row["model"] for data in results.values() for row in data["summary"]})
    profiles = {}
    for entry in args.profile:
        model, _, file = entry.partition("=")
        profiles[model] = ComputeProfile.load(file)
    torch.set_num_threads(1)
    for model in models:
        if model in profiles or model not in MODELS:
            continue
        torch.manual_seed(0)
        print(f"profiling {model} (batch {args.batch_size}, 1 thread)...", flush=True)
        profiles[model] = measure_profile(
            MODELS[model](),
            model_batch(model, args.batch_size, 0),
            batch_loss,
            device=f"{model}, this machine, 1 thread",
            steps=args.steps,
        )
    compared = []
    for path, data in results.items():
        compared += compare_rows(data["summary"], profiles, source=os.path.basename(path))
    print(format_comparison(compared))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "simulator_validation",
        "results": paths,
        "rows": compared,
        "profiles": {model: profile.to_dict() for model, profile in profiles.items()},
    }
    (out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nresults: {out / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
