"""One rank of a ``dkfac train`` run: data shard, model, optimizer, K-FAC, metrics, checkpoints.

The same function runs in every worker, whether the workers were spawned by ``dkfac train
--nproc N`` or by ``torchrun``/Slurm; only rank 0 prints and writes files.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import dkfac
from dkfac.cli.checkpoint import load_checkpoint, rng_state, save_atomic, set_rng_state
from dkfac.cli.config import ConfigError, TrainConfig
from dkfac.cli.sampling import EpochSampler
from dkfac.data.registry import DatasetSpec, load_dataset
from dkfac.models.registry import build_model
from dkfac.strategies import option_keywords

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


@dataclass
class PhaseTotals:
    """This rank's K-FAC phase seconds and communicated bytes, summed over an epoch."""

    seconds: dict[str, float] = field(default_factory=dict)
    comm_bytes: int = 0

    def add_step(self, pre: dkfac.KFACPreconditioner) -> None:
        """Add the last step of ``pre`` (its timings and communication)."""
        for phase, seconds in pre.timings().items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.comm_bytes += sum(stats["bytes"] for stats in pre.comm_stats().values())

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` fields (and the checkpointed state)."""
        return {"kfac_seconds": dict(self.seconds), "comm_bytes": self.comm_bytes}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> PhaseTotals:
        """Inverse of :meth:`record` (empty totals for ``None``)."""
        if not record:
            return cls()
        return cls(dict(record["kfac_seconds"]), int(record["comm_bytes"]))


@dataclass
class RunResult:
    """What a finished run reports (rank 0's view; evaluation aggregated over ranks)."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0
    stopped: bool = False

    @property
    def final_accuracy(self) -> float:
        """Test accuracy after the last epoch."""
        return float(self.epochs[-1]["test_accuracy"]) if self.epochs else math.nan


def run_device(config: TrainConfig) -> torch.device:
    """The device ``config`` trains on: the one place that decides it.

    Runs train on the CPU; the process group backend follows from this device
    (:func:`dkfac.cli.launch.backend_for`).
    """
    del config  # every configuration runs on the CPU for now
    return torch.device("cpu")


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
    if shard_steps(size, world, config.batch_size) == 0:
        raise ConfigError(
            f"--batch-size {config.batch_size} is not allowed: dataset {config.dataset!r} has "
            f"{size} training examples, too few for {world} worker(s) x batch "
            f"{config.batch_size} (at most --batch-size {size // world})"
        )


class GradientSync:
    """How a step's gradients are averaged over the ranks and the optimizer applied.

    ``--grad-sync ddp``: the model is wrapped in DDP (on several ranks) and ``optimizer.step()``
    updates. ``--grad-sync dear``: :class:`dkfac.DeAR` hooks the plain model; its step launches
    the all-gathers and the update lands in the next forward pass (or at once when K-FAC needs
    the averaged gradients first).

    Args:
        model: the model on this rank.
        optimizer: the optimizer over ``model``'s parameters.
        config: the run's configuration (``grad_sync``, ``bucket_mb``).
        world: number of ranks.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, world: int
    ) -> None:
        self.optimizer = optimizer
        self.dear: dkfac.DeAR | None = None
        self.model = model
        if config.grad_sync == "dear":
            self.dear = dkfac.DeAR(model, optimizer, bucket_cap_mb=config.bucket_cap_mb)
        elif world > 1:
            cap = config.bucket_cap_mb
            assert isinstance(cap, float)  # "auto" is refused for DDP by TrainConfig
            self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)

    def before_preconditioning(self) -> None:
        """Make ``.grad`` hold the averaged gradients (DDP: already so after backward)."""
        if self.dear is not None:
            self.dear.gather_gradients()

    def step(self) -> None:
        """The optimizer step of this iteration."""
        if self.dear is not None:
            self.dear.step()
        else:
            self.optimizer.step()

    def close(self) -> None:
        """Apply what is still pending and detach (DeAR); nothing to do for DDP."""
        if self.dear is not None:
            self.dear.remove()


class EpochPosition(NamedTuple):
    """Where a run stands in an epoch (:mod:`dkfac.cli.sampling`).

    Attributes:
        consumed: examples of the epoch's order consumed by all ranks together.
        budget: examples the epoch uses in all (``steps_per_epoch`` global batches, fixed
            when the epoch began, so a resume on another number of ranks finishes it exactly).
        batch: steps taken in the epoch (informational).
    """

    consumed: int
    budget: int
    batch: int


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _lr_factor(config: TrainConfig, steps_per_epoch: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate at optimizer step ``step``."""
    total = config.epochs * steps_per_epoch
    warmup = config.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.schedule == "cosine":
            progress = (step - warmup) / max(1.0, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        if config.schedule == "step":  # x0.1 at 50% and 75% of training
            return 0.1 ** sum(step >= total * point for point in (0.5, 0.75))
        return 1.0

    return factor


def _evaluate(
    model: nn.Module, data: Dataset[Any], batch_size: int, device: torch.device
) -> tuple[float, float]:
    """(mean loss, accuracy) over this rank's shard of ``data``, aggregated over ranks."""
    rank, world = _world()
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=False
    )
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    totals = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            logits = model(x.to(device))
            y = y.to(device)
            totals[0] += float(F.cross_entropy(logits, y, reduction="sum"))
            totals[1] += float((logits.argmax(-1) == y).sum())
            totals[2] += y.numel()
    model.train(was_training)
    if world > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def run_training(
    config: TrainConfig,
    *,
    resume: bool = False,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    progress: Any | None = None,
) -> RunResult:
    """Train on this rank; returns rank 0's record (other ranks return theirs, unused).

    Args:
        config: the validated configuration.
        resume: continue from ``config.out/checkpoint.pt`` when it exists.
        on_epoch: called on every rank with each epoch's summary.
        progress: a factory ``(total, description) -> bar`` for rank 0's progress bar.
    """
    rank, world = _world()
    torch.manual_seed(config.seed)
    device = run_device(config)
    spec = load_run_dataset(config)
    check_fits(config, spec, world)
    model: nn.Module = build_model(config.model, spec).to(device)

    sampler = EpochSampler(len(spec.train), world, rank, config.seed)  # type: ignore[arg-type]
    # A private generator: creating the loader's iterator then never consumes the global RNG,
    # whose state a checkpoint restores.
    loader = DataLoader(
        spec.train,
        batch_size=config.batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    steps_per_epoch = len(loader)
    if config.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)
    global_batch = config.batch_size * world

    if config.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(),
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )
    else:
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
    sync = GradientSync(model, optimizer, config, world)
    wrapped = sync.model
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config, steps_per_epoch))
    pre = None
    if config.uses_kfac:
        pre = dkfac.KFACPreconditioner(
            wrapped,
            strategy=config.strategy,
            inverse_method=config.inverse_method,
            damping=config.damping,
            factor_decay=config.factor_decay,
            kl_clip=config.kl_clip or None,
            lr=lambda _: float(scheduler.get_last_lr()[0]),
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            **option_keywords(config.strategy, grad_worker_fraction=config.grad_worker_fraction),
        )

    out = Path(config.out) if config.out else None
    result = RunResult()
    # Where the first epoch starts: examples of its order already consumed by all ranks, and
    # how many it uses in all (its budget, fixed when the epoch began, whatever the world).
    start_epoch, start_position, start_budget, step = 0, 0, 0, 0
    # This rank's (loss sum, correct, examples) and K-FAC phase totals of the current epoch;
    # part of checkpoints.
    totals = torch.zeros(3, dtype=torch.float64)
    phases = PhaseTotals()
    if resume and out is not None:
        saved = load_checkpoint(out)
        if saved is not None:
            where, totals, phases = restore_checkpoint(
                saved, model, optimizer, scheduler, pre, rank, world
            )
            start_epoch, start_position, start_budget, step = where
            result.epochs = list(saved["epochs"])
            result.seconds = float(saved["seconds"])
            if rank == 0:
                _truncate_metrics(out / METRICS_NAME, step)
                logger.info("resumed from step %d (epoch %d)", step, start_epoch + 1)

    wrapped.train()
    for epoch in range(start_epoch, config.epochs):
        resuming = epoch == start_epoch and start_position > 0
        position = start_position if resuming else 0
        budget = start_budget if resuming else steps_per_epoch * global_batch
        sampler.set_epoch(epoch, position)
        steps = min(len(loader), (budget - position) // global_batch)
        bar = (
            progress(steps_per_epoch, f"epoch {epoch + 1}/{config.epochs}")
            if (progress is not None and rank == 0)
            else None
        )
        if bar is not None and position:
            bar.update(min(steps_per_epoch, position // global_batch))
        epoch_start = time.perf_counter()
        if not resuming:
            totals.zero_()
            phases = PhaseTotals()
        for batch_index, (x, y) in enumerate(loader):
            if batch_index >= steps:
                break
            tick = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            logits = wrapped(x.to(device))
            loss = F.cross_entropy(logits, y.to(device))
            torch.autograd.backward(loss)
            if pre is not None:
                sync.before_preconditioning()
                pre.step()
            sync.step()
            scheduler.step()
            step += 1
            seconds = time.perf_counter() - tick
            loss_value = float(loss.detach())
            correct = float((logits.argmax(-1) == y.to(device)).sum())
            totals[0] += loss_value * y.numel()
            totals[1] += correct
            totals[2] += y.numel()
            if pre is not None:
                phases.add_step(pre)
            if rank == 0 and out is not None and (step % config.log_every == 0):
                record: dict[str, Any] = {
                    "step": step,
                    "epoch": epoch + 1,
                    "loss": loss_value,
                    "accuracy": correct / y.numel(),
                    "lr": scheduler.get_last_lr()[0],
                    "seconds": seconds,
                }
                if pre is not None:
                    record["kfac_seconds"] = pre.timings()
                    record["comm_bytes"] = sum(v["bytes"] for v in pre.comm_stats().values())
                _append_metrics(out / METRICS_NAME, record)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{float(totals[1] / totals[2]):.3f}")
                bar.update(1)
            stopping = step == config.stop_after_steps
            periodic = bool(config.checkpoint_every) and step % config.checkpoint_every == 0
            if out is not None and (stopping or periodic):
                _checkpoint(
                    out,
                    model,
                    optimizer,
                    scheduler,
                    pre,
                    epoch,
                    EpochPosition(
                        position + (batch_index + 1) * global_batch, budget, batch_index + 1
                    ),
                    step,
                    result,
                    rank,
                    world,
                    totals,
                    phases,
                )
            if stopping:
                result.stopped = True
                break
        if bar is not None:
            bar.close()
        result.seconds += time.perf_counter() - epoch_start
        if result.stopped:
            break
        test_loss, test_accuracy = _evaluate(wrapped, spec.test, config.batch_size, device)
        epoch_totals = totals.clone()
        if world > 1:
            dist.all_reduce(epoch_totals)
        summary = {
            "epoch": epoch + 1,
            "step": step,
            "train_loss": float(epoch_totals[0] / epoch_totals[2]),
            "train_accuracy": float(epoch_totals[1] / epoch_totals[2]),
            "train_examples": int(epoch_totals[2]),
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "seconds": result.seconds,
            "lr": scheduler.get_last_lr()[0],
        }
        result.epochs.append(summary)
        if rank == 0 and out is not None:
            kfac = phases.record() if pre is not None else {}
            _append_metrics(out / METRICS_NAME, {"event": "epoch", **summary, **kfac})
        if rank == 0:
            logger.info(
                "epoch %d/%d: train loss %.4f, test loss %.4f, test accuracy %.4f (%.1f s)",
                epoch + 1,
                config.epochs,
                summary["train_loss"],
                test_loss,
                test_accuracy,
                result.seconds,
            )
        if on_epoch is not None:
            on_epoch(summary)
        if out is not None:
            _checkpoint(
                out,
                model,
                optimizer,
                scheduler,
                pre,
                epoch + 1,
                EpochPosition(0, 0, 0),
                step,
                result,
                rank,
                world,
                torch.zeros(3, dtype=torch.float64),
                PhaseTotals(),
            )
    result.steps = step
    sync.close()
    if pre is not None:
        pre.remove()
    return result


def _append_metrics(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as stream:
        stream.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics written after the checkpoint (a crashed run's tail)."""
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def _checkpoint(
    out: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    pre: dkfac.KFACPreconditioner | None,
    epoch: int,
    position: EpochPosition,
    step: int,
    result: RunResult,
    rank: int,
    world: int,
    totals: torch.Tensor,
    phases: PhaseTotals,
) -> None:
    """Rank 0 writes the checkpoint; every rank contributes its preconditioner and RNG state.

    ``position`` is where the run stands in epoch ``epoch``.
    """
    local = {
        "rng": rng_state(),
        "pre": pre.state_dict() if pre is not None else None,
        "totals": totals.clone(),
        "phases": phases.record(),
    }
    gathered: list[Any] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    if rank == 0:
        save_atomic(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "ranks": gathered,
                "epoch": epoch,
                "batch": position.batch,
                "position": position.consumed,
                "budget": position.budget,
                "step": step,
                "world_size": world,
                "epochs": list(result.epochs),
                "seconds": result.seconds,
            },
            out,
        )
    if world > 1:
        dist.barrier()


def restore_checkpoint(
    saved: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    pre: dkfac.KFACPreconditioner | None,
    rank: int,
    world: int,
) -> tuple[tuple[int, int, int, int], torch.Tensor, PhaseTotals]:
    """Load a checkpoint.

    Returns:
        Where to continue, ``(epoch, examples of the epoch consumed, the epoch's budget,
        step)``; this rank's epoch totals; this rank's K-FAC phase totals of the epoch.
    """
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    ranks = saved["ranks"]
    same_world = saved["world_size"] == world
    mine = ranks[rank] if same_world else ranks[0]
    if pre is not None and mine["pre"] is not None:
        state = mine["pre"]
        if not same_world:
            # Factors may live on their owners only (pad) and decompositions on the owners of
            # the old layout: gather every factor from whichever rank held it, recompute the
            # decompositions, and let the new layout keep what it needs.
            states = [r["pre"] for r in ranks]
            state = {
                **state,
                "layers": {
                    name: {
                        key: next(
                            (
                                s["layers"][name][key]
                                for s in states
                                if s["layers"][name][key] is not None
                            ),
                            None,
                        )
                        for key in ("A", "G")
                    }
                    for name in state["layers"]
                },
            }
        pre.load_state_dict(state)
    if same_world:
        set_rng_state(mine["rng"])
        totals = mine["totals"].clone()
    else:  # the old ranks' partial sums, counted once (on rank 0)
        totals = sum((r["totals"] for r in ranks), torch.zeros(3, dtype=torch.float64))
        totals = totals if rank == 0 else torch.zeros_like(totals)
    # Rank 0 reports the phase totals; on another world size it continues the old rank 0's.
    phases = PhaseTotals.from_record(mine.get("phases"))
    where = (
        int(saved["epoch"]),
        int(saved["position"]),
        int(saved["budget"]),
        int(saved["step"]),
    )
    return where, totals, phases
