"""The ``dkfac`` subcommands: ``train``, ``compare`` and ``bench``, each returning its exit code."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
from pathlib import Path

from dkfac.bench.command import failed_launches, run_bench, write_json
from dkfac.bench.options import options_from_args
from dkfac.bench.report import format_summary, write_chart
from dkfac.cli.checkpoint import has_checkpoint
from dkfac.cli.config import STRATEGIES, ConfigError, TrainConfig
from dkfac.cli.config_resolution import (
    COMPARE_RECIPE,
    refuse_unread_strategy_options,
    resolve_config,
    resumed_config,
)
from dkfac.cli.execution import execute, execute_runs, is_lead
from dkfac.cli.exit_codes import EXIT_WORKER
from dkfac.cli.parser import BENCH_MODELS, BENCH_NPROCS
from dkfac.cli.report import compare_table, epoch_table, write_plots
from dkfac.cli.run_metrics import RunResult
from dkfac.cli.tensorboard_log import tensorboard_missing

logger = logging.getLogger(__name__)


def _prepare_out(folder: str) -> Path:
    """The output folder ``folder``, created, once it is known to be writable.

    Raises:
        ConfigError: the folder cannot be created or written to.
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path) as probe:
            probe.write(b"dkfac")
    except OSError as error:
        raise ConfigError(f"--out {folder}: cannot write there ({error.strerror})") from None
    return path


def _print_plots(results: dict[str, RunResult], folder: Path) -> None:
    """Write the plots of ``results`` into ``folder`` and print where (or why not)."""
    plots = write_plots(results, folder)
    for plot in plots:
        print(f"plot: {plot}")
    if not plots:
        print("plots: skipped (they need matplotlib: pip install matplotlib)")


def refuse_missing_tensorboard(config: TrainConfig) -> None:
    """``--tensorboard`` without the package: refused before anything runs (the lead writes)."""
    missing = tensorboard_missing() if config.tensorboard and is_lead() else None
    if missing is not None:
        raise ConfigError(missing)


def cmd_train(args: argparse.Namespace) -> int:
    """``dkfac train``."""
    if args.resume:
        config, changed = resumed_config(args)
        if is_lead():
            print(
                f"resuming {config.out} with its saved configuration"
                + (f"; changed: {', '.join(changed)}" if changed else "")
            )
    else:
        config = resolve_config(args)
        refuse_unread_strategy_options(args, config)
    refuse_missing_tensorboard(config)
    if not config.out:
        config = dataclasses.replace(config, out=os.path.join("runs", "train"))
    out = _prepare_out(config.out)
    if args.resume and not has_checkpoint(out):
        raise ConfigError(f"--resume: no checkpoint in {out} (start without --resume)")
    # A worker restarted by torchrun (--max-restarts) runs the same command again: it
    # continues from the last checkpoint its run wrote.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    resume = args.resume or (restarted and has_checkpoint(out))
    if restarted and is_lead():
        logger.warning(
            "restarted by torchrun (restart %s): %s",
            os.environ["TORCHELASTIC_RESTART_COUNT"],
            "resuming from the last checkpoint" if resume else "no checkpoint yet, from the start",
        )

    if is_lead():
        (out / "config.toml").write_text(config.to_toml())
    result = execute(config, resume=resume)
    if result is None:
        return 0
    if result.stopped:
        print(
            f"stopped after step {result.steps} with a checkpoint in {out}; continue with "
            "the same command and --resume"
        )
    print(epoch_table(result))
    _print_plots({"run": result}, out / "plots")
    print(f"metrics: {out / 'metrics.jsonl'}; checkpoint: {out / 'checkpoint.pt'}")
    return 0


def compare_strategies(text: str | None, config: TrainConfig) -> tuple[str, ...]:
    """The strategies ``dkfac compare`` runs, from ``--strategies`` (None: the default).

    The default is the plain optimizer and K-FAC with ``config.strategy`` (``dkfac`` on several
    workers, ``local`` on one, when the strategy is ``none``).

    Raises:
        ConfigError: an unknown or repeated strategy, or an empty list.
    """
    if text is None:
        kfac = config.strategy
        if kfac == "none":
            kfac = "dkfac" if config.nproc > 1 else "local"
        return ("none", kfac)
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise ConfigError(
            f"--strategies {text!r} is not allowed: expected a comma-separated list of "
            f"{', '.join(STRATEGIES)}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"--strategies {text!r} is not allowed: {', '.join(repeated)} given twice "
            "(the runs would be identical)"
        )
    return names


