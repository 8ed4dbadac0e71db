"""Host numbers onto the device without making the host wait for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def host_floats(values: Sequence[float], device: torch.device) -> Tensor:
    """``values`` as a float64 tensor on ``device``, copied asynchronously.

    ``torch.tensor(values, device=cuda)`` blocks until the GPU has run everything queued
    before it; a non-blocking copy from host memory is staged before the call returns (so the
    host list may go) and runs in stream order, so the host never waits.
    """
    host = torch.tensor(list(values), dtype=torch.float64)
    if device.type == "cpu":
        return host
    return torch.empty_like(host, device=device).copy_(host, non_blocking=True)
