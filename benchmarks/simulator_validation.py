"""The simulator's predictions against the emulated cluster's measurements (issue 14).

Profiles each measured model on this machine as the benchmark's workers ran (one intra-op
thread each, ``--workers`` copies at once, one per core: they share memory bandwidth and
caches; or reads ``--profile MODEL=FILE``), then predicts every row of the given
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
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.models import MODELS, batch_loss, model_batch
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.profiling import measure_profile
from dkfac.sim.validation import compare_rows, format_comparison

RESULTS = os.path.join("benchmarks", "results", "network_*.json")


def _profile_worker(core: int, model: str, batch_size: int, steps: int) -> dict[str, Any]:
    """One worker's profile, pinned to ``core`` with one thread, as a benchmark worker runs."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    profile = measure_profile(
        MODELS[model](),
        model_batch(model, batch_size, 0),
        batch_loss,
        device=f"{model}, this machine, core {core} of {os.cpu_count()} busy alike, 1 thread",
        steps=steps,
    )
    return profile.to_dict()


def profile_alongside(model: str, batch_size: int, steps: int, workers: int) -> ComputeProfile:
    """The first copy's profile of ``workers`` copies profiled at once, pinned as the workers.

    The emulated cluster pins rank ``r`` to core ``r mod cores``: its P workers share the
    machine's memory and caches, and beyond one per core, the cores themselves.
    """
    available = sorted(os.sched_getaffinity(0))
    cores = [available[rank % len(available)] for rank in range(workers)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(cores)) as pool:
        profiles = pool.starmap(
            _profile_worker, [(core, model, batch_size, steps) for core in cores]
        )
    return ComputeProfile.from_dict(profiles[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="*", help=f"network.json files (default {RESULTS})")
    parser.add_argument(
        "--profile", action="append", default=[], metavar="MODEL=FILE", help="a saved profile"
    )
    parser.add_argument(
        "--batch-size", type=int, help="per worker (default: the one the results ran)"
    )
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="copies profiled at once, pinned as the measured workers ran (default 2)",
    )
    parser.add_argument("--out", default=os.path.join("runs", "sim_validation"))
    args = parser.parse_args(argv)
    paths = args.results or sorted(glob.glob(RESULTS))
    results = {path: json.loads(Path(path).read_text()) for path in paths}
    models = sorted({row["model"] for data in results.values() for row in data["summary"]})
    batches = {data["settings"].get("batch_size_per_worker", 32) for data in results.values()}
    if args.batch_size is None and len(batches) > 1:
        parser.error(f"the results ran batch sizes {sorted(batches)}: validate them separately")
    batch_size = args.batch_size or batches.pop()
    profiles = {}
    for entry in args.profile:
        model, _, file = entry.partition("=")
        profiles[model] = ComputeProfile.load(file)
    for model in models:
        if model in profiles or model not in MODELS:
            continue
        print(
            f"profiling {model} (batch {batch_size}, 1 thread, {args.workers} at once)...",
            flush=True,
        )
        profiles[model] = profile_alongside(model, batch_size, args.steps, args.workers)
    compared = []
    for path, data in results.items():
        summary, settings = data["summary"], data["settings"]
        try:
            compared += compare_rows(summary, profiles, settings, source=os.path.basename(path))
        except ValueError as error:
            parser.error(str(error))
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
