"""Ending a run: objects that hold process groups are freed before the groups are destroyed."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dkfac
from dkfac.comm import destroy_process_groups


def _train_and_leave_cycles() -> tuple[weakref.ref[nn.Module], weakref.ref[object]]:
    """A DDP model and a preconditioner used for one step, then abandoned in a reference cycle.

    The cycle is made explicit: which cycles DDP and the preconditioner form by themselves
    depends on torch's internals, and the test needs objects that only a collection frees.
    """
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    pre = dkfac.KFACPreconditioner(model, strategy="dkfac", lr=0.1)
    model(torch.randn(6, 4)).square().sum().backward()
    pre.step()
    pre.remove()
    cycle: list[object] = [model, pre]
    cycle.append(cycle)
    return weakref.ref(model), weakref.ref(pre)


def test_destroying_the_groups_first_frees_the_ddp_and_preconditioner_cycles(
    tmp_path: Path,
) -> None:
    # Left to interpreter shutdown, these objects free their gloo groups and pending work while
    # Python finalizes, and the process can abort (SIGABRT) after a successful run.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        model, pre = _train_and_leave_cycles()
        assert model() is not None and pre() is not None  # only a collection frees them
        destroy_process_groups()
        assert model() is None and pre() is None
        assert not dist.is_initialized()
        destroy_process_groups()  # nothing left: a no-op
    finally:
        if was_enabled:
            gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
