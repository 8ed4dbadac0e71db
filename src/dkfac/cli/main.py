"""``dkfac``: train, compare and benchmark distributed K-FAC from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from dkfac.bench.command import (
    add_bench_options,
    failed_launches,
    options_from_args,
    run_bench,
    write_json,
)
from dkfac.bench.report import format_summary, write_chart
from dkfac.cli.checkpoint import has_checkpoint
from dkfac.cli.config import (
    STRATEGIES,
    ConfigError,
    TrainConfig,
    load_config_file,
    parse_dataset_option,
)
from dkfac.cli.launch import (
    ExternalRank,
    WorkerError,
    backend_for,
    external_rank,
    join_external,
    lost_peer_message,
    spawn_local,
)
from dkfac.cli.launcher_signals import LauncherStopError, ignore_sigterm, sigterm_raises
from dkfac.cli.rank_logging import configure_logging, quiet
from dkfac.cli.report import compare_table, epoch_table, write_plots
from dkfac.cli.train import RunResult, check_fits, load_run_dataset, run_device, run_training
from dkfac.comm import destroy_process_groups
from dkfac.models.registry import build_model

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_WORKER = 1
EXIT_SIGTERM = 128 + 15  # what a shell reports for a process ended by SIGTERM
#: Defaults of ``dkfac bench`` without ``--quick``.
BENCH_MODELS = "resnet20"
BENCH_NPROCS = "2"
#: Bad input, whether the parent or a worker found it: one line on stderr and exit code 2.
USAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, FileNotFoundError, ValueError)
#: Bad input as a worker reports it. Not any ValueError: the parent has validated the
#: configuration and the data before starting workers, so a plain ValueError there is a bug
#: whose traceback the user needs (exit code 1).
WORKER_USAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, FileNotFoundError)


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE``, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line (no usage block) and exit with code 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaults left to the config (None = not given)."""
    helps = {
        "model": "mlp, cnn, resnet20, resnet32, resnet56, transformer",
        "dataset": "digits (bundled), synthetic, cifar10, npz, tokens",
        "data_root": "folder of cifar10 python batches, or the .npz file",
        "strategy": "none (plain optimizer), local, dkfac, kaisa, spd, pad, dp",
        "grad_sync": "ddp (DistributedDataParallel), dear (dkfac.DeAR: reduce-scatter under "
        "backward, all-gather under the next forward)",
        "bucket_mb": "MiB per gradient bucket of DDP/DeAR, or auto (DeAR's online search)",
        "steps_per_epoch": "cap on steps per epoch (0: the whole shard)",
        "nproc": "local worker processes to start (ignored under torchrun/Slurm)",
        "checkpoint_every": "also checkpoint every N steps (0: at epoch ends only)",
        "stop_after_steps": "checkpoint and stop after N steps, as a preempted job would "
        "(continue with --resume; 0: run to the end)",
        "target_accuracy": "test accuracy whose first crossing `compare` reports",
        "collective_timeout": "seconds a collective waits for a lost or stuck peer before the "
        "run fails",
        "max_restarts": "restart the local workers this many times when one is lost, resuming "
        "from the last checkpoint (train only; under torchrun use its --max-restarts)",
    }
    for f in fields(TrainConfig):
        if f.name == "dataset_options":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            type=kind if kind in (int, float) else str,
            help=f"{helps.get(f.name, '')} (default: {f.default!r})",
        )
    parser.add_argument(
        "--dataset-option",
        dest="dataset_options",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="an option of --dataset, repeatable; synthetic: shape=3,32,32 num_classes=10 "
        "train_size=1024 test_size=256; tokens: vocab_size, seq_len, num_classes, "
        "train_size, test_size, key_position; digits and npz: test_fraction; npz: num_classes",
    )
    parser.add_argument("--config", help="TOML or YAML file of options (CLI flags override it)")


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The options the user gave: ``--config`` file values, overridden by flags."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    values.update(
        {
            f.name: getattr(args, f.name)
            for f in fields(TrainConfig)
            if f.name != "dataset_options" and getattr(args, f.name, None) is not None
        }
    )
    flags = getattr(args, "dataset_options", None)
    if flags:
        from_file = values.get("dataset_options", {})
        if not isinstance(from_file, dict):
            raise ConfigError(
                f"--config {args.config}: dataset_options must be a table of KEY = VALUE"
            )
        values["dataset_options"] = {**from_file, **dict(map(parse_dataset_option, flags))}
    return values


