"""Ending a distributed run without aborting at interpreter exit.

``torch.distributed.destroy_process_group()`` removes the groups from torch's registry, but a
group's C++ object lives on while anything still references it. DDP's reducer and a
:class:`~dkfac.KFACPreconditioner` (with its strategy and communicator) sit in reference cycles,
so after their training function returns they are freed only by the garbage collector, which
may not run before the interpreter shuts down. Freed then, a gloo worker thread that drops the
last reference to a Python-owned tensor must take the GIL while the interpreter finalizes;
CPython ends such a thread with ``pthread_exit`` and the C++ runtime aborts the process
("terminate called without an active exception", SIGABRT): a finished run reported as failed.
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def destroy_process_groups() -> None:
    """Free unreachable objects that hold process groups, then destroy every group.

    Call it where ``torch.distributed.destroy_process_group()`` would go, after the last
    collective (callers that need every peer to be done first put a barrier before it). A
    no-op when no process group exists.
    """
    gc.collect()  # DDP reducers and preconditioners in cycles release their groups and work now
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
