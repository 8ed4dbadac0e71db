"""The Gram of a 2-D convolution's im2col patches, without forming im2col where it can.

These are the hot loops of K-FAC (an im2col Gram costs several forward passes of the layer),
so they avoid copies and exploit symmetry where PyTorch lets them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.curvature.gram import (
    HIGHEST,
    GramPrecision,
    fill_border,
    gram,
    pixel_gram,
    pixel_grams,
)
from dkfac.curvature.shifted_gram_plan import (
    ConvGeometry,
    ShiftedGramPlans,
    plan_shifted_gram,
)
from dkfac.curvature.shifted_grams import shifted_patch_grams

#: ``conv_patches``: how a stride-1 convolution's patch Gram is formed: as the device suits
#: (:func:`explicit_patches_pay`), always from shifted products (no ``kh·kw``-fold copy of
#: the input), or always from im2col matrices (fewer launches).
CONV_PATCHES: tuple[str, ...] = ("auto", "shifted", "im2col")


def im2col_asked(conv_patches: str) -> bool | None:
    """The ``im2col`` argument of :func:`conv2d_patch_gram` a ``conv_patches`` way gives.

    A function, not a mapping: a compiled model's hooks read it inside the graph, where a
    read-only mapping breaks it.
    """
    return None if conv_patches == "auto" else conv_patches == "im2col"


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
    im2col: bool | None = None,
    chunks: int | None = None,
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
        im2col: a stride-1 Gram from explicit im2col matrices (True) or shifted products
            (False; benchmarks and tests compare the two); ``None``: as
            :func:`explicit_patches_pay` decides. Other strides always take im2col, and an
            unpadded 1x1 kernel its pixel Grams, whatever this says.
        chunks: how many chunks the shifted products cut their positions into
            (:func:`shifted_patch_grams`); ``None``: as the device suits.

    Returns:
        The ``(C·kh·kw [+1])`` square Gram in PyTorch's ``(c, i, j)`` patch order, and the
        number of patches ``N·H_out·W_out``.
    """
    grams, rows = conv2d_patch_grams(
        [x],
        kernel=kernel,
        dilation=dilation,
        stride=stride,
        pad=pad,
        with_ones=with_ones,
        plans=plans,
        precision=precision,
        dtype=dtype,
        im2col=im2col,
        chunks=chunks,
    )
    return grams[0], rows


def conv2d_patch_grams(
    xs: Sequence[Tensor],
    *,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int, int, int],
    with_ones: bool,
    plans: ShiftedGramPlans | None = None,
    precision: GramPrecision = HIGHEST,
    dtype: torch.dtype | None = None,
    im2col: bool | None = None,
    chunks: int | None = None,
) -> tuple[list[Tensor], int]:
    """:func:`conv2d_patch_gram` of each of ``xs``, inputs of one shape, dtype and device.

    The Grams are formed together, in the launches one of them takes (on a GPU a small
    model's factor step waits for the host, which prepares every launch): a stride-1
    convolution's by :func:`shifted_patch_grams` or, where :func:`explicit_patches_pay`, by
    :func:`strided_patch_grams`, as are other strides'; a 1x1 convolution's by
    :func:`~dkfac.curvature.gram.pixel_grams` (its stride-1 inputs; each strided one alone).

    Returns:
        The Grams in the order of ``xs`` (but for a strided 1x1 convolution's, views of one
        stacked tensor), and the number of patches of each.

    Raises:
        ValueError: no inputs, or inputs of different shapes, dtypes or devices.
    """
    if not xs or any(
        x.shape != xs[0].shape or x.dtype != xs[0].dtype or x.device != xs[0].device for x in xs
    ):
        raise ValueError("conv2d_patch_grams needs one or more inputs of one shape and dtype")
    x = xs[0]
    statistics_dtype = x.dtype if dtype is None else dtype
    if kernel == (1, 1) and pad == (0, 0, 0, 0):
        # A 1x1 convolution's patches are its input pixels (every stride-th): their Gram, no
        # plan or blocks (one copy of the input instead of a zeroed layout, a copy and block
        # scatters, or im2col).
        if stride == (1, 1):
            return pixel_grams(xs, statistics_dtype, with_ones, precision)
        strided_pixels = [
            pixel_gram(
                each[:, :, :: stride[0], :: stride[1]],
                statistics_dtype,
                with_ones,
                precision,
            )
            for each in xs
        ]
        return [gram for gram, _ in strided_pixels], strided_pixels[0][1]
    operand = precision.operand_dtype(statistics_dtype)
    geometry = ConvGeometry(int(x.shape[2]), int(x.shape[3]), kernel, dilation, pad)
    if stride == (1, 1) and im2col is None:
        im2col = explicit_patches_pay(geometry, x.device)
    if stride == (1, 1) and not im2col:
        if not torch.compiler.is_compiling():
            plan = (
                plan_shifted_gram(geometry, x.device)
                if plans is None
                else plans.get(geometry, x.device)
            )
            return shifted_patch_grams(xs, plan, with_ones, precision, operand, chunks)
        # Inside torch.compile's tracing, making a plan (unique, nonzero: data-dependent
        # shapes) would break the graph; one made before, outside it, traces whole. Without
        # one, the im2col product (same Gram, other rounding) does.
        cached = None if plans is None else plans.cached(geometry, x.device)
        if cached is not None:
            return shifted_patch_grams(xs, cached, with_ones, precision, operand, chunks)
    return strided_patch_grams(xs, kernel, dilation, stride, pad, with_ones, precision, operand)


#: The most output positions for which a CPU forms a stride-1 patch Gram from im2col
#: (:func:`explicit_patches_pay`): 7x7, where it took 0.54-0.67 of the shifted products' time,
#: against 1.07-1.41 on 8x8.
CPU_IM2COL_MAX_POSITIONS = 49


