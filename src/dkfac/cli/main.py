"""``dkfac``: train, compare and benchmark distributed K-FAC from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dkfac.cli.bench import (
    add_bench_options,
    failed_launches,
    options_from_args,
    run_bench,
    write_json,
)
from dkfac.cli.bench_report import format_summary, write_chart
from dkfac.cli.config import ConfigError, TrainConfig, load_config_file
from dkfac.cli.launch import WorkerError, external_rank, join_external, spawn_local
from dkfac.cli.report import compare_table, epoch_table, first_epoch_reaching, write_plots
from dkfac.cli.train import RunResult, run_training
from dkfac.datasets import load_dataset
from dkfac.models.registry import build_model

logger = logging.getLogger("dkfac")

EXIT_USAGE = 2
EXIT_WORKER = 1
#: Defaults of ``dkfac bench`` without ``--quick``.
BENCH_MODELS = "resnet20"
BENCH_NPROCS = "2"


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaults left to the config (None = not given)."""
    helps = {
        "model": "mlp, cnn, resnet20, resnet32, resnet56, transformer",
        "dataset": "digits (bundled), synthetic, cifar10, npz, tokens",
        "data_root": "folder of cifar10 python batches, or the .npz file",
        "strategy": "none (plain optimizer), local, dkfac, kaisa, spd, pad, dp",
        "steps_per_epoch": "cap on steps per epoch (0: the whole shard)",
        "nproc": "local worker processes to start (ignored under torchrun/Slurm)",
        "checkpoint_every": "also checkpoint every N steps (0: at epoch ends only)",
        "stop_after_steps": "checkpoint and stop after N steps, as a preempted job would "
        "(continue with --resume; 0: run to the end)",
        "target_accuracy": "test accuracy whose first crossing `compare` reports",
    }
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            type=kind if kind in (int, float) else str,
            help=f"{helps.get(f.name, '')} (default: {f.default!r})",
        )
    parser.add_argument("--config", help="TOML or YAML file of options (CLI flags override it)")


def _resolve(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    config = base or TrainConfig()
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    values.update(
        {
            f.name: getattr(args, f.name)
            for f in fields(TrainConfig)
            if getattr(args, f.name, None) is not None
        }
    )
    return config.with_overrides(values)


def _prepare_out(folder: str) -> Path:
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path) as probe:
            probe.write(b"dkfac")
    except OSError as error:
        raise ConfigError(f"--out {folder}: cannot write there ({error.strerror})") from None
    return path


def _progress_factory() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # plain logging without the cli extra
        return None

    def make(total: int, description: str) -> Any:
        # Bars only on a terminal: in a log file the per-epoch lines say enough.
        return tqdm(
            total=total,
            desc=description,
            leave=False,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
        )

    return make


def _train_worker(config: TrainConfig, resume: bool, show_progress: bool) -> RunResult:
    """Entry of every worker process (module level: spawned processes import it)."""
    logging.basicConfig(
        level=logging.INFO if dist.get_rank() == 0 else logging.WARNING, format="%(message)s"
    )
    return run_training(
        config, resume=resume, progress=_progress_factory() if show_progress else None
    )


def execute(
    config: TrainConfig, *, resume: bool = False, show_progress: bool = True
) -> RunResult | None:
    """Run ``config`` on the right number of processes; rank 0's result (None elsewhere)."""
    # Fail here, once, for a missing data set or a model that does not fit it.
    spec = load_dataset(config.dataset, root=config.data_root or None, seed=config.seed)
    build_model(config.model, spec)
    outside = external_rank()
    if outside is not None:
        join_external(outside, config.threads)
        try:
            result = _train_worker(config, resume, show_progress)
            dist.barrier()  # nobody tears the group down while a peer still talks to it
            return result if outside.rank == 0 else None
        finally:
            dist.destroy_process_group()
    result = spawn_local(
        _train_worker, config.nproc, config.threads, args=(config, resume, show_progress)
    )
    assert isinstance(result, RunResult)
    return result


def cmd_train(args: argparse.Namespace) -> int:
    """``dkfac train``."""
    config = _resolve(args)
    if not config.out:
        config = dataclasses.replace(config, out=os.path.join("runs", "train"))
    out = _prepare_out(config.out)
    if args.resume and not (out / "checkpoint.pt").is_file():
        raise ConfigError(f"--resume: no checkpoint in {out} (start without --resume)")
    (out / "config.toml").write_text(config.to_toml())
    result = execute(config, resume=args.resume)
    if result is None:
        return 0
    if result.stopped:
        print(
            f"stopped after step {result.steps} with a checkpoint in {out}; continue with "
            "the same command and --resume"
        )
    print(epoch_table(result))
    for plot in write_plots({"run": result}, out / "plots"):
        print(f"plot: {plot}")
    print(f"metrics: {out / 'metrics.jsonl'}; checkpoint: {out / 'checkpoint.pt'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """``dkfac compare``: the same data and seed with and without K-FAC."""
    config = _resolve(args)
    out = _prepare_out(config.out or os.path.join("runs", "compare"))
    kfac_strategy = (
        config.strategy if config.strategy != "none" else ("dkfac" if config.nproc > 1 else "local")
    )
    runs = {
        "SGD" if config.optimizer == "sgd" else config.optimizer.upper(): "none",
        f"{config.optimizer.upper()}+K-FAC ({kfac_strategy})": kfac_strategy,
    }
    target = config.target_accuracy or 0.95
    results: dict[str, RunResult] = {}
    for label, strategy in runs.items():
        folder = out / label.replace(" ", "_").replace("+", "_").replace("(", "").replace(")", "")
        run_config = dataclasses.replace(config, strategy=strategy, out=str(folder))
        _prepare_out(str(folder))
        (folder / "config.toml").write_text(run_config.to_toml())
        print(f"== {label}: {config.model} on {config.dataset}, {config.nproc} worker(s)")
        result = execute(run_config, resume=False)
        assert result is not None
        results[label] = result
    print(compare_table(results, target))
    for plot in write_plots(results, out / "plots"):
        print(f"plot: {plot}")
    best = {label: first_epoch_reaching(r, target) for label, r in results.items()}
    logger.debug("first epochs reaching target: %s", best)
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


def build_parser() -> argparse.ArgumentParser:
    """The ``dkfac`` argument parser."""
    parser = argparse.ArgumentParser(prog="dkfac", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train one configuration")
    _add_train_options(train)
    train.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out"
    )
    compare = sub.add_parser("compare", help="the optimizer with and without K-FAC, same seed")
    _add_train_options(compare)
    bench = sub.add_parser(
        "bench",
        help="time DDP + SGD against the K-FAC strategies on CIFAR ResNets and a wide MLP "
        "(torchrun, gloo)",
        description="Launch torchrun workers per world size, time SGD and every K-FAC "
        "configuration (model, P, strategy, schedule), print the table and write "
        "OUT/bench.json and the stacked bar chart OUT/bench.png.",
    )
    add_bench_options(bench, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
    bench.add_argument(
        "--out",
        default=os.path.join("runs", "bench"),
        help="folder of bench.json and bench.png (default: runs/bench)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dkfac`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["compare", *(argv or [])])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        commands = {"train": cmd_train, "compare": cmd_compare, "bench": cmd_bench}
        return commands[args.command](args)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        print(f"dkfac: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerError as error:
        print(f"dkfac: {error}", file=sys.stderr)
        if error.details:
            print(error.details, file=sys.stderr)
        return EXIT_WORKER
    except KeyboardInterrupt:
        print("dkfac: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
