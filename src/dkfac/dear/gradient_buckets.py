"""DeAR's gradient buckets: which parameters travel together, and the buffers they travel in.

Pure layout and storage (no ``torch.distributed``): the bucket plan is the same on every rank
because it depends only on the parameters' sizes, dtypes and devices, in forward order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dkfac.comm.fusion import plan_buckets_by_size
from dkfac.comm.handle import CollectiveHandle

#: Cap of the first bucket: its reduce-scatter is the last of a backward pass and its
#: all-gather the first thing the next forward waits for, so it is kept short (as DDP's).
FIRST_BUCKET_BYTES = 2**20


@dataclass
class GradientBucket:
    """Parameters whose gradients travel in one reduce-scatter and one all-gather.

    ``flat`` holds the gradients (pre-divided by the world size), then one "used" flag per
    parameter, then zero padding to a multiple of the world size; ``shard`` is this rank's
    slice of the reduced ``flat``. After the all-gather a flag is positive iff some rank
    produced that parameter's gradient.
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    flat: Tensor
    shard: Tensor
    ready: set[int] = field(default_factory=set)
    launched: bool = False
    reduce: CollectiveHandle | None = None
    gather: CollectiveHandle | None = None
    pending: bool = False
    reduce_started: float = 0.0
    gather_started: float = 0.0

    @property
    def flags(self) -> Tensor:
        """The per-parameter used flags inside ``flat``."""
        return self.flat[self.numel : self.numel + len(self.params)]

    def grad_view(self, position: int) -> Tensor:
        """Parameter ``position``'s averaged gradient as a view of ``flat``."""
        param = self.params[position]
        start = self.offsets[position]
        return self.flat[start : start + param.numel()].view_as(param)


def plan_gradient_buckets(params: Sequence[nn.Parameter], cap_mb: float) -> list[list[int]]:
    """Buckets of parameter positions in forward order, cut at dtype/device changes."""
    nbytes = [p.numel() * p.element_size() for p in params]
    kinds = [(p.dtype, p.device) for p in params]
    boundaries = [i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]]
    return plan_bucket_sizes(nbytes, cap_mb, boundaries)


def plan_bucket_sizes(
    nbytes: Sequence[int], cap_mb: float, boundaries: Sequence[int] = ()
) -> list[list[int]]:
    """DeAR's bucket rule on gradient sizes in forward order (the simulator plans with it).

    Greedy up to ``cap_mb`` MiB, the first bucket at most :data:`FIRST_BUCKET_BYTES`, a new
    bucket at each position in ``boundaries``.
    """
    return plan_buckets_by_size(
        nbytes, int(cap_mb * 2**20), boundaries, first_cap_bytes=FIRST_BUCKET_BYTES
    )


def build_gradient_buckets(
    params: Sequence[nn.Parameter], cap_mb: float, world_size: int
) -> list[GradientBucket]:
    """The buckets of :func:`plan_gradient_buckets`, with zeroed buffers for ``world_size``."""
    buckets = []
    for index, positions in enumerate(plan_gradient_buckets(params, cap_mb)):
        members = [params[i] for i in positions]
        offsets, numel = [], 0
        for param in members:
            offsets.append(numel)
            numel += param.numel()
        padded = -(-(numel + len(members)) // world_size) * world_size
        first = members[0]
        flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        shard = torch.empty(padded // world_size, dtype=first.dtype, device=first.device)
        buckets.append(GradientBucket(index, members, offsets, numel, flat, shard))
    return buckets


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that require grad, once each, in module (forward) registration order.

    Raises:
        ValueError: the model has none.
    """
    seen: set[int] = set()
    params = []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    if not params:
        raise ValueError(
            f"model={type(model).__name__} is not allowed: it has no parameter that requires grad"
        )
    return params
