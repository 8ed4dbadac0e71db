"""Index plans of a stride-1 convolution's patch Gram from shifted products.

A plan depends on the input's geometry only (its height and width, the kernel, dilation and
padding), not on the batch or the channels: it is computed once on the CPU, where ``unique``
and ``nonzero`` cost no device synchronisation, and reused by every factor update, so that
:func:`dkfac.curvature.factors.conv2d_patch_gram` reads nothing back from the device. It also
says which products share one batched launch: on a GPU a small model's factor step is bound
by the host, which prepares every launch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor


class ConvGeometry(NamedTuple):
    """What the index plan of a stride-1 patch Gram depends on (not the batch or channels)."""

    height: int
    width: int
    kernel: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]

    def output_size(self) -> tuple[int, int]:
        """The stride-1 convolution's output height and width (``<= 0``: no position)."""
        (kh, kw), (dh, dw), (left, right, top, bottom) = self.kernel, self.dilation, self.pad
        return self.height + top + bottom - dh * (kh - 1), self.width + left + right - dw * (kw - 1)


class Run(NamedTuple):
    """Consecutive items that one batched product forms: ``items`` of them from ``first``.

    ``start`` and ``step``: for shifts, the first one's offset and the offset between two
    (in positions of the flat layout); for border groups, the first group's first row and
    the pixels per example of each group.
    """

    first: int
    items: int
    start: int
    step: int


