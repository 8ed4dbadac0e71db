"""What a collective puts on the wire: packed payloads, fused buckets, bytes counted.

Pure rules shared by the :class:`~dkfac.comm.communicator.Communicator` and the dry run
(:mod:`dkfac.strategies.accounting`), so both count bytes identically: symmetric tensors travel
as their upper triangle, consecutive tensors fuse into buckets of at most a cap, a bucket
travels in the transport dtype or the promoted dtype of its tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from dkfac.comm.recorder import StepRecorder

#: Bytes one rank sends per payload byte in a bandwidth-optimal algorithm, times P/(P-1).
_WIRE_FACTOR: Mapping[str, int] = MappingProxyType(
    {"allreduce": 2, "reduce": 1, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}
)


def wire_bytes(op: str, nbytes: int, ranks: int) -> int:
    """Bytes each rank sends for a collective of ``nbytes`` payload over ``ranks`` ranks."""
    return _WIRE_FACTOR[op] * nbytes * (ranks - 1) // max(ranks, 1)


def packed_values(shape: Sequence[int], symmetric: bool) -> int:
    """Values a tensor of ``shape`` occupies on the wire: the upper triangle if symmetric."""
    if symmetric:
        d = shape[0]
        return d * (d + 1) // 2
    return math.prod(shape)


def packed_numel(tensor: Tensor, symmetric: bool) -> int:
    """Values a tensor occupies on the wire."""
    return packed_values(tensor.shape, symmetric)


def element_size(dtype: torch.dtype) -> int:
    """Bytes of one value of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FusedPayload:
    """One fused collective of a plan: tensors ``[start, end)``, its dtype and payload bytes."""

    start: int
    end: int
    dtype: torch.dtype
    nbytes: int


def plan_fusion(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    symmetric: Sequence[bool],
    cap_bytes: int,
    comm_dtype: torch.dtype | None = None,
) -> list[FusedPayload]:
    """How :meth:`Communicator.fusion_plan` fuses tensors, from their shapes and dtypes alone.

    In order, a bucket closes before the tensor that would take it past ``cap_bytes`` (a
    tensor larger than the cap travels alone). A bucket travels in ``comm_dtype`` or else in
    the promoted dtype of its tensors; symmetric tensors send their upper triangle only.
    Pure (no tensors, no process group): the dry run (:mod:`dkfac.strategies.accounting`)
    counts bytes with it exactly as the communicator does.
    """
    flags = list(symmetric)
    result: list[FusedPayload] = []

    def close(start: int, end: int) -> None:
        dtype = comm_dtype or functools.reduce(torch.promote_types, dtypes[start:end])
        values = sum(packed_values(shapes[i], flags[i]) for i in range(start, end))
        result.append(FusedPayload(start, end, dtype, values * element_size(dtype)))

    start, size = 0, 0
    for index, (shape, dtype, sym) in enumerate(zip(shapes, dtypes, flags, strict=True)):
        nbytes = packed_values(shape, sym) * element_size(comm_dtype or dtype)
        if index > start and size + nbytes > cap_bytes:
            close(start, index)
            start, size = index, 0
        size += nbytes
    if start < len(flags):
        close(start, len(flags))
    return result


def group_by_source(sources: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(source, indices)`` per distinct source, ascending: one fused broadcast each."""
    return [
        (source, [i for i, s in enumerate(sources) if s == source])
        for source in sorted(set(sources))
    ]


def record_collective(recorder: StepRecorder, phase: str, op: str, nbytes: int, ranks: int) -> None:
    """Count one collective of ``nbytes`` payload over ``ranks`` ranks (and its wire bytes)."""
    recorder.count(phase, op, nbytes, wire_bytes(op, nbytes, ranks))


@dataclass
class FusionBucket:
    """Tensors that travel together in one collective, flattened into ``flat``.

    Attributes:
        tensors: the tensors, in order; results are written back into them.
        symmetric: per tensor, whether only its upper triangle travels.
        flat: the packed buffer in the transport dtype.
    """

    tensors: list[Tensor]
    symmetric: list[bool]
    comm_dtype: torch.dtype
    flat: Tensor = field(init=False)

    def __post_init__(self) -> None:
        parts = []
        for tensor, sym in zip(self.tensors, self.symmetric, strict=True):
            if sym:
                rows, cols = _triangle(tensor)
                parts.append(tensor[rows, cols].to(self.comm_dtype))
            else:
                parts.append(tensor.reshape(-1).to(self.comm_dtype))
        self.flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    @property
    def nbytes(self) -> int:
        """Payload size of the collective."""
        return self.flat.numel() * self.flat.element_size()

    @property
    def rounds(self) -> bool:
        """Whether the transport dtype cannot hold some tensor exactly (float32 in bfloat16)."""
        return any(
            torch.promote_types(tensor.dtype, self.comm_dtype) != self.comm_dtype
            for tensor in self.tensors
        )

    def unpack(self, scale: float | None = None) -> None:
        """Write ``flat`` (times ``scale``) back into the tensors, both triangles if symmetric."""
        offset = 0
        for tensor, sym in zip(self.tensors, self.symmetric, strict=True):
            size = packed_numel(tensor, sym)
            values = self.flat[offset : offset + size].to(tensor.dtype)
            if scale is not None:
                values = values * scale
            if sym:
                rows, cols = _triangle(tensor)
                tensor[rows, cols] = values
                tensor[cols, rows] = values
            else:
                tensor.copy_(values.view_as(tensor))
            offset += size


def _triangle(tensor: Tensor) -> tuple[Tensor, Tensor]:
    d = tensor.shape[0]
    index = torch.triu_indices(d, d, device=tensor.device)
    return index[0], index[1]
