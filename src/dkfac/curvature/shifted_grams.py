"""A stride-1 convolution's patch Grams from shifted products of its input, not im2col.

Block ``(u, u+D)`` of a patch Gram (kernel offsets ``u`` and ``u+D``) is the input's
correlation with itself shifted by ``d·D``, over the output window of offset ``u``; over the
whole image that correlation depends on ``D`` only. :func:`shifted_patch_grams` forms one
product per ``D`` and corrects each block at the border, from the index plan of
:mod:`dkfac.curvature.shifted_gram_plan`; :mod:`dkfac.curvature.factors` chooses between it
and im2col.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.gram import GramPrecision, fill_border
from dkfac.curvature.row_chunks import row_chunks
from dkfac.curvature.shifted_gram_plan import ShiftedGramPlan


def shifted_patch_grams(
    xs: Sequence[Tensor],
    plan: ShiftedGramPlan,
    with_ones: bool,
    precision: GramPrecision,
    operand: torch.dtype,
    chunks: int | None = None,
) -> tuple[list[Tensor], int]:
    """Patch Grams of stride-1 convolution inputs of one shape, without materialising im2col.

    Block ``(u, u+D)`` of a Gram (kernel offsets ``u`` and ``u+D``) is the correlation of the
    input with itself shifted by ``d·D``, summed over the output window of offset ``u``. Over
    the whole image that correlation depends on ``D`` only, so it is one product per ``D``
    (``((2kh−1)(2kw−1)+1)/2`` of them instead of ``(kh·kw)²`` blocks, the rest by symmetry);
    each block then subtracts the image positions its window misses, which lie in a few rows
    and columns at the border. Each input is laid out once, cast to ``operand`` in the same
    copy, as a flat zero-padded ``(positions, C)`` matrix, so every shifted operand is a
    strided view (no copy) and a shifted position outside the image reads a zero.

    Launches: an input's products of shifts of one kernel row are one batched product of
    overlapping views (``plan.shift_runs``); from more inputs than shifts per run (their
    layouts one after another), one batched product per shift over all of them instead
    (a 3x3 kernel: 3 launches an input, or 13 for any number). Every other step (border
    groups of one size, corrections, assembly) is one launch for all inputs. All index data
    comes from ``plan``: nothing is read back from the device here.

    ``chunks`` (``None``: :func:`~dkfac.curvature.row_chunks.row_chunks` decides, 1 on a
    CPU and inside ``torch.compile``'s tracing): more than 1 cuts each layout's positions
    into that many chunks, so that each shift's product over every input is
    ``inputs·chunks`` results in one batched product, summed over the chunks (13 products
    and 13 sums for a 3x3 kernel). The layouts then start with zero rows too, as many as
    they end with: a chunk's product reads the next layout's first positions only against
    zeros of its own, and a shifted position before a layout's first reads zeros, so one
    input's values never meet another's (an infinity in one stays out of the others' Grams).

    Raises:
        ValueError: ``chunks`` is not a positive int.
    """
    layers = len(xs)
    x = xs[0]
    n, c, h, w = x.shape
    out_dtype = precision.output_dtype(operand)
    kh, kw = plan.geometry.kernel
    h_out, w_out, hp, wp = plan.h_out, plan.w_out, plan.hp, plan.wp
    rows = n * h_out * w_out
    size = c * kh * kw
    # int(): torch 2.11's symbolic shapes cannot add a bool to a dynamic size.
    side = size + int(with_ones)
    if h_out <= 0 or w_out <= 0 or n == 0:  # no patch (border gathers cannot shape 0 rows)
        return [x.new_zeros(side, side, dtype=out_dtype) for _ in xs], 0
    span = n * hp * wp
    shifts = len(plan.shifts)
    if chunks is None:  # traced: one way for every size (a choice by size would guard on it)
        compiling = torch.compiler.is_compiling()
        chunks = 1 if compiling else row_chunks(span, c, layers, x.device)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} is not allowed: expected an integer >= 1")
    # Each layout: the positions and max_offset zero rows; chunked, whole chunks of rows
    # with max_offset zero rows before the positions too.
    head, length = (plan.max_offset, plan.length(n)) if chunks > 1 else (0, plan.length(n))
    rows_per_chunk = -(-(head + length) // chunks)
    if chunks > 1:
        length = rows_per_chunk * chunks
    # Positions-major layouts: a product reads one transposed for free, and gathering
    # positions gathers contiguous channel vectors. Chunked products read past the last
    # layout's end (by up to max_offset, zeros).
    flat = x.new_zeros(layers * length + (plan.max_offset if chunks > 1 else 0), c, dtype=operand)
    layouts = flat[: layers * length].view(layers, length, c)
    image = layouts[:, head : head + span].view(layers, n, hp, wp, c)[:, :, :h, :w]
    # Cast to the operands' dtype in the same copy (one input: broadcast over the layer dim).
    inputs = x if layers == 1 else torch.stack(list(xs))
    image.copy_(inputs.permute(0, 2, 3, 1) if layers == 1 else inputs.permute(0, 1, 3, 4, 2))
    flat = precision.as_read(flat)
    if chunks > 1:  # a product per shift of all inputs' chunks, summed over the chunks
        full = x.new_empty(shifts, layers, c, c, dtype=out_dtype)
        partial = x.new_empty(layers * chunks, c, c, dtype=out_dtype)
        # Whole layouts, head and tail too: chunk k of layout l starts at row
        # (l·chunks + k)·rows_per_chunk of flat.
        products, stride = layers * chunks, rows_per_chunk * c
        base_chunks = flat.as_strided((products, c, rows_per_chunk), (stride, 1, c))
        for run in plan.shift_runs:
            for item in range(run.items):
                offset = (run.start + item * run.step) * c
                shifted = flat.as_strided((products, rows_per_chunk, c), (stride, c, 1), offset)
                precision.bmm(base_chunks, shifted, out=partial)
                chunked = partial.view(layers, chunks, c, c)
                torch.sum(chunked, dim=1, out=full[run.first + item])
    else:
        # flat is a tensor of its own (storage offset 0; asking it would break
        # torch.compile's graph): each layout's first span positions, transposed.
        base = flat.as_strided((layers, c, span), (length * c, 1, c))
        full = _shift_products(flat, base, plan, layers, length, out_dtype, precision)
    # The Gram's blocks from their shifted products: only the blocks it needs, gathered.
    chosen = full[plan.which]  # (P, layers, C, C)
    # Each border group's correction contracts over all its positions and examples; the
    # groups of one size, of every layout, in one batched product.
    if plan.group_sizes:
        index, shifted_index = plan.border_rows(n, layers, head, length)
        table = flat[: layers * length]
        at_border = table[index]  # (B·N·layers, C): group by group, layout by layout
        shifted_rows = table[shifted_index].flatten(1)  # (B·N·layers, S·C)
        per_group = full.new_empty(len(plan.group_sizes) * layers, c, shifts * c)
        for run in plan.group_runs:
            rows_per_group = run.step * n
            begin, stop = run.start * n * layers, (run.start + run.items * run.step) * n * layers
            batch = run.items * layers
            precision.bmm(
                at_border[begin:stop].view(batch, rows_per_group, c).mT,
                shifted_rows[begin:stop].view(batch, rows_per_group, -1),
                out=per_group[run.first * layers : run.first * layers + batch],
            )
        weights = plan.in_dtype("border_patterns", out_dtype)  # (U, G)
        corrections = weights @ per_group.view(len(plan.group_sizes), -1)
        by_shift = corrections.view(kh * kw, layers, c, shifts, c).permute(3, 0, 1, 2, 4)
        chosen.sub_(by_shift[plan.which, plan.first])
    # Written straight into the Grams' (c, u) order: block (u, u') is a strided view.
    grams = full.new_empty(layers, side, side)
    blocks = grams[:, :size, :size].view(layers, c, kh * kw, c, kh * kw).permute(2, 4, 0, 1, 3)
    blocks[plan.second, plan.first] = chosen.transpose(-1, -2)
    blocks[plan.first, plan.second] = chosen
    if with_ones:
        # Bias row: the patch sums, i.e. channel sums over each offset's window.
        inside = plan.in_dtype("inside", out_dtype)  # (kh·kw, h, w)
        sums = torch.einsum("lhwc,uhw->lcu", image.sum(1, dtype=out_dtype), inside)
        fill_border(grams, sums.reshape(layers, -1), rows)
    return list(grams.unbind(0)), rows


def _shift_products(
    flat: Tensor,
    base: Tensor,
    plan: ShiftedGramPlan,
    layers: int,
    length: int,
    out_dtype: torch.dtype,
    precision: GramPrecision,
) -> Tensor:
    """``(S, layers, C, C)``: each shift's product of every layout, uncut (see the caller).

    A product per run of shifts of each input while there are no more of those than shifts
    (a run's operands overlap, ``run.step`` positions apart), else a product per shift of
    all inputs.
    """
    c, span = base.shape[1], base.shape[2]
    shifts = len(plan.shifts)
    if layers * len(plan.shift_runs) <= shifts:  # a product per run of each input
        by_input = flat.new_empty(layers, shifts, c, c, dtype=out_dtype)  # written in place
        for layer, layer_base in enumerate(base.unbind(0)):
            for run in plan.shift_runs:
                shifted = flat.as_strided(
                    (run.items, span, c), (run.step * c, c, 1), (layer * length + run.start) * c
                )
                out = by_input[layer, run.first : run.first + run.items]
                precision.bmm(layer_base.expand(run.items, c, span), shifted, out=out)
        return by_input.transpose(0, 1)
    full = flat.new_empty(shifts, layers, c, c, dtype=out_dtype)  # a product per shift
    for run in plan.shift_runs:
        for item in range(run.items):
            offset = (run.start + item * run.step) * c
            shifted = flat.as_strided((layers, span, c), (length * c, c, 1), offset)
            precision.bmm(base, shifted, out=full[run.first + item])
    return full
