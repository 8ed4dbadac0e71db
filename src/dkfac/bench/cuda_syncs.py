"""Count the times code makes the host wait for a CUDA GPU (CUDA's own detector)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def cuda_syncs(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` with CUDA's synchronisation detector on; one message per wait it made.

    The detector (``torch.cuda.set_sync_debug_mode``) flags every operation that blocks the
    host until the GPU catches up: reads of values (``item``, ``tolist``), blocking copies,
    and the checks inside torch's operators (such as a decomposition's error flag).
    """
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
