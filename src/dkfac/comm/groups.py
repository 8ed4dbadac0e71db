"""Process groups as dkfac makes them: the timeout they take, and the launch instructions.

A group made with ``torch.distributed.new_group`` gets torch's default timeout, not the one
the job was started with; dkfac's groups take the default group's, so a lost peer fails every
collective alike.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def default_group_timeout() -> timedelta | None:
    """The timeout the default process group was created with, or None if it cannot be read.

    ``torch.distributed.new_group`` gives a new group torch's default timeout (30 minutes for
    gloo) whatever ``init_process_group(timeout=...)`` said; the groups dkfac makes take the
    default group's instead, so a lost peer fails every group's collectives alike. torch has
    no public accessor: the backend's options are read defensively.
    """
    try:
        group = dist.distributed_c10d._get_default_group()
        for device_type in group._device_types:
            timeout = group._get_backend(device_type).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    except (AttributeError, RuntimeError, ValueError):
        return None  # a torch without these internals: the groups keep torch's default
    return None


def require_distributed(
    strategy: str,
    *,
    builder: str = "KFACPreconditioner",
    alternative: str = "use strategy='local' for a single process",
) -> None:
    """Raise a RuntimeError with launch instructions when no process group exists.

    Args:
        strategy: what needs the process group, as the message names it.
        builder: the object the user builds after ``init_process_group()``.
        alternative: what to do in a single process instead.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{strategy} needs torch.distributed: launch with "
            "`torchrun --nproc_per_node=N train.py` (or Slurm) and call "
            f"torch.distributed.init_process_group() before building {builder}; "
            f"{alternative}"
        )
