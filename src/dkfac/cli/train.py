"""One rank of a ``dkfac train`` run: the epoch loop, its steps, evaluation and metrics.

The same function runs in every worker, whether the workers were spawned by ``dkfac train
--nproc N`` or by ``torchrun``/Slurm; only rank 0 prints and writes files. What a rank trains
with is built by :mod:`dkfac.cli.training_setup`; what its checkpoints hold is
:mod:`dkfac.cli.run_checkpoint`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from dkfac.cli.config import TrainConfig
from dkfac.cli.device import Precision
from dkfac.cli.lr_schedule import step_progress
from dkfac.cli.objective import label_cross_entropy
from dkfac.cli.run_checkpoint import EpochPosition, restore_checkpoint, save_run_checkpoint
from dkfac.cli.run_metrics import MetricsLog, PhaseTotals, RunResult
from dkfac.cli.tensorboard_log import TensorBoardLog
from dkfac.cli.training_setup import TrainingSetup, build_training_setup

logger = logging.getLogger(__name__)


class _StepOutcome(NamedTuple):
    """What one training step measured on this rank.

    Attributes:
        loss: the batch's mean loss.
        correct: examples of the batch classified correctly.
        examples: examples in the batch.
        seconds: wall time of the step.
    """

    loss: float
    correct: float
    examples: int
    seconds: float


def _world() -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _evaluate(
    model: nn.Module, data: Dataset[Any], batch_size: int, precision: Precision
) -> tuple[float, float]:
    """(mean loss, accuracy) over this rank's shard of ``data``, aggregated over ranks.

    The forward pass runs in the training's precision; the sums are float64 on the host.
    """
    device = precision.device
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
            y = y.to(device)
            with precision.autocast():
                logits = model(x.to(device))
            totals[0] += float(label_cross_entropy(logits.float(), y, reduction="sum"))
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
    run = _RankRun(build_training_setup(config, rank, world, resume=resume), on_epoch, progress)
    # Where the first epoch starts: examples of its order already consumed by all ranks, and
    # how many it uses in all (its budget, fixed when the epoch began, whatever the world).
    try:  # the TensorBoard events written so far are closed whatever happens
        start_epoch, start_position, start_budget = run.resume() if resume else (0, 0, 0)
        run.setup.wrapped.train()
        for epoch in range(start_epoch, config.epochs):
            resuming = epoch == start_epoch and start_position > 0
            full_budget = run.setup.steps_per_epoch * run.setup.global_batch
            run.train_epoch(
                epoch,
                position=start_position if resuming else 0,
                budget=start_budget if resuming else full_budget,
                resuming=resuming,
            )
            if run.result.stopped:
                break
            run.end_epoch(epoch)
        return run.finish()
    finally:
        run.metrics.close()


def _auto_choice(setup: TrainingSetup) -> dict[str, Any] | None:
    """What ``--strategy auto`` chose at construction and why (None: it did not choose)."""
    chosen = setup.pre.plan().get("chosen") if setup.pre is not None else None
    return None if chosen is None else {k: chosen[k] for k in ("strategy", "label", "reason")}


class _RankRun:
    """One rank's run in progress: what it trains with, where it stands, what it records.

    Args:
        setup: what this rank trains with.
        on_epoch: called with each epoch's summary (None: nothing is called).
        progress: a factory ``(total, description) -> bar`` for rank 0's progress bar.
    """

    def __init__(
        self,
        setup: TrainingSetup,
        on_epoch: Callable[[dict[str, Any]], None] | None,
        progress: Any | None,
    ) -> None:
        self.setup = setup
        self.config = setup.config
        self.out = Path(self.config.out) if self.config.out else None
        self.on_epoch = on_epoch
        self.progress = progress
        self.result = RunResult()
        self.step = 0
        # This rank's (loss sum, correct, examples) and K-FAC phase totals of the current
        # epoch; part of checkpoints.
        self.totals = torch.zeros(3, dtype=torch.float64)
        self.phases = PhaseTotals()
        first = setup.rank == 0
        board = self.config.tensorboard if first else ""
        self.metrics = MetricsLog(
            self.out if first else None, TensorBoardLog(board) if board else None
        )
        chosen = _auto_choice(setup)
        if chosen is not None and first:  # --strategy auto: say what and why
            logger.info("%s", chosen["reason"])
            if setup.checkpoint is None:  # a resumed run says it where it resumes
                self.metrics.write({"event": "strategy", "step": 0, **chosen})

    def resume(self) -> tuple[int, int, int]:
        """Continue from the checkpoint in ``out`` when there is one.

        Returns:
            Where the first epoch starts: ``(epoch, examples of its order consumed by all
            ranks, its budget)``; ``(0, 0, 0)`` without a checkpoint.
        """
        if self.out is None:
            return 0, 0, 0
        saved, self.setup.checkpoint = self.setup.checkpoint, None  # read once, in the setup
        if saved is None:
            return 0, 0, 0
        setup = self.setup
        where, self.totals, self.phases = restore_checkpoint(
            saved,
            setup.model,
            setup.optimizer,
            setup.scheduler,
            setup.pre,
            setup.rank,
            setup.world,
            setup.precision.scaler,
        )
        start_epoch, start_position, start_budget, self.step = where
        self.result.epochs = list(saved["epochs"])
        self.result.seconds = float(saved["seconds"])
        if setup.rank == 0:
            self.metrics.resumed_at(self.step)
            logger.info("resumed from step %d (epoch %d)", self.step, start_epoch + 1)
            kept, chosen = setup.resumed_choice, _auto_choice(setup)
            if kept is not None:  # --strategy auto: the checkpoint's choice, not a new one
                reason = f"resumed with what strategy=auto chose before: {kept['label']}"
                logger.info("%s", reason)
                chosen = {**kept, "reason": reason}
            if chosen is not None:  # kept, or chosen again on another number of ranks
                record = {"event": "strategy", "step": self.step, **chosen}
                self.metrics.write({**record, "resumed": True})
        return start_epoch, start_position, start_budget

    def train_epoch(self, epoch: int, *, position: int, budget: int, resuming: bool) -> None:
        """Train epoch ``epoch`` until its budget is used or a requested stop.

        Args:
            epoch: the epoch, from 0.
            position: examples of the epoch's order already consumed by all ranks.
            budget: examples the epoch uses in all.
            resuming: the epoch continues from a checkpoint (its totals so far are kept).
        """
        setup, config = self.setup, self.config
        global_batch = setup.global_batch
        setup.sampler.set_epoch(epoch, position)
        steps = min(len(setup.loader), (budget - position) // global_batch)
        bar = (
            self.progress(setup.steps_per_epoch, f"epoch {epoch + 1}/{config.epochs}")
            if (self.progress is not None and setup.rank == 0)
            else None
        )
        if bar is not None and position:
            bar.update(min(setup.steps_per_epoch, position // global_batch))
        epoch_start = time.perf_counter()
        if not resuming:
            self.totals.zero_()
            self.phases = PhaseTotals()
        for batch_index, (x, y) in enumerate(setup.loader):
            if batch_index >= steps:
                break
            consumed = position + batch_index * global_batch
            setup.scheduler.set(*step_progress(epoch, consumed, global_batch, budget))
            outcome = self._train_step(x, y)
            self._record_step(epoch, outcome)
            if bar is not None:
                accuracy = float(self.totals[1] / self.totals[2])
                bar.set_postfix(loss=f"{outcome.loss:.3f}", acc=f"{accuracy:.3f}")
                bar.update(1)
            stopping = self.step == config.stop_after_steps
            periodic = bool(config.checkpoint_every) and self.step % config.checkpoint_every == 0
            if self.out is not None and (stopping or periodic):
                done = batch_index + 1
                self._save(
                    self.out,
                    epoch,
                    EpochPosition(position + done * global_batch, budget, done),
                    self.totals,
                    self.phases,
                )
            if stopping:
                self.result.stopped = True
                break
        if bar is not None:
            bar.close()
        self.result.seconds += time.perf_counter() - epoch_start

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> _StepOutcome:
        """One optimizer step on the batch ``(x, y)``, added to the epoch's totals."""
        setup, pre = self.setup, self.setup.pre
        tick = time.perf_counter()
        setup.optimizer.zero_grad(set_to_none=True)
        micro = self.config.grad_accumulation
        losses, corrects = [], []
        for index, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            xm = xm.to(setup.device, non_blocking=True)  # asynchronous from pinned batches
            ym = ym.to(setup.device, non_blocking=True)
            with setup.sync.no_sync(last=index == micro - 1):
                with setup.precision.autocast():
                    logits = setup.wrapped(xm)
                    loss = label_cross_entropy(logits, ym)
                # Equal micro-batches: the mean of their means is the step batch's mean.
                setup.precision.backward(loss / micro)
            losses.append(loss.detach())
            corrects.append((logits.argmax(-1) == ym).sum())
        if pre is not None:
            setup.sync.before_preconditioning()
            # Adaptive K-FAC re-evaluates the batch (one micro-batch: accumulation is refused).
            adaptive = pre.config.adaptive is not None
            pre.step(*((x.to(setup.device), y.to(setup.device)) if adaptive else ()))
        setup.sync.step()
        self.step += 1
        seconds = time.perf_counter() - tick
        loss_value = float(torch.stack(losses).mean())
        correct = float(torch.stack(corrects).sum())
        self.totals[0] += loss_value * y.numel()
        self.totals[1] += correct
        self.totals[2] += y.numel()
        if pre is not None:
            self.phases.add_step(pre)
        return _StepOutcome(loss_value, correct, y.numel(), seconds)

    def _record_step(self, epoch: int, outcome: _StepOutcome) -> None:
        """Rank 0 appends the step to ``metrics.jsonl`` every ``log_every`` steps."""
        pre = self.setup.pre
        if self.metrics.active and self.step % self.config.log_every == 0:
            record: dict[str, Any] = {
                "step": self.step,
                "epoch": epoch + 1,
                "loss": outcome.loss,
                "accuracy": outcome.correct / outcome.examples,
                "lr": self.setup.scheduler.get_last_lr()[0],
                "seconds": outcome.seconds,
            }
            if pre is not None:
                record["kfac_seconds"] = pre.timings()
                record["comm_bytes"] = sum(v["bytes"] for v in pre.comm_stats().values())
            self.metrics.write(record)

    def end_epoch(self, epoch: int) -> None:
        """Evaluate and report epoch ``epoch``, then checkpoint the run at its end."""
        setup, config = self.setup, self.config
        summary = self._epoch_summary(epoch)
        self.result.epochs.append(summary)
        if self.metrics.active:
            kfac = self.phases.record() if setup.pre is not None else {}
            record = {"event": "epoch", **summary, **kfac, "device": str(setup.device)}
            self.metrics.write(record)
        if setup.rank == 0:
            logger.info(
                "epoch %d/%d: train loss %.4f, test loss %.4f, test accuracy %.4f (%.1f s)",
                epoch + 1,
                config.epochs,
                summary["train_loss"],
                summary["test_loss"],
                summary["test_accuracy"],
                self.result.seconds,
            )
        if self.on_epoch is not None:
            self.on_epoch(summary)
        if self.out is not None:
            self._save(
                self.out,
                epoch + 1,
                EpochPosition(0, 0, 0),
                torch.zeros(3, dtype=torch.float64),
                PhaseTotals(),
            )

    def _epoch_summary(self, epoch: int) -> dict[str, Any]:
        """Epoch ``epoch``'s training totals over all ranks and its test evaluation."""
        setup = self.setup
        test_loss, test_accuracy = _evaluate(
            setup.wrapped, setup.spec.test, self.config.batch_size, setup.precision
        )
        epoch_totals = self.totals.clone()
        if setup.world > 1:
            dist.all_reduce(epoch_totals)
        return {
            "epoch": epoch + 1,
            "step": self.step,
            "train_loss": float(epoch_totals[0] / epoch_totals[2]),
            "train_accuracy": float(epoch_totals[1] / epoch_totals[2]),
            "train_examples": int(epoch_totals[2]),
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "seconds": self.result.seconds,
            "lr": setup.scheduler.get_last_lr()[0],
        }

    def _save(
        self,
        out: Path,
        epoch: int,
        position: EpochPosition,
        totals: torch.Tensor,
        phases: PhaseTotals,
    ) -> None:
        """Checkpoint the run at ``position`` of epoch ``epoch`` with these epoch totals."""
        setup = self.setup
        save_run_checkpoint(
            out,
            setup.model,
            setup.optimizer,
            setup.scheduler,
            setup.pre,
            epoch,
            position,
            self.step,
            self.result,
            setup.rank,
            setup.world,
            totals,
            phases,
            setup.precision.scaler,
            kept_choice=setup.resumed_choice,
        )

    def finish(self) -> RunResult:
        """Apply what is still pending, detach the preconditioner; the run's record."""
        self.result.steps = self.step
        self.metrics.close()
        self.setup.sync.close()
        if self.setup.pre is not None:
            self.setup.pre.remove()
        return self.result