def _resolve(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """Defaults < ``--config`` file < flags (dataset options are merged key by key)."""
    return (base or TrainConfig()).with_overrides(_given(args))


#: What ``--resume`` may change in a saved run: how and where it runs, not what it computes.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "nproc",
    "threads",
    "data_root",
    "log_every",
    "checkpoint_every",
    "stop_after_steps",
    "collective_timeout",
    "max_restarts",
)


def _resumed_config(args: argparse.Namespace) -> tuple[TrainConfig, list[str]]:
    """The saved run's configuration (``OUT/config.toml``), with the options that may change.

    Returns:
        The configuration, and ``"NAME OLD -> NEW"`` for each option the flags changed.

    Raises:
        ConfigError: no saved configuration in ``--out``, or a flag that would change what
            the run computes (model, data, optimizer, K-FAC, schedule...).
    """
    given = _given(args)
    out = Path(str(given.pop("out", "") or os.path.join("runs", "train")))
    saved_file = out / "config.toml"
    if not saved_file.is_file():
        raise ConfigError(
            f"--resume: no saved run in {out} (no config.toml; start without --resume)"
        )
    saved = TrainConfig().with_overrides(load_config_file(str(saved_file)))
    asked = saved.with_overrides(given)  # the flags' values, in the fields' types
    differing = [name for name in given if getattr(asked, name) != getattr(saved, name)]
    refused = [name for name in differing if name not in RESUME_MAY_CHANGE]
    if refused:
        changes = ", ".join(
            f"--{name.replace('_', '-')} {getattr(asked, name)!r} (saved: {getattr(saved, name)!r})"
            for name in refused
        )
        may = ", ".join("--" + name.replace("_", "-") for name in RESUME_MAY_CHANGE)
        raise ConfigError(
            f"--resume continues the run saved in {out}, which these flags would change: "
            f"{changes}; only {may} may change when resuming (start a new run in another "
            "--out to change the others)"
        )
    # A stop requested for the interrupted run does not carry over to its continuation.
    overrides = {"out": str(out), "stop_after_steps": asked.stop_after_steps}
    if "stop_after_steps" not in given:
        overrides["stop_after_steps"] = 0
    overrides.update({name: getattr(asked, name) for name in differing})
    config = saved.with_overrides(overrides)
    changed = [
        f"{name} {getattr(saved, name)!r} -> {getattr(config, name)!r}"
        for name in differing
        if name != "stop_after_steps"
    ]
    return config, changed


def _prepare_out(folder: str) -> Path:
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path) as probe:
            probe.write(b"dkfac")
    except OSError as error:
        raise ConfigError(f"--out {folder}: cannot write there ({error.strerror})") from None
    return path


def _is_lead() -> bool:
    """Whether this process reports and writes files (rank 0, or the parent of spawned workers)."""
    outside = external_rank()
    return outside is None or outside.rank == 0


def _progress_factory() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # plain logging without the cli extra
        if sys.stderr.isatty():
            logger.info("no progress bars: tqdm is not installed (pip install tqdm)")
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


def _run_worker(
    configs: tuple[TrainConfig, ...],
    labels: tuple[str, ...],
    resume: bool,
    show_progress: bool,
) -> list[RunResult]:
    """Entry of every worker process (module level: spawned processes import it).

    The runs go one after the other in the same process group; each starts from its seed.
    """
    rank = dist.get_rank()
    configure_logging(rank)
    progress = _progress_factory() if show_progress and rank == 0 else None
    results = []
    for label, config in zip(labels, configs, strict=True):
        if label:
            logger.info(
                "== %s: %s on %s, %d worker(s)",
                label,
                config.model,
                config.dataset,
                dist.get_world_size(),
            )
        results.append(run_training(config, resume=resume, progress=progress))
    return results


def _check_before_start(configs: Sequence[TrainConfig], world: int) -> None:
    """Fail here, once, for missing data, a model that does not fit it, or too little data."""
    checked: set[tuple[Any, ...]] = set()
    with quiet():  # the workers say what they load
        for config in configs:
            key = (
                config.dataset,
                config.data_root,
                config.dataset_options,
                config.seed,
                config.model,
                config.batch_size,
            )
            if key in checked:
                continue
            spec = load_run_dataset(config)
            build_model(config.model, spec)
            check_fits(config, spec, world)
            checked.add(key)


