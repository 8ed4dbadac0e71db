"""The Gram of a 2-D convolution's im2col patches, without forming im2col where it can.

These are the hot loops of K-FAC (an im2col Gram costs several forward passes of the layer),
so they avoid copies and exploit symmetry where PyTorch lets them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from dkfac.curvature.gram import (
    HIGHEST,
    GramPrecision,
    bordered_gram,
    fill_border,
    gram_with_ones,
    pixel_gram,
)


def conv2d_patch_gram(
    x: Tensor,
    *,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int, int, int],
    with_ones: bool,
    plans: ShiftedGramPlans | None = None,
    precision: GramPrecision = HIGHEST,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, int]:
    """``Σ a aᵀ`` over the im2col patches ``a`` of a 2-D convolution, and the number of patches.

    Args:
        x: input ``(N, C, H, W)``.
        kernel: ``(kh, kw)``.
        dilation: ``(dh, dw)``.
        stride: ``(sh, sw)``.
        pad: zero padding ``(left, right, top, bottom)`` as for ``F.pad``.
        with_ones: append a constant 1 to every patch (the bias input).
        plans: the layer's cache of stride-1 index plans; with it, a repeated input size reads
            nothing back from the device. ``None`` plans afresh on every call.
        precision: how the products are formed.
        dtype: the statistics' dtype (``factor_dtype``; ``None``: ``x``'s). The operands,
            ``precision.operand_dtype(dtype)``, are cast in the copy that lays ``x`` out.

    Returns:
        The ``(C·kh·kw [+1])`` square Gram in PyTorch's ``(c, i, j)`` patch order, and the
        number of patches ``N·H_out·W_out``.
    """
    statistics_dtype = x.dtype if dtype is None else dtype
    if kernel == (1, 1) and pad == (0, 0, 0, 0):
        # A 1x1 convolution's patches are its input pixels (every stride-th): their Gram, no
        # plan or blocks (one copy of the input instead of a zeroed layout, a copy and block
        # scatters, or im2col).
        pixels = x if stride == (1, 1) else x[:, :, :: stride[0], :: stride[1]]
        return pixel_gram(pixels, statistics_dtype, with_ones, precision)
    operand = precision.operand_dtype(statistics_dtype)
    if stride == (1, 1):
        geometry = ConvGeometry(int(x.shape[2]), int(x.shape[3]), kernel, dilation, pad)
        if not torch.compiler.is_compiling():
            plan = (
                plan_shifted_gram(geometry, x.device)
                if plans is None
                else plans.get(geometry, x.device)
            )
            return _shifted_patch_gram(x, plan, with_ones, precision, operand)
        # Inside torch.compile's tracing, making a plan (unique, nonzero: data-dependent
        # shapes) would break the graph; one made before, outside it, traces whole. Without
        # one, the im2col product (same Gram, other rounding) does.
        cached = None if plans is None else plans.cached(geometry, x.device)
        if cached is not None:
            return _shifted_patch_gram(x, cached, with_ones, precision, operand)
    return _strided_patch_gram(x, kernel, dilation, stride, pad, with_ones, precision, operand)


def _strided_patch_gram(
    x: Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int, int, int],
    with_ones: bool,
    precision: GramPrecision,
    operand: torch.dtype,
) -> tuple[Tensor, int]:
    """Patch Gram through an explicit im2col matrix, for any stride.

    The patches are a strided view of a channels-last copy of the padded input, so the one
    copy that materialises them reads and writes whole channel vectors; the Gram is formed in
    ``(i, j, c)`` order and permuted to PyTorch's ``(c, i, j)`` at the end (``d²`` elements).
    """
    n, c, h, w = x.shape
    kh, kw = kernel
    left, right, top, bottom = pad
    padded = x.new_zeros(n, h + top + bottom, w + left + right, c, dtype=operand)
    padded[:, top : top + h, left : left + w] = x.permute(0, 2, 3, 1)
    h_out = (padded.shape[1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (padded.shape[2] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    sn, sh, sw, sc = padded.stride()
    patches = padded.as_strided(
        (n, h_out, w_out, kh, kw, c),
        (sn, stride[0] * sh, stride[1] * sw, dilation[0] * sh, dilation[1] * sw, sc),
    )
    flat = patches.reshape(-1, kh * kw * c)
    gram = gram_with_ones(flat, with_ones, precision)
    size = c * kh * kw
    reordered = gram[:size, :size].view(kh, kw, c, kh, kw, c).permute(2, 0, 1, 5, 3, 4)
    if not with_ones:
        return reordered.reshape(size, size), flat.shape[0]
    sums = gram[size, :size].view(kh, kw, c).permute(2, 0, 1).reshape(-1)
    return bordered_gram(reordered.reshape(size, size), sums, flat.shape[0]), flat.shape[0]


class ConvGeometry(NamedTuple):
    """What the index plan of a stride-1 patch Gram depends on (not the batch or channels)."""

    height: int
    width: int
    kernel: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]


@dataclass(frozen=True)
class ShiftedGramPlan:
    """Index data of :func:`_shifted_patch_gram` for one geometry, already on the device.

    Everything here depends on the geometry only, so it is computed once on the CPU (where
    ``unique``, ``nonzero`` and friends cost no device synchronisation) and reused by every
    factor update; the Gram itself then runs without reading anything back from the device.

    Attributes:
        geometry: the geometry this plan is for.
        h_out: output height (``<= 0``: the convolution has no output position).
        w_out: output width.
        hp: height of the zero-padded position layout of one example.
        wp: width of that layout.
        shifts: kernel offset differences ``(D1, D2)`` with one GEMM each.
        offsets: ``(S,)`` position offset of each shift in the flat layout.
        offset_list: the same offsets as Python ints (GEMM operand slices).
        max_offset: the largest offset (zero rows appended to the layout).
        border: ``(B,)`` flat layout positions of the border pixels some window misses,
            grouped by which windows miss them.
        group_sizes: pixels in each border group.
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
    offsets: Tensor
    offset_list: tuple[int, ...]
    max_offset: int
    border: Tensor
    group_sizes: tuple[int, ...]
    border_patterns: Tensor
    inside: Tensor
    which: Tensor
    first: Tensor
    second: Tensor


