"""``dkfac bench``: the cost of the K-FAC strategies against DDP + SGD.

The strategies are ``dkfac``, ``kaisa``, ``spd`` (SPD-KFAC), ``pad`` (PAD-KFAC) and ``dp``
(DP-KFAC), and ``dear`` (SGD with DeAR's gradient averaging instead of DDP, no K-FAC); the
models the CIFAR ResNets ``resnet20`` and ``resnet32``, ``mlp6``, a 6-layer MLP with
1024-wide layers (the communication-bound case), and ``transformer``, a causal language model.

For every world size ``P`` in ``--nprocs`` this process starts its own workers with
``python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker``
(``OMP_NUM_THREADS=1``, a timeout per launch; :mod:`dkfac.bench.launch`), collects the JSON
report that rank 0 writes and combines the launches into one report. The options and their
validation are in :mod:`dkfac.bench.options`. What a worker measures is described in
:mod:`dkfac.bench.worker`; the table and the chart are in :mod:`dkfac.bench.report`. Only
with ``--targets FILE`` (:func:`dkfac.bench.targets.load_targets`; the repository's is
``benchmarks/targets.json``) does the report hold the reference and the verdicts of the two
targets (dkfac's overhead; spd and pad against dkfac, :mod:`dkfac.bench.verdicts`); without
it, the measurements only.
``benchmarks/strategies.py`` is a thin front end of this module.

``--layers resnet50`` launches nothing: it is a dry run that computes each strategy's bytes
per worker, decomposition work and memory of one second-order update from the model's layer
shapes (:mod:`dkfac.bench.dry_run`), at ``P = 64`` unless ``--nprocs`` says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dkfac.bench.configs import STRATEGIES, environment
from dkfac.bench.dry_run import dry_run_report
from dkfac.bench.emulated_cluster import ClusterUnavailableError, EmulatedCluster
from dkfac.bench.launch import Launch, launch
from dkfac.bench.options import BenchOptions
from dkfac.bench.report import summary_rows
from dkfac.bench.verdicts import evaluate_pipelined_target, evaluate_target
from dkfac.cli.config import ConfigError


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Launch every world size in turn; the combined report (JSON-ready).

    With ``options.layers`` nothing is launched: the report is the dry run's
    (:func:`dkfac.bench.dry_run.dry_run_report`, ``"benchmark": "dry_run"``). Without
    ``options.targets``, ``reference``, ``target`` and ``pipelined_target`` (a dry run's
    ``target``) are ``None``; ``targets_file`` records the file they were read from.

    Raises:
        ConfigError: this process is itself a rank of a torch.distributed launch.
    """
    targets = options.targets
    targets_file = None if targets is None else targets.source_file
    if options.layers is not None:
        return dry_run_report(
            options.layers,
            options.nprocs,
            [s for s in options.strategies if s in STRATEGIES],  # DeAR has no second order
            cost_model=options.cost_model,
            bucket_cap_mb=options.bucket_cap_mb,
            target=None if targets is None else targets.dry_run_target,
            targets_file=targets_file,
        )
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        raise ConfigError(
            "started inside a torch.distributed launch; run the benchmark directly, it "
            "launches its own workers"
        )
    launches: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="dkfac_bench_") as folder:
        for nprocs in options.nprocs:
            if options.network is None:
                launches.append(launch(nprocs, options, Path(folder)))
                continue
            cluster = EmulatedCluster(nprocs, options.network)
            try:
                cluster.create()
            except ClusterUnavailableError as error:  # no root, no netem for a delay, ...
                raise ConfigError(f"--network: {error}") from None
            try:
                launches.append(launch(nprocs, options, Path(folder), cluster))
            finally:
                cluster.destroy()
    rows = summary_rows([(item.nprocs, item.report) for item in launches], options.models)
    return {
        "benchmark": "strategies",
        "environment": environment(),
        "settings": options.settings(),
        "launches": [item.to_json() for item in launches],
        "summary": rows,
        "targets_file": targets_file,
        "reference": None if targets is None else dataclasses.asdict(targets.reference),
        "target": None if targets is None else evaluate_target(rows, targets.overhead_target),
        "pipelined_target": None
        if targets is None
        else evaluate_pipelined_target(rows, targets.pipelined_target),
    }


def failed_launches(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The launches of ``report`` that did not exit cleanly with a report."""
    return [item for item in report["launches"] if not item["ok"]]


def write_json(report: dict[str, Any], path: Path) -> Path:
    """Write ``report`` (indented JSON) to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