def execute_runs(
    configs: Sequence[TrainConfig],
    labels: Sequence[str] | None = None,
    *,
    resume: bool = False,
    show_progress: bool = True,
) -> list[RunResult] | None:
    """Run ``configs`` one after the other on the same workers.

    Under torchrun/Slurm this process is one of the workers; otherwise ``nproc`` workers are
    spawned once for all the runs. The runs must share ``nproc``, ``threads`` and the device.

    Args:
        configs: the runs, validated.
        labels: a name per run, logged when it starts (None: no names).
        resume: continue each run from the checkpoint in its ``out`` folder.
        show_progress: progress bars on rank 0 (on a terminal).

    Returns:
        Rank 0's results, one per run; None on the other ranks of a torchrun/Slurm job.
    """
    first = configs[0]
    outside = external_rank()
    _check_before_start(configs, first.nproc if outside is None else outside.world_size)
    backend = backend_for(run_device(first))
    args = (tuple(configs), tuple(labels or [""] * len(configs)), resume, show_progress)
    if outside is not None:
        join_external(outside, first.threads, backend, first.collective_timeout)
        try:
            results = _run_worker(*args)
            dist.barrier()  # nobody tears the group down while a peer still talks to it
            return results if outside.rank == 0 else None
        finally:
            destroy_process_groups()
    return list(
        spawn_local(
            _run_worker,
            first.nproc,
            first.threads,
            args=args,
            backend=backend,
            collective_timeout=first.collective_timeout,
        )
    )


def execute(
    config: TrainConfig, *, resume: bool = False, show_progress: bool = True
) -> RunResult | None:
    """Run ``config`` on the right number of processes; rank 0's result (None elsewhere).

    With local workers and ``config.max_restarts``, a run whose worker was lost or crashed
    is started again on fresh workers, from the last checkpoint in ``config.out`` (or from
    the start when there is none yet); bad input is never retried.
    """
    restarts = 0
    while True:
        try:
            results = execute_runs([config], resume=resume, show_progress=show_progress)
            return None if results is None else results[0]
        except WorkerError as error:
            retry = restarts < config.max_restarts and not isinstance(
                error.cause, (*WORKER_USAGE_ERRORS, ImportError)
            )
            if not retry or external_rank() is not None:
                raise
            restarts += 1
            resume = bool(config.out) and has_checkpoint(Path(config.out))
            logger.warning(
                "%s; restarting the workers (restart %d of %d) %s",
                error,
                restarts,
                config.max_restarts,
                "from the last checkpoint" if resume else "from the start (no checkpoint yet)",
            )


def _print_plots(results: dict[str, RunResult], folder: Path) -> None:
    plots = write_plots(results, folder)
    for plot in plots:
        print(f"plot: {plot}")
    if not plots:
        print("plots: skipped (they need matplotlib: pip install matplotlib)")


def cmd_train(args: argparse.Namespace) -> int:
    """``dkfac train``."""
    if args.resume:
        config, changed = _resumed_config(args)
        if _is_lead():
            print(
                f"resuming {config.out} with its saved configuration"
                + (f"; changed: {', '.join(changed)}" if changed else "")
            )
    else:
        config = _resolve(args)
    if not config.out:
        config = dataclasses.replace(config, out=os.path.join("runs", "train"))
    out = _prepare_out(config.out)
    if args.resume and not has_checkpoint(out):
        raise ConfigError(f"--resume: no checkpoint in {out} (start without --resume)")
    # A worker restarted by torchrun (--max-restarts) runs the same command again: it
    # continues from the last checkpoint its run wrote.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    resume = args.resume or (restarted and has_checkpoint(out))
    if restarted and _is_lead():
        logger.warning(
            "restarted by torchrun (restart %s): %s",
            os.environ["TORCHELASTIC_RESTART_COUNT"],
            "resuming from the last checkpoint" if resume else "no checkpoint yet, from the start",
        )

    if _is_lead():
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


def run_label(optimizer: str, strategy: str) -> str:
    """``SGD`` for the plain optimizer, ``SGD+K-FAC (dkfac)`` with a K-FAC strategy."""
    name = "SGD" if optimizer == "sgd" else optimizer.upper()
    return name if strategy == "none" else f"{name}+K-FAC ({strategy})"


def cmd_compare(args: argparse.Namespace) -> int:
    """``dkfac compare``: the same data and seed with several strategies (one run each)."""
    if args.strategies is not None and args.strategy is not None:
        raise ConfigError(
            "--strategy is not allowed with --strategies: list every run in --strategies"
        )
    config = _resolve(args)
    if config.max_restarts:
        raise ConfigError(
            "--max-restarts is not allowed with compare: it restarts one run from its "
            "checkpoint (use dkfac train)"
        )
    strategies = compare_strategies(args.strategies, config)
    out = _prepare_out(config.out or os.path.join("runs", "compare"))
    labels = [run_label(config.optimizer, strategy) for strategy in strategies]
    configs = []
    for label, strategy in zip(labels, strategies, strict=True):
        folder = out / label.replace(" ", "_").replace("+", "_").replace("(", "").replace(")", "")
        # Validates the combination too (e.g. local on several workers).
        run_config = dataclasses.replace(config, strategy=strategy, out=str(folder))
        _prepare_out(str(folder))
        if _is_lead():
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