def _window_mask(size: int, kernel: int, dilation: int, pad_before: int, out: int) -> Tensor:
    """``mask[i, r]``: image row ``r`` lies outside the output window of kernel offset ``i``.

    With stride 1, offset ``i`` sees image rows ``[d·i − pad_before, d·i − pad_before + out)``.
    """
    start = torch.arange(kernel)[:, None] * dilation - pad_before
    rows = torch.arange(size)[None, :]
    return (rows < start) | (rows >= start + out)


def plan_shifted_gram(geometry: ConvGeometry, device: torch.device) -> ShiftedGramPlan:
    """Compute the index plan of a stride-1 patch Gram on the CPU and move it to ``device``.

    The only device work is the copy of a few small index tensors; call it once per geometry
    (see :class:`ShiftedGramPlans`).
    """
    h, w, (kh, kw), (dh, dw), (left, right, top, bottom) = geometry
    h_out = h + top + bottom - dh * (kh - 1)
    w_out = w + left + right - dw * (kw - 1)
    hp, wp = h + dh * (kh - 1), w + dw * (kw - 1)
    shifts = tuple((d1, d2) for d1 in range(kh) for d2 in range(-kw + 1, kw) if d1 > 0 or d2 >= 0)
    offset_list = tuple(dh * d1 * wp + dw * d2 for d1, d2 in shifts)
    # Positions some window misses, grouped by which offsets miss them: a border row or
    # column of the image, or a corner.
    row_out = _window_mask(h, kh, dh, top, h_out)  # (kh, h)
    col_out = _window_mask(w, kw, dw, left, w_out)  # (kw, w)
    missed = (row_out[:, None, :, None] | col_out[None, :, None, :]).flatten(0, 1)  # (U, h, w)
    patterns, group_of = torch.unique(missed.flatten(1), dim=1, return_inverse=True)
    border_groups = [g for g in range(patterns.shape[1]) if bool(patterns[:, g].any())]
    positions = [(group_of == g).nonzero().squeeze(1) for g in border_groups]
    border = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
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
        offsets=here(list(offset_list)),
        offset_list=offset_list,
        max_offset=max(offset_list),
        border=here((border // w) * wp + border % w),
        group_sizes=tuple(len(p) for p in positions),
        border_patterns=here(patterns[:, border_groups]),
        inside=here(~missed),
        which=here(which),
        first=here(first),
        second=here(second),
    )


class ShiftedGramPlans:
    """One layer's cache of :class:`ShiftedGramPlan`, keyed by geometry and device.

    A layer sees one input size in most models; the cache keeps the most recent
    :data:`MAX_PLANS` so that varying sizes (multi-scale training) cannot grow it unboundedly.
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


def _shifted_patch_gram(
    x: Tensor,
    plan: ShiftedGramPlan,
    with_ones: bool,
    precision: GramPrecision,
    operand: torch.dtype,
) -> tuple[Tensor, int]:
    """Patch Gram of a stride-1 convolution without materialising im2col.

    Block ``(u, u+D)`` of the Gram (kernel offsets ``u`` and ``u+D``) is the correlation of the
    input with itself shifted by ``d·D``, summed over the output window of offset ``u``. Over
    the whole image that correlation depends on ``D`` only, so it is one GEMM per ``D``
    (``((2kh−1)(2kw−1)+1)/2`` of them instead of ``(kh·kw)²`` blocks, the rest by symmetry);
    each block then subtracts the image positions its window misses, which lie in a few rows
    and columns at the border. The input is laid out once, cast to ``operand`` in the same
    copy, as a flat zero-padded ``(positions, C)`` matrix, so every shifted GEMM operand is a
    strided view (no copy) and a shifted position outside the image reads a zero. All index
    data comes from ``plan``: nothing is read back from the device here.
    """
    n, c, h, w = x.shape
    out_dtype = precision.output_dtype(operand)
    kh, kw = plan.geometry.kernel
    h_out, w_out, hp, wp = plan.h_out, plan.w_out, plan.hp, plan.wp
    rows = n * h_out * w_out
    size = c * kh * kw
    if h_out <= 0 or w_out <= 0:
        return x.new_zeros(size + with_ones, size + with_ones, dtype=out_dtype), 0
    span = n * hp * wp
    shifts = plan.shifts
    # Positions-major layout: a GEMM reads it transposed for free, and gathering positions
    # gathers contiguous channel vectors.
    flat = x.new_zeros(span + plan.max_offset, c, dtype=operand)
    image = flat[:span].view(n, hp, wp, c)[:, :h, :w]
    image.copy_(x.permute(0, 2, 3, 1))  # cast to the operands' dtype in the same copy
    base = flat[:span].t()
    full = x.new_empty(len(shifts), c, c, dtype=out_dtype)  # each product written in place
    for index_s, offset in enumerate(plan.offset_list):
        precision.mm(base, flat[offset : offset + span], out=full[index_s])

    # The Gram's blocks from their shifted products: only the blocks it needs, gathered.
    chosen = full[plan.which]
    # Each border group's correction is one GEMM contracting over all its positions and
    # examples.
    if plan.group_sizes:
        sizes = [size_g * n for size_g in plan.group_sizes]
        index = (plan.border[:, None] + torch.arange(n, device=x.device) * (hp * wp)).flatten()
        at_border = flat[index]  # (B·N, C)
        shifted = flat[index[:, None] + plan.offsets].flatten(1)  # (B·N, S·C)
        bounds = [0, *itertools.accumulate(sizes)]
        per_group = full.new_empty(len(sizes), c, len(shifts) * c)  # (G, C, S·C)
        for group, (i, j) in enumerate(itertools.pairwise(bounds)):
            precision.mm(at_border[i:j].t(), shifted[i:j], out=per_group[group])
        weights = plan.border_patterns.to(out_dtype)  # (U, G)
        corrections = (weights @ per_group.flatten(1)).view(kh * kw, c, len(shifts), c)
        chosen.sub_(corrections.permute(2, 0, 1, 3)[plan.which, plan.first])
    # Written straight into the Gram's (c, u) order: block (u, u') is a strided view of it.
    out = full.new_empty(size + with_ones, size + with_ones)
    gram = out[:size, :size]
    blocks = gram.view(c, kh * kw, c, kh * kw).permute(1, 3, 0, 2)  # (u, u', c, c')
    blocks[plan.second, plan.first] = chosen.transpose(1, 2)
    blocks[plan.first, plan.second] = chosen
    if with_ones:
        # Bias row: the patch sums, i.e. channel sums over each offset's window.
        inside = plan.inside.to(out_dtype)  # (kh·kw, h, w)
        sums = torch.einsum("hwc,uhw->cu", image.sum(0, dtype=out_dtype), inside).reshape(-1)
        fill_border(out, sums, rows)
    return out, rows
