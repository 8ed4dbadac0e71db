"""What one rank trains with: its device, data shard, model, optimizer, schedule and K-FAC.

:func:`build_training_setup` builds them in the same order on every rank (the model's
initialization follows ``config.seed``), so that every rank starts from the same weights.
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import dkfac
from dkfac.cli.checkpoint import load_checkpoint
from dkfac.cli.config import ConfigError, TrainConfig
from dkfac.cli.config_values import PRECONDITIONER_OPTIONS
from dkfac.cli.device import (
    DeviceError,
    LocalSlot,
    Precision,
    check_amp,
    check_plain_step_graphs,
    local_slot,
    resolve_device,
)
from dkfac.cli.gradient_sync import GradientSync
from dkfac.cli.lr_schedule import EpochLR, ProgressSchedule
from dkfac.cli.objective import label_cross_entropy
from dkfac.cli.run_checkpoint import built_choice
from dkfac.cli.sampling import EpochSampler
from dkfac.data.registry import DatasetSpec, load_dataset
from dkfac.models.registry import build_model
from dkfac.strategies import option_keywords

logger = logging.getLogger(__name__)


def run_device(config: TrainConfig, slot: LocalSlot | None = None) -> torch.device:
    """The device ``config`` trains on: the one place that decides it (``--device``).

    The process group backend follows from this device (:func:`dkfac.cli.device.backend_for`).

    Args:
        config: the run's configuration.
        slot: this worker's place on its machine (default: from the environment).

    Raises:
        ConfigError: ``--device cuda`` where the GPUs are missing or too few, or an ``--amp``
            or ``--plain-step-graphs`` the device does not run.
    """
    slot = local_slot(default_world=config.nproc) if slot is None else slot
    try:
        device = resolve_device(config.device, slot, torch.cuda.device_count())
        check_amp(config.amp, device)
        check_plain_step_graphs(config.plain_step_graphs, device)
    except DeviceError as error:
        raise ConfigError(str(error)) from None
    return device


def loader_options(config: TrainConfig, device: torch.device) -> dict[str, Any]:
    """The training loader's workers and memory: pinned pages and 2 workers on a GPU.

    Pinned batches let the copy to the GPU run asynchronously (``non_blocking``); loader
    workers are spawned, not forked, so they never inherit the parent's CUDA state. Only a
    process that may have children runs them: ``dkfac train``'s own workers are daemonic (they
    end with the command), so there ``-1`` means none; under torchrun or Slurm, 2 on a GPU.

    Raises:
        ConfigError: ``--loader-workers N > 0`` in ``dkfac train``'s own (daemonic) workers.
    """
    workers = config.loader_workers
    daemonic = multiprocessing.current_process().daemon
    if workers > 0 and daemonic:
        raise ConfigError(
            f"--loader-workers {workers} is not allowed with dkfac train's own workers: they "
            "end with the command and so cannot start processes; launch with torchrun or "
            "Slurm, or use --loader-workers 0"
        )
    if workers < 0:
        workers = 2 if device.type == "cuda" and not daemonic else 0
    options: dict[str, Any] = {"pin_memory": device.type == "cuda", "num_workers": workers}
    if workers:
        options.update(multiprocessing_context="spawn", persistent_workers=True)
    return options


def load_run_dataset(config: TrainConfig) -> DatasetSpec:
    """The dataset of ``config`` with its options (same data on every rank and in the parent)."""
    return load_dataset(
        config.dataset, root=config.data_root or None, seed=config.seed, **config.dataset_kwargs
    )


def shard_steps(train_size: int, world: int, batch_size: int) -> int:
    """Full batches per epoch on each rank (the sampler and the loader both drop the rest)."""
    return (train_size // world) // batch_size


def check_fits(config: TrainConfig, spec: DatasetSpec, world: int) -> None:
    """Refuse a batch size the training split cannot fill on ``world`` workers.

    Raises:
        ConfigError: not one full batch per worker and epoch.
    """
    size = len(spec.train)  # type: ignore[arg-type]
    if shard_steps(size, world, config.step_batch) == 0:
        times = (
            f" x {config.grad_accumulation} micro-batches" if config.grad_accumulation > 1 else ""
        )
        raise ConfigError(
            f"--batch-size {config.batch_size} is not allowed: dataset {config.dataset!r} has "
            f"{size} training examples, too few for {world} worker(s) x batch "
            f"{config.batch_size}{times} (at most --batch-size "
            f"{size // world // config.grad_accumulation})"
        )


@dataclass
class TrainingSetup:
    """Everything one rank of a run trains with, built by :func:`build_training_setup`.

    Attributes:
        config: the run's configuration.
        rank: this process's rank.
        world: number of ranks.
        device: the device the run trains on (:func:`run_device`).
        precision: autocast and, under ``--amp fp16``, the gradient scaler.
        spec: the run's dataset.
        model: the model on this rank (unwrapped: what the checkpoint saves).
        sampler: this rank's share of each epoch's order.
        loader: the training batches of this rank.
        steps_per_epoch: optimizer steps per epoch (the loader's length, capped by
            ``config.steps_per_epoch``).
        optimizer: the optimizer over ``model``'s parameters.
        sync: how the gradients are averaged over the ranks (its ``model`` is what trains).
        scheduler: the learning rate schedule of ``optimizer``.
        pre: the K-FAC preconditioner (None for the plain optimizer).
        resumed_choice: ``--strategy auto``'s choice that a resumed checkpoint kept
            (:func:`resumed_strategy_choice`), or None.
        checkpoint: the checkpoint a resumed run continues from, read once here (None: a new
            run, or none saved yet); the run's resume takes it and drops the reference.
    """

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    precision: Precision
    spec: DatasetSpec
    model: nn.Module
    sampler: EpochSampler
    loader: DataLoader[Any]
    steps_per_epoch: int
    optimizer: torch.optim.Optimizer
    sync: GradientSync
    scheduler: EpochLR
    pre: dkfac.KFACPreconditioner | None
    resumed_choice: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def wrapped(self) -> nn.Module:
        """The model the steps run: wrapped in DDP on several ranks, else :attr:`model`."""
        return self.sync.model

    @property
    def global_batch(self) -> int:
        """Examples one step consumes on all ranks together."""
        return self.config.step_batch * self.world


def build_training_setup(
    config: TrainConfig, rank: int, world: int, *, resume: bool = False
) -> TrainingSetup:
    """Seed, load the data, and build the model, optimizer, schedule and preconditioner.

    Args:
        config: the validated configuration.
        rank: this process's rank.
        world: number of ranks.
        resume: the run continues from the checkpoint in ``config.out`` (``--strategy auto``
            then keeps the choice saved there).

    Raises:
        ConfigError: the training split cannot fill one batch per rank (:func:`check_fits`).
    """
    torch.manual_seed(config.seed)
    device = run_device(config)
    if device.type == "cuda":  # NCCL and the caching allocator use the current device
        torch.cuda.set_device(device)
    precision = Precision(config.amp, device)
    spec = load_run_dataset(config)
    check_fits(config, spec, world)
    model: nn.Module = build_model(config.model, spec).to(device)

    sampler = EpochSampler(len(spec.train), world, rank, config.seed)  # type: ignore[arg-type]
    # A private generator: creating the loader's iterator then never consumes the global RNG,
    # whose state a checkpoint restores.
    loader = DataLoader(
        spec.train,
        batch_size=config.step_batch,  # one optimizer step's examples, split in _train_step
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(config.seed),
        **loader_options(config, device),
    )
    steps_per_epoch = len(loader)
    if config.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)

    optimizer = _build_optimizer(config, model)
    sync = GradientSync(model, optimizer, config, world, precision)
    scheduler = EpochLR(
        optimizer, ProgressSchedule(config.schedule, config.epochs, config.warmup_epochs)
    )
    pre = None
    saved = load_checkpoint(Path(config.out)) if resume and config.out else None
    resumed_choice = resumed_strategy_choice(config, saved, rank, world) if resume else None
    if resumed_choice is not None:  # keep what --strategy auto chose before the checkpoint
        pre = _build_preconditioner(
            config,
            resumed_choice["strategy"],
            sync.model,
            scheduler,
            precision,
            grad_worker_fraction=float(resumed_choice["grad_worker_fraction"]),
            bucket_cap_mb=float(resumed_choice["bucket_cap_mb"]),
        )
        # What was built (recorded and saved again), not merely what was read.
        resumed_choice = built_choice(pre, str(resumed_choice["label"]))
    elif config.uses_kfac:
        strategy: str | dkfac.AutoOptions = config.strategy
        if config.strategy == "auto":  # profiled on the first batch of the training split
            first = DataLoader(
                spec.train, batch_size=config.batch_size, generator=torch.Generator()
            )
            x, y = next(iter(first))  # its own generator: the global RNG is not drawn from
            example = (x.to(device), y.to(device))
            # --bucket-mb is the cap of what averages the gradients: DDP's, or DeAR's.
            cap = config.bucket_cap_mb
            caps: dict[str, Any] = (
                {"dear_bucket_cap_mb": cap}
                if config.grad_sync == "dear"
                else {"ddp_bucket_cap_mb": float(cap)}
            )
            strategy = dkfac.AutoOptions(
                example=example,
                loss_fn=label_cross_entropy,
                autocast=precision.autocast_dtype,  # profiled as it trains
                **caps,
            )
        pre = _build_preconditioner(config, strategy, sync.model, scheduler, precision)
    return TrainingSetup(
        config=config,
        rank=rank,
        world=world,
        device=device,
        precision=precision,
        spec=spec,
        model=model,
        sampler=sampler,
        loader=loader,
        steps_per_epoch=steps_per_epoch,
        optimizer=optimizer,
        sync=sync,
        scheduler=scheduler,
        pre=pre,
        resumed_choice=resumed_choice,
        checkpoint=saved,
    )


def resumed_strategy_choice(
    config: TrainConfig, saved: dict[str, Any] | None, rank: int, world: int
) -> dict[str, Any] | None:
    """What ``--strategy auto`` chose, saved in ``saved``, the checkpoint this run resumes.

    A resumed run on as many ranks keeps that strategy, KAISA fraction and bucket cap
    instead of choosing again: the machine's load when it resumes must not switch the
    strategy mid-run. On another number of ranks the choice (made for that world size)
    is made again. Rank 0's copy of the checkpoint decides and rank 0 tells the others, so
    every rank builds the same preconditioner even if their copies of ``--out`` differ.
    """
    if config.strategy != "auto" or not config.uses_kfac or not config.out:
        return None
    kept: list[dict[str, Any] | None] = [None]
    if rank == 0 and saved is not None and saved.get("strategy_choice") is not None:
        if saved["world_size"] == world:
            kept[0] = dict(saved["strategy_choice"])
        else:
            logger.info(
                "--strategy auto chooses again: the checkpoint's choice was made for %d "
                "workers, this run has %d",
                saved["world_size"],
                world,
            )
    if world > 1:
        dist.broadcast_object_list(kept, src=0)
    return kept[0]


def _build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW, over ``model``'s parameters (``config.optimizer``)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def _build_preconditioner(
    config: TrainConfig,
    strategy: str | dkfac.AutoOptions,
    wrapped: nn.Module,
    scheduler: EpochLR,
    precision: Precision,
    *,
    grad_worker_fraction: float | None = None,
    bucket_cap_mb: float | None = None,
) -> dkfac.KFACPreconditioner:
    """The K-FAC preconditioner of ``strategy`` over the model that trains.

    Args:
        config: the run's configuration (a K-FAC strategy).
        strategy: ``config.strategy``, the chooser ``--strategy auto`` means, or the strategy
            it chose before a resumed checkpoint.
        wrapped: the model the steps run (DDP-wrapped on several ranks).
        scheduler: the learning rate schedule; the preconditioner follows its current rate.
        precision: the run's precision (its fp16 scaler unscales the output gradients).
        grad_worker_fraction: KAISA's fraction (None: ``config``'s).
        bucket_cap_mb: the communicator's bucket cap (None: the preconditioner's default).
    """
    fraction = config.grad_worker_fraction if grad_worker_fraction is None else grad_worker_fraction
    name = strategy if isinstance(strategy, str) else config.strategy
    return dkfac.KFACPreconditioner(
        wrapped,
        strategy=strategy,
        **{name: getattr(config, name) for name in PRECONDITIONER_OPTIONS},
        kl_clip=config.kl_clip or None,
        lr=lambda _: float(scheduler.get_last_lr()[0]),
        adaptive=(
            dkfac.AdaptiveOptions(
                loss_fn=label_cross_entropy,
                model_fraction=config.adaptive_model_fraction,
                **config.adaptive_rule,
            )
            if config.adaptive
            else None
        ),
        grad_scaler=precision.scaler,
        accumulation_steps=config.grad_accumulation,
        bucket_cap_mb=bucket_cap_mb,
        **option_keywords(name, grad_worker_fraction=fraction),
    )