def explicit_patches_pay(geometry: ConvGeometry, device: torch.device) -> bool:
    """Whether a stride-1 convolution's patch Grams on ``device`` come from im2col matrices.

    The shifted products (:func:`shifted_patch_grams`) spare im2col's ``kh·kw`` copies of the
    input, then correct each block for the positions its window misses, which lie at the
    image's border: on a small output most positions are such ones, and the corrections cost
    more than the copies they spare. On 2 CPU cores (``benchmarks/results/patch_grams_*.json``:
    ResNet-32, ResNet-50 at 32x32 and 224x224, batches 8 and 16, float32 and bf16
    statistics) im2col took 0.35-0.41 of the shifted products' time on 1x1 and 2x2 outputs,
    0.68 on 4x4, 0.54-0.67 on ResNet-50's 7x7 (one and two threads, im2col's Grams in blocks
    since 2026-11-30), 1.07-1.41 on 8x8 and 1.1-5.3 on 14x14 to 56x56 ones (0.54-0.77 on a
    3-channel 32x32 input, which the rule leaves to the shifted products there): a CPU takes
    im2col on outputs of at most :data:`CPU_IM2COL_MAX_POSITIONS` positions of a 2-D kernel,
    or ``kh·kw`` (every position then at the border; a 1-D kernel's rows have border
    positions only at their ends, and a review's probe, on a loaded machine, found im2col
    taking 0.8-3.9 times the shifted products' time on Conv1d outputs of 40-49 positions).

    On a GPU the shifted products are ``C x C`` results of sums over every position (a
    3-channel 32x32 input at batch 128: 8 ms for a product im2col's one launch does in
    0.11 ms), and im2col took 0.01-0.40 of their time on every group of ResNet-32 at batch 128
    on an H200 (float32 and bf16 statistics, docs/benchmarks.md, "The fifth GPU session"): a
    GPU takes im2col wherever its memory rule allows.

    Only an output no larger than the input (``same`` or less padding) takes im2col: its
    patches are then at most ``kh·kw`` times the input, besides the padded layout both ways
    make. An output with no position takes it too (it only returns zeros, with no plan).
    """
    h_out, w_out = geometry.output_size()
    if h_out <= 0 or w_out <= 0:
        return True
    fits = h_out <= geometry.height and w_out <= geometry.width
    if device.type == "cuda":
        return fits
    kh, kw = geometry.kernel
    # A 1-D kernel (a Conv1d's) misses only the ends of each row: not measured beyond kh·kw.
    small = max(CPU_IM2COL_MAX_POSITIONS if kh > 1 and kw > 1 else 0, kh * kw)
    return fits and h_out * w_out <= small


def strided_patch_grams(
    xs: Sequence[Tensor],
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int, int, int],
    with_ones: bool,
    precision: GramPrecision,
    operand: torch.dtype,
) -> tuple[list[Tensor], int]:
    """Patch Grams of inputs of one shape through explicit im2col matrices, for any stride.

    The inputs are laid out once, stacked, as a channels-last copy of the padded input (cast
    to ``operand`` in the same copy); each one's patches are a strided view of its layout, so
    the one copy that materialises them reads and writes whole channel vectors. One batched
    product forms every Gram in ``(i, j, c)`` order, permuted to PyTorch's ``(c, i, j)`` in
    the copy that writes the results: a handful of launches for any number of inputs, against
    a dozen or more for :func:`shifted_patch_grams`, for the patches' memory (``kh·kw·h_out·
    w_out / (h·w)`` times the inputs': ``kh·kw`` times with ``same`` padding at stride 1).

    Returns:
        The Grams in the order of ``xs`` (views of one stack), and the patches of each.
    """
    layers = len(xs)
    n, c, h, w = xs[0].shape
    kh, kw = kernel
    left, right, top, bottom = pad
    hp, wp = h + top + bottom, w + left + right
    h_out = (hp - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (wp - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    side = c * kh * kw + int(with_ones)
    if h_out <= 0 or w_out <= 0:  # no output position: no patch
        out_dtype = precision.output_dtype(operand)
        return [xs[0].new_zeros(side, side, dtype=out_dtype) for _ in xs], 0
    padded = xs[0].new_zeros(layers, n, hp, wp, c, dtype=operand)
    inputs = xs[0].unsqueeze(0) if layers == 1 else torch.stack(list(xs))
    padded[:, :, top : top + h, left : left + w] = inputs.permute(0, 1, 3, 4, 2)
    sl, sn, sh, sw, sc = padded.stride()
    patches = padded.as_strided(
        (layers, n, h_out, w_out, kh, kw, c),
        (sl, sn, stride[0] * sh, stride[1] * sw, dilation[0] * sh, dilation[1] * sw, sc),
    )
    flat = precision.as_read(patches.reshape(layers, -1, kh * kw * c))
    size = c * kh * kw
    reordered = gram(flat, precision).view(layers, kh, kw, c, kh, kw, c)
    reordered = reordered.permute(0, 3, 1, 2, 6, 4, 5)
    rows = flat.shape[1]
    if not with_ones:  # the reordering copy is the result
        return list(reordered.reshape(layers, size, size).unbind(0)), rows
    grams = reordered.new_empty(layers, side, side)
    grams[:, :size, :size].view(layers, c, kh, kw, c, kh, kw).copy_(reordered)
    sums = precision.sum_rows(flat, (1,)).view(layers, kh, kw, c).permute(0, 3, 1, 2)
    fill_border(grams, sums.reshape(layers, size), rows)
    return list(grams.unbind(0)), rows