def build_parser() -> argparse.ArgumentParser:
    """The ``dkfac`` argument parser (its errors are one line and exit code 2)."""
    parser = CommandParser(prog="dkfac", description=__doc__)
    sub = parser.add_subparsers(dest="command")  # subcommands are CommandParsers too
    train = sub.add_parser("train", help="train one configuration")
    _add_train_options(train)
    train.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out"
    )
    compare = sub.add_parser(
        "compare",
        help="several strategies (default: the optimizer with and without K-FAC) on the same "
        "data and seed",
    )
    _add_train_options(compare)
    compare.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="comma-separated strategies, one run each, e.g. none,dkfac,dp (none: the plain "
        "optimizer; default: none and --strategy, or none,dkfac / none,local on one worker)",
    )
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


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def missing_dependency_message(error: ImportError) -> str:
    """What is missing and what to install for ``error``, as one line."""
    message = _one_line(error)
    if "pip install" in message:  # the library already says what to install
        return message
    module = (error.name or "").partition(".")[0]
    package = {"sklearn": "scikit-learn", "yaml": "pyyaml"}.get(module, module)
    extras = "pip install 'dkfac[cli]' installs all of the command's optional dependencies"
    if not package:
        return f"{message} ({extras})"
    return f"{message}: pip install {package} ({extras})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dkfac`` console script; returns the exit code.

    Without arguments it runs ``dkfac compare`` (what ``make demo`` does).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(arguments or ["compare"])
    except SystemExit as stop:  # --help, or the parser's one-line error
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    outside = external_rank()
    rank = 0 if outside is None else outside.rank
    configure_logging(rank)
    # Under torchrun every rank reports its own failure: say which one it is.
    error_prefix = "dkfac: error:" if rank == 0 else f"dkfac: [rank {rank}] error:"

    with sigterm_raises(outside is not None):
        return _run_reported(args, outside, error_prefix)


def _run_reported(args: argparse.Namespace, outside: ExternalRank | None, prefix: str) -> int:
    """Run the parsed command; failures, and a SIGTERM under a launcher, become one line."""

    def report(message: str) -> None:
        # One write per report: torchrun stops the survivors as soon as one worker fails, and a
        # line printed in pieces would be cut (or interleaved with another rank's) mid-way.
        if outside is not None:
            ignore_sigterm()
        sys.stderr.write(f"{prefix} {message}\n")
        sys.stderr.flush()

    commands = {"train": cmd_train, "compare": cmd_compare, "bench": cmd_bench}
    try:
        return _run_command(commands[args.command], args, report, outside is not None)
    except LauncherStopError as stop:  # also when it interrupts the handling of another error
        report(
            f"stopped by the launcher ({stop}): another worker failed (the launcher's report "
            "names it) or the job was cancelled"
        )
        return EXIT_SIGTERM


def _run_command(
    command: Callable[[argparse.Namespace], int],
    args: argparse.Namespace,
    report: Callable[[str], None],
    external: bool,
) -> int:
    """Run one command; every failure a user can act on becomes one reported line."""
    try:
        return command(args)
    except ImportError as error:
        report(missing_dependency_message(error))
        return EXIT_USAGE
    except USAGE_ERRORS as error:
        report(_one_line(error))
        return EXIT_USAGE
    except WorkerError as error:
        if isinstance(error.cause, ImportError):
            report(missing_dependency_message(error.cause))
            return EXIT_USAGE
        if isinstance(error.cause, WORKER_USAGE_ERRORS):  # bad input only a worker could see
            report(_one_line(error.cause))
            return EXIT_USAGE
        print(f"dkfac: {error}", file=sys.stderr)
        print(error.report(), file=sys.stderr)
        return EXIT_WORKER
    except KeyboardInterrupt:
        print("dkfac: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:  # under torchrun/Slurm: this rank's collective failed
        message = lost_peer_message(error) if external else None
        if message is None:
            raise
        report(message)
        return EXIT_WORKER


if __name__ == "__main__":
    raise SystemExit(main())
