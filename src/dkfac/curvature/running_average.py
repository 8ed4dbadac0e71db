"""Running averages of Kronecker factors, decided on the device.

A worker folds each batch factor into its running average ``ε·running + (1−ε)·batch``; a batch
with a NaN or Inf is left out and a running average that is not finite yet counts as "no
estimate", all without reading anything back from the device. Many factors fold in shared
operations, and equal-shaped ones, stacked, in one operation per shape
(:func:`running_averages`): a factor step on a GPU was bound by the host's launches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from dkfac.curvature.finite import all_finite, finite_flags

#: Bytes of one stack of equal-shaped factors folded together at most (each of the stacked
#: sums, averages and blends), when ``batched_factor_updates`` is on.
FOLD_STACK_BYTES = 256 * 2**20


def running_average(
    running: Tensor | None, batch: Tensor, decay: float, batch_ok: Tensor | None = None
) -> Tensor:
    """``ε·running + (1−ε)·batch``; the first estimate is the batch itself.

    A batch estimate with a NaN or Inf is not folded in (the running average keeps its value),
    and a running average that is not finite yet counts as "no estimate": this is decided on the
    device, with no host synchronisation. The average is ``lerp(running, batch, 1−ε)`` (one
    pass; :func:`running_averages` folds many factors the same way, bit for bit).
    ``batch_ok``: :func:`all_finite` of ``batch`` when the caller has it already.
    """
    batch_ok = all_finite(batch) if batch_ok is None else batch_ok
    if running is None:
        return torch.where(batch_ok, batch, torch.full_like(batch, float("nan")))
    wide = torch.promote_types(running.dtype, batch.dtype)  # as ε·running + (1−ε)·batch did
    updated = torch.lerp(running.to(wide), batch.to(wide), 1.0 - decay)
    running_ok = all_finite(running)
    return torch.where(batch_ok, torch.where(running_ok, updated, batch), running)


def divided(sums: Tensor, counts: Tensor, wide: torch.dtype | None = None) -> Tensor:
    """``sums / counts``, divided in at least float32 and rounded back to the sums' dtype.

    ``counts`` is on the sums' device and broadcasts. A float16 count overflows above 65504,
    hence the wider division; and the count is a device tensor, not a Python number, which a
    GPU would multiply by as a rounded reciprocal: every path that folds a factor divides
    this one way, so its bits do not depend on whether it was stacked or came first.
    ``wide``: that dtype, when the caller knows it (a lookup torch dispatches, per factor).
    """
    wide = torch.promote_types(sums.dtype, torch.float32) if wide is None else wide
    return (sums.to(wide) / counts.to(wide)).to(sums.dtype)


def running_averages(
    runnings: Sequence[Tensor],
    batches: Sequence[Tensor],
    decay: float,
    present: Tensor | None = None,
    divisors: Tensor | None = None,
    stack_bytes: int = 0,
) -> tuple[list[Tensor], Tensor]:
    """:func:`running_average` of many running factors at once (each must exist).

    The factor updates of a model are many matrices with a few elementwise passes each; here
    they share their launches: the finiteness of all batches and of all averages is checked
    together, and with ``stack_bytes`` the factors of one shape and dtype are stacked (in
    chunks of at most that many bytes), so each chunk's division, blend and two selects are
    one operation each instead of one per factor. On a GPU the host launches every operation,
    and a factor step's ~100 factors made it wait for the host (docs/benchmarks.md). The result
    is the same, bit for bit, whatever the stacking: every operation is elementwise.

    Args:
        runnings: the running factors.
        batches: the batch factors, one per running factor (same shape and dtype: mixed
            pairs go through :func:`running_average`, which promotes), or with ``divisors``
            their sums.
        decay: ``ε``.
        present: device booleans, one per factor: whether it has a batch at all (a factor
            without one keeps its value, decided on the device); None: all have one.
        divisors: device counts, one per factor: batch ``i`` is
            ``divided(batches[i], divisors[i])`` (:func:`divided`); None: the batches are
            factors already.
        stack_bytes: the most bytes a stack of equal-shaped factors may take, and the stacks
            of sums made at once (stacked averages as many more at a first fold, the blends
            are the new averages); 0: one factor at a time. The averages that a stacked fold
            returns are views of one stack, and a later fold of the same factors stacks them
            again without a copy.

    Returns:
        The new running factors and the device booleans "batch ``i`` was finite".
    """
    plan = _chunk_plan(batches, stack_bytes)
    if not plan:
        return [], torch.ones(0, dtype=torch.bool)
    order = _plan_order(plan)
    cast: dict[torch.dtype, Tensor] = {}  # one conversion and gather per dtype, not per factor
    if divisors is not None:
        for spec in plan:
            if spec.wide not in cast:
                cast[spec.wide] = _gathered(divisors.to(spec.wide), order)
    present = None if present is None else _gathered(present, order)
    result: list[Tensor] = list(runnings)
    oks = []
    for wave in _waves(plan, stack_bytes):
        # The stacks of one wave at a time (each wave's stacked copies at most about
        # stack_bytes; _fold_wave's own, freed when it returns): a model's every factor
        # stacked at once would be one more copy of all of them.
        averages, batch_ok = _fold_wave(wave, runnings, batches, decay, present, cast)
        for spec, folded in zip(wave, averages, strict=True):
            for index, average in zip(spec.indices, folded, strict=True):
                result[index] = average
        oks.append(batch_ok)
    position = [0] * len(order)
    for place, index in enumerate(order):
        position[index] = place
    return result, _gathered(oks[0] if len(oks) == 1 else torch.cat(oks), position)


def fold_order(batches: Sequence[Tensor], stack_bytes: int = 0) -> list[int]:
    """The order in which :func:`running_averages` folds ``batches`` (indices into them).

    Factors handed over in this order are folded without gathering ``present``, the
    divisors or the finiteness flags into it on the device (a view per factor each, on the
    host), and exactly as in any other order: the same chunks, every operation elementwise.
    """
    return _plan_order(_chunk_plan(batches, stack_bytes))


def _plan_order(plan: Sequence[_ChunkSpec]) -> list[int]:
    """The factors' indices in the plan's order (its chunks one after another)."""
    return [index for spec in plan for index in spec.indices]


def _fold_wave(
    wave: Sequence[_ChunkSpec],
    runnings: Sequence[Tensor],
    batches: Sequence[Tensor],
    decay: float,
    present: Tensor | None,
    divisors: Mapping[torch.dtype, Tensor],
) -> tuple[list[list[Tensor]], Tensor]:
    """One wave's new averages (per chunk) and its batches' finiteness (the chunks' order).

    ``present`` and ``divisors`` (per dtype; none: the batches are factors) are every
    factor's, in the chunks' order: each chunk's part is a slice.
    """
    chunks = [_Chunk(spec, runnings, batches) for spec in wave]
    if divisors:
        for chunk in chunks:
            chunk.divide(divisors[chunk.spec.wide])
    batch_ok = finite_flags([row for chunk in chunks for row in chunk.rows(chunk.batches)])
    running_ok = finite_flags([row for chunk in chunks for row in chunk.rows(chunk.runnings)])
    start, end = wave[0].start, wave[-1].start + len(wave[-1].indices)
    usable = batch_ok if present is None else batch_ok & present[start:end]
    both = usable & running_ok
    blends = torch._foreach_lerp(
        [chunk.runnings for chunk in chunks], [chunk.batches for chunk in chunks], 1.0 - decay
    )
    averages = [
        chunk.select(blend, usable, both, start)
        for chunk, blend in zip(chunks, blends, strict=True)
    ]
    return averages, batch_ok


def _gathered(values: Tensor, indices: Sequence[int]) -> Tensor:
    """``values[indices]``: ``values`` itself in order, one stack of views otherwise."""
    if list(indices) == list(range(len(values))):
        return values
    return torch.stack([values[index] for index in indices])


class _ChunkSpec(NamedTuple):
    """Factors of one shape and dtype folded together (see :func:`_chunk_plan`).

    Attributes:
        indices: the factors, in the caller's numbering.
        start: where they begin in the per-factor vectors (the chunks' order).
        shape: one factor's shape.
        wide: the dtype a sum is divided in (its own, at least float32).
        stacked_bytes: the bytes of its stacked sums (0: one factor, no stack).
    """

    indices: list[int]
    start: int
    shape: tuple[int, ...]
    wide: torch.dtype
    stacked_bytes: int


def _chunk_plan(batches: Sequence[Tensor], stack_bytes: int) -> list[_ChunkSpec]:
    """The factors as chunks of one shape and dtype, of at most ``stack_bytes`` (0: one each).

    A factor larger than ``stack_bytes`` is a chunk of its own.
    """
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[list[int]]] = {}
    for index, tensor in enumerate(batches):
        if stack_bytes <= 0:
            groups[((index,), tensor.dtype)] = [[index]]
            continue
        chunks = groups.setdefault((tuple(tensor.shape), tensor.dtype), [[]])
        size = tensor.numel() * tensor.element_size()
        if chunks[-1] and (len(chunks[-1]) + 1) * size > stack_bytes:
            chunks.append([])
        chunks[-1].append(index)
    plan: list[_ChunkSpec] = []
    wide: dict[torch.dtype, torch.dtype] = {}
    start = 0
    for (_, dtype), chunks in groups.items():
        if dtype not in wide:
            wide[dtype] = torch.promote_types(dtype, torch.float32)
        for indices in chunks:
            first = batches[indices[0]]
            size = first.numel() * first.element_size() if len(indices) > 1 else 0
            plan.append(
                _ChunkSpec(indices, start, tuple(first.shape), wide[dtype], size * len(indices))
            )
            start += len(indices)
    return plan


def _waves(plan: Sequence[_ChunkSpec], stack_bytes: int) -> list[list[_ChunkSpec]]:
    """Consecutive chunks whose stacked sums add up to at most ``stack_bytes`` (one at least)."""
    if not plan:
        return []
    waves: list[list[_ChunkSpec]] = [[]]
    held = 0
    for spec in plan:
        if waves[-1] and held + spec.stacked_bytes > stack_bytes:
            waves.append([])
            held = 0
        waves[-1].append(spec)
        held += spec.stacked_bytes
    return waves


def _stacked(tensors: Sequence[Tensor]) -> tuple[Tensor, bool]:
    """The tensors as one ``(k, *shape)`` tensor, and whether it is a new copy.

    Tensors that are the rows of one stack in order (an earlier stacked fold's averages) are
    that stack; others are stacked into new memory.
    """
    base = tensors[0]._base
    if base is not None and _are_rows_of(base, tensors):
        return base, False
    return torch.stack(list(tensors)), True


def _are_rows_of(base: Tensor, tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` are ``base[0]``, ``base[1]``, ... exactly, in that order."""
    shape = tuple(tensors[0].shape)
    if tuple(base.shape) != (len(tensors), *shape) or not base.is_contiguous():
        return False
    row_bytes = tensors[0].numel() * tensors[0].element_size()
    return all(
        tensor._base is base
        and tuple(tensor.shape) == shape
        and tensor.is_contiguous()
        and tensor.data_ptr() == base.data_ptr() + row * row_bytes
        for row, tensor in enumerate(tensors)
    )


class _Chunk:
    """One chunk's factors, folded by one operation per step.

    Several factors are rows of stacks; one factor is worked on flat (a 0-dim condition over
    flat tensors is the CPU's fastest ``where``, 15-25% faster than shaped ones here).
    :meth:`divide` (if the batches are sums) comes before :meth:`select`.

    Attributes:
        spec: the chunk.
        alone: whether it is one factor (flat tensors, no stack).
        runnings: the averages: the flat factor, or a ``(k, *shape)`` stack (never written).
        batches: the batches (or sums) the same way; written in place only when ``_own``
            (a stack or quotient made here, never the caller's tensor).
    """

    def __init__(
        self, spec: _ChunkSpec, runnings: Sequence[Tensor], batches: Sequence[Tensor]
    ) -> None:
        self.spec = spec
        self.alone = len(spec.indices) == 1
        if self.alone:
            self.runnings = runnings[spec.indices[0]].reshape(-1)
            self.batches, self._own = batches[spec.indices[0]].reshape(-1), False
        else:
            self.runnings, _ = _stacked([runnings[index] for index in spec.indices])
            self.batches, self._own = _stacked([batches[index] for index in spec.indices])

    def rows(self, stack: Tensor) -> list[Tensor]:
        """One tensor per factor: the flat factor, or the stack's rows."""
        return [stack] if self.alone else list(stack.unbind(0))

    def _part(self, values: Tensor, offset: int = 0) -> Tensor:
        """This chunk's entries of a per-factor vector, shaped to broadcast over its rows.

        The vector begins at factor ``offset`` of the chunks' order.
        """
        start = self.spec.start - offset
        if self.alone:
            return values[start]
        part = values[start : start + len(self.spec.indices)]
        return part.view(-1, *[1] * (self.batches.dim() - 1))

    def divide(self, counts: Tensor) -> None:
        """Divide each factor's sum by its count (``counts``: every factor's, in ``wide``)."""
        wide = self.spec.wide
        if self._own and wide == self.batches.dtype:  # as divided(), in place
            self.batches.div_(self._part(counts))
        else:
            self.batches, self._own = divided(self.batches, self._part(counts), wide), True

    def select(self, blend: Tensor, usable: Tensor, both: Tensor, offset: int) -> list[Tensor]:
        """Each factor's new average: the blend, else a finite batch, else the old average.

        ``usable`` and ``both`` are the flags of the factors from ``offset`` on.
        """
        usable, both = self._part(usable, offset), self._part(both, offset)
        if self._own:
            fallback = torch.where(usable, self.batches, self.runnings, out=self.batches)
        else:
            fallback = torch.where(usable, self.batches, self.runnings)
        torch.where(both, blend, fallback, out=blend)
        if self.alone:
            return [blend.view(self.spec.shape)]
        return list(blend.unbind(0))