def run_label(optimizer: str, strategy: str, adaptive: bool = False) -> str:
    """``SGD`` for the plain optimizer, ``SGD+K-FAC (dkfac)`` with a K-FAC strategy.

    Adaptive K-FAC moves its layers itself (the optimizer only the others):
    ``SGD+adaptive K-FAC (dkfac)``.
    """
    name = "SGD" if optimizer == "sgd" else optimizer.upper()
    kfac = "adaptive K-FAC" if adaptive else "K-FAC"
    return name if strategy == "none" else f"{name}+{kfac} ({strategy})"


def without_adaptive(config: TrainConfig) -> TrainConfig:
    """``config`` with adaptive K-FAC's options at their defaults: compare's plain run."""
    defaults = TrainConfig()
    adaptive = [f.name for f in dataclasses.fields(config) if f.name.startswith("adaptive")]
    return dataclasses.replace(config, **{name: getattr(defaults, name) for name in adaptive})


def cmd_compare(args: argparse.Namespace) -> int:
    """``dkfac compare``: the same data and seed with several strategies (one run each)."""
    if args.strategies is not None and args.strategy is not None:
        raise ConfigError(
            "--strategy is not allowed with --strategies: list every run in --strategies"
        )
    config = resolve_config(args, default_recipe=COMPARE_RECIPE)
    refuse_missing_tensorboard(config)
    if config.max_restarts:
        raise ConfigError(
            "--max-restarts is not allowed with compare: it restarts one run from its "
            "checkpoint (use dkfac train)"
        )
    strategies = compare_strategies(args.strategies, config)
    out = _prepare_out(config.out or os.path.join("runs", "compare"))
    labels = [run_label(config.optimizer, strategy, config.adaptive) for strategy in strategies]
    configs = []
    for label, strategy in zip(labels, strategies, strict=True):
        folder = out / label.replace(" ", "_").replace("+", "_").replace("(", "").replace(")", "")
        # Validates the combination too (e.g. local on several workers).
        # Each run's TensorBoard scalars in a subfolder named like its run folder: the
        # runs then appear side by side in TensorBoard.
        board = os.path.join(config.tensorboard, folder.name) if config.tensorboard else ""
        run_config = dataclasses.replace(
            config if strategy != "none" else without_adaptive(config),
            strategy=strategy,
            out=str(folder),
            tensorboard=board,
        )
        _prepare_out(str(folder))
        if is_lead():
            (folder / "config.toml").write_text(run_config.to_toml())
        configs.append(run_config)
    results = execute_runs(configs, labels)
    if results is None:  # another rank of a torchrun/Slurm job: rank 0 reports
        return 0
    target = config.target_accuracy or 0.95
    by_label = dict(zip(labels, results, strict=True))
    print(compare_table(by_label, target))
    _print_plots(by_label, out / "plots")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``dkfac bench``: ms per iteration of DDP + SGD and the K-FAC strategies, by phase."""
    options = options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
    out = _prepare_out(args.out)
    report = run_bench(options)
    print(format_summary(report))
    json_path = write_json(report, out / "bench.json")
    settings = report["settings"]
    chart = write_chart(
        report["summary"],
        out / "bench.png",
        subtitle=f"batch {settings['batch_size_per_worker']} per worker, gloo, 1 thread/process, "
        f"rounds {settings['rounds']}, timed iterations {settings['iters']} "
        f"({settings['iters_long']} for periodic schedules)",
    )
    print(f"\nresults: {json_path}")
    print(f"chart: {chart}" if chart else "chart: skipped (needs matplotlib, the cli extra)")
    failed = failed_launches(report)
    return EXIT_WORKER if failed or not report["summary"] else 0
