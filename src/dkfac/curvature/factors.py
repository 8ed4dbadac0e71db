"""The Gram of a 2-D convolution's im2col patches, without forming im2col where it can.

These are the hot loops of K-FAC (an im2col Gram costs several forward passes of the layer),
so they avoid copies and exploit symmetry where PyTorch lets them.
"""

from __future__ import annotations

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
from dkfac.curvature.shifted_gram_plan import (
    ConvGeometry,
    ShiftedGramPlan,
    ShiftedGramPlans,
    plan_shifted_gram,
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
    the whole image that correlation depends on ``D`` only, so it is one product per ``D``
    (``((2kh−1)(2kw−1)+1)/2`` of them instead of ``(kh·kw)²`` blocks, the rest by symmetry);
    each block then subtracts the image positions its window misses, which lie in a few rows
    and columns at the border. The input is laid out once, cast to ``operand`` in the same
    copy, as a flat zero-padded ``(positions, C)`` matrix, so every shifted operand is a
    strided view (no copy) and a shifted position outside the image reads a zero. The
    products of shifts of one kernel row are one batched product of overlapping views
    (``plan.shift_runs``), the border groups' of one size another (``plan.group_runs``): a
    3x3 kernel takes 5 launches for its 21 products. All index data comes from ``plan``:
    nothing is read back from the device here.
    """
    n, c, h, w = x.shape
    out_dtype = precision.output_dtype(operand)
    kh, kw = plan.geometry.kernel
    h_out, w_out, hp, wp = plan.h_out, plan.w_out, plan.hp, plan.wp
    rows = n * h_out * w_out
    size = c * kh * kw
    if h_out <= 0 or w_out <= 0:
        side = size + int(with_ones)
        return x.new_zeros(side, side, dtype=out_dtype), 0
    span = n * hp * wp
    shifts = len(plan.shifts)
    # Positions-major layout: a product reads it transposed for free, and gathering positions
    # gathers contiguous channel vectors.
    flat = x.new_zeros(span + plan.max_offset, c, dtype=operand)
    image = flat[:span].view(n, hp, wp, c)[:, :h, :w]
    image.copy_(x.permute(0, 2, 3, 1))  # cast to the operands' dtype in the same copy
    flat = precision.as_read(flat)
    base = flat[:span].t()
    full = x.new_empty(shifts, c, c, dtype=out_dtype)  # each product written in place
    for run in plan.shift_runs:
        # A run's operands overlap: run.step positions apart. flat is a tensor of its own
        # (storage offset 0; asking it would break torch.compile's graph).
        shifted = flat.as_strided((run.items, span, c), (run.step * c, c, 1), run.start * c)
        out = full[run.first : run.first + run.items]
        precision.bmm(base.expand(run.items, c, span), shifted, out=out)

    # The Gram's blocks from their shifted products: only the blocks it needs, gathered.
    chosen = full[plan.which]
    # Each border group's correction contracts over all its positions and examples; the
    # groups of one size in one batched product.
    if plan.group_sizes:
        index, shifted_index = plan.border_rows(n)
        at_border = flat[index]  # (B·N, C)
        shifted_rows = flat[shifted_index].flatten(1)  # (B·N, S·C)
        per_group = full.new_empty(len(plan.group_sizes), c, shifts * c)  # (G, C, S·C)
        for run in plan.group_runs:
            rows_per_group = run.step * n
            stop = (run.start + run.items * run.step) * n
            precision.bmm(
                at_border[run.start * n : stop].view(run.items, rows_per_group, c).mT,
                shifted_rows[run.start * n : stop].view(run.items, rows_per_group, -1),
                out=per_group[run.first : run.first + run.items],
            )
        weights = plan.in_dtype("border_patterns", out_dtype)  # (U, G)
        corrections = (weights @ per_group.flatten(1)).view(kh * kw, c, shifts, c)
        chosen.sub_(corrections.permute(2, 0, 1, 3)[plan.which, plan.first])
    # Written straight into the Gram's (c, u) order: block (u, u') is a strided view of it.
    # int(): torch 2.11's symbolic shapes cannot add a bool to a dynamic size.
    side = size + int(with_ones)
    gram_out = full.new_empty(side, side)
    gram = gram_out[:size, :size]
    blocks = gram.view(c, kh * kw, c, kh * kw).permute(1, 3, 0, 2)  # (u, u', c, c')
    blocks[plan.second, plan.first] = chosen.transpose(1, 2)
    blocks[plan.first, plan.second] = chosen
    if with_ones:
        # Bias row: the patch sums, i.e. channel sums over each offset's window.
        inside = plan.in_dtype("inside", out_dtype)  # (kh·kw, h, w)
        sums = torch.einsum("hwc,uhw->cu", image.sum(0, dtype=out_dtype), inside).reshape(-1)
        fill_border(gram_out, sums, rows)
    return gram_out, rows
