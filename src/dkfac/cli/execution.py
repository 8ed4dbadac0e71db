"""Run training configurations on workers, restarting lost local workers.

Under torchrun/Slurm this process is one of the workers (:mod:`dkfac.cli.launch`); otherwise
the workers are spawned here (:mod:`dkfac.cli.local_workers`). Every worker runs the
configurations one after the other (:func:`dkfac.cli.train.run_training`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dkfac.cli.checkpoint import has_checkpoint
from dkfac.cli.config import TrainConfig
from dkfac.cli.device import backend_for, local_slot
from dkfac.cli.exit_codes import WORKER_USAGE_ERRORS
from dkfac.cli.launch import external_rank, join_external
from dkfac.cli.local_workers import WorkerError, spawn_local
from dkfac.cli.rank_logging import configure_logging, quiet
from dkfac.cli.run_metrics import RunResult
from dkfac.cli.train import run_training
from dkfac.cli.training_setup import check_fits, load_run_dataset, run_device
from dkfac.comm import destroy_process_groups
from dkfac.models.registry import build_model

logger = logging.getLogger(__name__)


def is_lead() -> bool:
    """Whether this process reports and writes files (rank 0, or the parent of spawned workers)."""
    outside = external_rank()
    return outside is None or outside.rank == 0


def _progress_factory() -> Any:
    """A factory ``(total, description) -> bar`` of tqdm bars, or None without tqdm."""
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
                config.grad_accumulation,
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
    world = first.nproc if outside is None else outside.world_size
    backend = backend_for(run_device(first, local_slot(default_world=world)))
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