@dataclass(frozen=True)
class ShiftedGramPlan:
    """Index data of the shifted-product patch Gram for one geometry, already on the device.

    Attributes:
        geometry: the geometry this plan is for.
        h_out: output height (``<= 0``: the convolution has no output position).
        w_out: output width.
        hp: height of the zero-padded position layout of one example.
        wp: width of that layout.
        shifts: kernel offset differences ``(D1, D2)`` with one product each.
        shift_runs: shifts of one ``D1`` with consecutive ``D2``: their offsets step by
            the dilation, so the shifted operands of a run are one strided view (one batched
            product).
        offsets: ``(S,)`` position offset of each shift in the flat layout.
        max_offset: the largest offset (zero rows appended to the layout).
        border: ``(B,)`` flat layout positions of the border pixels some window misses,
            grouped by which windows miss them; groups of equal size consecutive.
        group_sizes: pixels in each border group.
        group_runs: consecutive groups of equal size (one batched product each).
        border_patterns: ``(kh·kw, G)`` bool: does the window of offset ``u`` miss group ``g``.
        inside: ``(kh·kw, H, W)`` bool: pixel inside the output window of offset ``u``.
        which: shift index of each Gram block filled from a shifted product.
        first: first kernel offset of each such block.
        second: second kernel offset of each such block.
    """

    geometry: ConvGeometry
    h_out: int
    w_out: int
    hp: int
    wp: int
    shifts: tuple[tuple[int, int], ...]
    shift_runs: tuple[Run, ...]
    offsets: Tensor
    max_offset: int
    border: Tensor
    group_sizes: tuple[int, ...]
    group_runs: tuple[Run, ...]
    border_patterns: Tensor
    inside: Tensor
    which: Tensor
    first: Tensor
    second: Tensor
    # Derived tensors made on first use: per batch size (the latest one) and per dtype.
    _derived: dict[tuple[object, ...], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def border_rows(
        self, examples: int, layers: int = 1, head: int = 0, length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Layout rows of the border pixels of ``examples`` examples, and of their shifts.

        ``(B·N,)`` pixel-major (a group's rows are consecutive) and ``(B·N, S)``. For
        ``layers`` layouts of ``length`` positions each (``None``: ``length(examples)``),
        one after another, each with ``head`` zero rows before its positions
        (:func:`~dkfac.curvature.shifted_grams.shifted_patch_grams`), the rows of every layout:
        group by group, within a group layout by layout, so that a run of equal-sized groups
        is one batched product over all layouts. Kept for the latest batch size: the same
        for every factor update at that size. Under ``torch.compile`` they are made in the
        graph instead, and the cache is not even looked up: a lookup keyed by the batch size
        would specialise the graph on it (one recompilation per batch size, tested).
        """
        compiling = torch.compiler.is_compiling()
        length = self.length(examples) if length is None else length
        cached = None if compiling else self._derived.get(("rows", examples, layers, head, length))
        if cached is not None:
            return cached, self._derived[("shifted", examples, layers, head, length)]
        per_example = torch.arange(examples, device=self.border.device) * (self.hp * self.wp)
        rows = (self.border[:, None] + (per_example + head)).flatten()
        if layers > 1:
            starts = torch.arange(layers, device=rows.device) * length
            by_layout = rows[None, :] + starts[:, None]  # (layers, B·N)
            groups = torch.split(by_layout, [size * examples for size in self.group_sizes], dim=1)
            rows = torch.cat([group.flatten() for group in groups])
        shifted = rows[:, None] + self.offsets
        if not compiling:
            for kept in [kept for kept in self._derived if kept[0] in ("rows", "shifted")]:
                if kept[1] != examples:
                    del self._derived[kept]
            self._derived[("rows", examples, layers, head, length)] = rows
            self._derived[("shifted", examples, layers, head, length)] = shifted
        return rows, shifted

    def length(self, examples: int) -> int:
        """Positions in the flat layout of ``examples`` examples (zero rows past the last)."""
        return examples * self.hp * self.wp + self.max_offset

    def in_dtype(self, name: str, dtype: torch.dtype) -> Tensor:
        """``border_patterns`` or ``inside`` as ``dtype`` (0 or 1), made once per dtype."""
        key = (name, dtype)
        cached = self._derived.get(key)
        if cached is None:
            cached = getattr(self, name).to(dtype)
            if not torch.compiler.is_compiling():
                self._derived[key] = cached
        return cached


def _window_mask(size: int, kernel: int, dilation: int, pad_before: int, out: int) -> Tensor:
    """``mask[i, r]``: image row ``r`` lies outside the output window of kernel offset ``i``.

    With stride 1, offset ``i`` sees image rows ``[d·i − pad_before, d·i − pad_before + out)``.
    """
    start = torch.arange(kernel)[:, None] * dilation - pad_before
    rows = torch.arange(size)[None, :]
    return (rows < start) | (rows >= start + out)


def _runs(keys: list[int], starts: list[int], steps: list[int]) -> tuple[Run, ...]:
    """Runs of consecutive items of equal key: each starts at its first item's start and step."""
    runs: list[Run] = []
    for index, key in enumerate(keys):
        if runs and keys[runs[-1].first] == key:
            runs[-1] = runs[-1]._replace(items=runs[-1].items + 1)
        else:
            runs.append(Run(index, 1, starts[index], steps[index]))
    return tuple(runs)


def plan_shifted_gram(geometry: ConvGeometry, device: torch.device) -> ShiftedGramPlan:
    """Compute the index plan of a stride-1 patch Gram on the CPU and move it to ``device``.

    The only device work is the copy of a few small index tensors; call it once per geometry
    (see :class:`ShiftedGramPlans`).
    """
    h, w, (kh, kw), (dh, dw), (left, _, top, _) = geometry
    h_out, w_out = geometry.output_size()
    hp, wp = h + dh * (kh - 1), w + dw * (kw - 1)
    shifts = tuple((d1, d2) for d1 in range(kh) for d2 in range(-kw + 1, kw) if d1 > 0 or d2 >= 0)
    offset_list = [dh * d1 * wp + dw * d2 for d1, d2 in shifts]
    # Positions some window misses, grouped by which offsets miss them: a border row or
    # column of the image, or a corner. Groups of equal size go together (one product).
    row_out = _window_mask(h, kh, dh, top, h_out)  # (kh, h)
    col_out = _window_mask(w, kw, dw, left, w_out)  # (kw, w)
    missed = (row_out[:, None, :, None] | col_out[None, :, None, :]).flatten(0, 1)  # (U, h, w)
    patterns, group_of = torch.unique(missed.flatten(1), dim=1, return_inverse=True)
    positions = {
        g: (group_of == g).nonzero().squeeze(1)
        for g in range(patterns.shape[1])
        if bool(patterns[:, g].any())
    }
    groups = sorted(positions, key=lambda g: (len(positions[g]), g))
    border = (
        torch.cat([positions[g] for g in groups]) if groups else torch.zeros(0, dtype=torch.long)
    )
    group_sizes = tuple(len(positions[g]) for g in groups)
    which, first, second = [], [], []
    for index_s, (d1, d2) in enumerate(shifts):
        for i in range(max(0, -d1), min(kh, kh - d1)):
            for j in range(max(0, -d2), min(kw, kw - d2)):
                which.append(index_s)
                first.append(i * kw + j)
                second.append((i + d1) * kw + (j + d2))

    def here(values: Tensor | list[int]) -> Tensor:
        tensor = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.long)
        return tensor.to(device)

    return ShiftedGramPlan(
        geometry=geometry,
        h_out=h_out,
        w_out=w_out,
        hp=hp,
        wp=wp,
        shifts=shifts,
        # Shifts of one D1 (their D2 consecutive: offsets step by dw); groups of one size.
        shift_runs=_runs([d1 for d1, _ in shifts], offset_list, [dw] * len(shifts)),
        offsets=here(offset_list),
        max_offset=max(offset_list),
        border=here((border // w) * wp + border % w),
        group_sizes=group_sizes,
        group_runs=_runs(
            list(group_sizes),
            [0, *itertools.accumulate(group_sizes)][: len(group_sizes)],
            list(group_sizes),
        ),
        border_patterns=here(patterns[:, groups]) if groups else here(patterns[:, :0]),
        inside=here(~missed),
        which=here(which),
        first=here(first),
        second=here(second),
    )


class ShiftedGramPlans:
    """One layer's cache of :class:`ShiftedGramPlan`, keyed by geometry and device.

    A layer sees one input size in most models; the cache keeps the most recent
    :data:`MAX_PLANS` so that varying sizes (multi-scale training) cannot grow it unboundedly.
    Each plan also keeps its border rows for the latest batch size
    (:meth:`ShiftedGramPlan.border_rows`: ``B·N·(S+1)`` int64, e.g. ~6 MB for a 3x3 kernel
    on 56x56 inputs at batch 256) and its 0/1 weights per dtype.
    """

    MAX_PLANS = 8

    def __init__(self) -> None:
        self._plans: dict[tuple[ConvGeometry, torch.device], ShiftedGramPlan] = {}

    def get(self, geometry: ConvGeometry, device: torch.device) -> ShiftedGramPlan:
        """The plan for ``geometry`` on ``device``, computed on first use."""
        key = (geometry, device)
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = plan_shifted_gram(geometry, device)
            if len(self._plans) >= self.MAX_PLANS:
                del self._plans[next(iter(self._plans))]
        self._plans[key] = plan  # most recently used last
        return plan

    def cached(self, geometry: ConvGeometry, device: torch.device) -> ShiftedGramPlan | None:
        """The plan for ``geometry`` on ``device`` if one was made, else ``None`` (makes none)."""
        return self._plans.get((geometry, device))

    def __len__(self) -> int:
        return len(self._plans)
