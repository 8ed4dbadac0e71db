"""What a training run saves in its checkpoint and how it continues from one.

Rank 0 writes the checkpoint (:func:`dkfac.cli.checkpoint.save_atomic`); every rank adds its
preconditioner, RNG state and epoch totals, so that a run resumes exactly where it stopped,
on the same number of ranks or another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import dkfac
from dkfac.cli.checkpoint import rng_state, save_atomic, set_rng_state
from dkfac.cli.run_metrics import PhaseTotals, RunResult


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


def placement_layout(pre: dkfac.KFACPreconditioner) -> list[tuple[Any, ...]]:
    """Who holds what under ``pre``'s plan (its placement, not its predicted times).

    Per factor where it is reduced and who decomposes it, and PAD's share mode (which says
    who receives decompositions); a plan's predicted and measured times differ between runs.
    """
    plan = pre.plan()
    rows: list[tuple[Any, ...]] = [
        (row["layer"], row["factor"], row["reduced_to"], row["decomposed_by"])
        for row in plan["factors"]
    ]
    share = plan.get("share")
    return [*rows, ("share", None if share is None else share["mode"])]


#: What a checkpoint keeps of ``--strategy auto``'s choice (``pre.plan()["chosen"]``).
CHOICE_KEYS: tuple[str, ...] = ("strategy", "grad_worker_fraction", "bucket_cap_mb", "label")


def strategy_choice(pre: dkfac.KFACPreconditioner | None) -> dict[str, Any] | None:
    """The strategy, KAISA fraction and bucket cap a chooser picked for ``pre`` (or None)."""
    chosen = pre.plan().get("chosen") if pre is not None else None
    return None if chosen is None else {key: chosen[key] for key in CHOICE_KEYS}


def built_choice(pre: dkfac.KFACPreconditioner, label: str) -> dict[str, Any]:
    """What ``pre`` runs, in :data:`CHOICE_KEYS` (a resumed run's kept choice, as built)."""
    fraction = pre.config.grad_worker_fraction
    return {
        "strategy": pre.plan()["strategy"],
        "grad_worker_fraction": 1.0 if fraction is None else fraction,
        "bucket_cap_mb": pre.config.bucket_cap_mb,
        "label": label,
    }


def save_run_checkpoint(
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
    scaler: torch.amp.GradScaler | None = None,
    kept_choice: dict[str, Any] | None = None,
) -> None:
    """Rank 0 writes the checkpoint; every rank contributes its preconditioner and RNG state.

    ``position`` is where the run stands in epoch ``epoch``; ``scaler`` is the fp16 run's
    gradient scaler (its scale and growth tracker resume too); ``kept_choice`` is
    ``--strategy auto``'s choice a resumed run kept (saved again; else ``pre``'s chooser's).
    """
    local = {
        "rng": rng_state(),
        "pre": pre.state_dict() if pre is not None else None,
        # Who holds which factor and decomposition: a resume under another layout (PAD's
        # owners follow its share mode and the measured cost model) must gather the factors.
        "layout": placement_layout(pre) if pre is not None else None,
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
                "scaler": scaler.state_dict() if scaler is not None else None,
                "ranks": gathered,
                "epoch": epoch,
                "batch": position.batch,
                "position": position.consumed,
                "budget": position.budget,
                "step": step,
                "world_size": world,
                "epochs": list(result.epochs),
                "seconds": result.seconds,
                # --strategy auto: what it chose, kept by a resume (dkfac.cli.training_setup).
                "strategy_choice": kept_choice or strategy_choice(pre),
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
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[tuple[int, int, int, int], torch.Tensor, PhaseTotals]:
    """Load a checkpoint (``scaler``: the fp16 run's gradient scaler, restored when saved).

    Returns:
        Where to continue, ``(epoch, examples of the epoch consumed, the epoch's budget,
        step)``; this rank's epoch totals; this rank's K-FAC phase totals of the epoch.
    """
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    ranks = saved["ranks"]
    same_world = saved["world_size"] == world
    mine = ranks[rank] if same_world else ranks[0]
    if pre is not None and mine["pre"] is not None:
        state = mine["pre"]
        if not same_world or mine.get("layout") != placement_layout(pre):
            # Factors may live on their owners only (pad) and decompositions on the owners of
            # the old layout (another world size, or owners placed differently this time):
            # gather every factor from whichever rank held it, recompute the decompositions,
            # and let the new layout keep what it needs.
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
