"""Gram matrices of rows and of pixel vectors, and the precision of their products.

The statistics of every K-FAC factor are such Grams (a convolution's patch Gram builds on them
in :mod:`dkfac.curvature.factors`). Their inputs are a layer's activations or output
gradients, the largest tensors K-FAC reads: where a layout has to be copied for the product
(a convolution's pixels), the copy also casts to the products' operand dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: What ``statistics_precision`` may be (:class:`GramPrecision`).
STATISTICS_PRECISIONS = ("highest", "bf16")
#: Whether CUDA's ``mm`` takes ``out_dtype`` (bfloat16 operands, float32 products; torch 2.8
#: on): older versions form the same products by the emulation other devices use.
CUDA_MM_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"


@dataclass(frozen=True)
class GramPrecision:
    """How the products of a factor's statistics are computed.

    ``"highest"``: in the statistics' dtype (``factor_dtype``), as PyTorch's matrix product
    computes it there. ``"bf16"``: the operands rounded to bfloat16 and their products summed
    and returned in float32, which tensor cores run several times faster than float32 products
    (on CUDA one ``mm`` with a float32 output; other devices form the same products of the
    rounded operands in float32, slower, so that CPU tests check the same arithmetic). A
    product of rounded operands is off by up to 2⁻⁸ relatively; a diagonal entry's error
    averages down over the rows, an off-diagonal one of weakly correlated features stays near
    10⁻³: far below a mini-batch estimate's sampling noise, but an approximation the user
    must ask for.

    Attributes:
        name: one of :data:`STATISTICS_PRECISIONS`.
    """

    name: str = "highest"

    def __post_init__(self) -> None:
        if self.name not in STATISTICS_PRECISIONS:
            raise ValueError(
                f"statistics_precision={self.name!r} is not allowed: expected one of "
                f"{', '.join(map(repr, STATISTICS_PRECISIONS))}"
            )

    def operand_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The products' operand dtype for statistics of dtype ``dtype``: it, or bfloat16."""
        return torch.bfloat16 if self.name == "bf16" else dtype

    def operands(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``x`` as the products' operands: in ``dtype``, or rounded to bfloat16."""
        return x.to(self.operand_dtype(dtype))

    def mm(self, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
        """``a @ b`` of two operand matrices, in float32 when they are bfloat16 ones.

        ``out``: where to write it (a slice of a preallocated stack: no stacking copy).
        """
        if self.name != "bf16":
            return a @ b if out is None else torch.mm(a, b, out=out)
        if a.device.type == "cuda" and CUDA_MM_OUT_DTYPE:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        return a.float() @ b.float() if out is None else torch.mm(a.float(), b.float(), out=out)

    def bmm(self, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
        """``a @ b`` of two batches of operand matrices, as :meth:`mm` forms each product.

        ``out``: where to write it, as in :meth:`mm`.
        """
        if self.name != "bf16":
            return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
        if a.device.type == "cuda" and CUDA_MM_OUT_DTYPE:
            if out is None:
                return torch.bmm(a, b, out_dtype=torch.float32)
            return torch.bmm(a, b, out_dtype=torch.float32, out=out)
        wide_a, wide_b = a.float(), b.float()
        return torch.bmm(wide_a, wide_b) if out is None else torch.bmm(wide_a, wide_b, out=out)

    def as_read(self, operands: Tensor) -> Tensor:
        """``operands`` as the products read them: widened to float32 where bf16 is emulated.

        For a layout that many products read through overlapping views (the shifted
        products of a convolution's patch Gram): widened once, instead of each view being
        widened, and materialised, by :meth:`mm` or :meth:`bmm`.
        """
        if self.name == "bf16" and not (operands.device.type == "cuda" and CUDA_MM_OUT_DTYPE):
            return operands.float()
        return operands

    def output_dtype(self, operands: torch.dtype) -> torch.dtype:
        """Dtype of the products of operands of dtype ``operands``."""
        return torch.float32 if self.name == "bf16" else operands

    def sum_rows(self, rows: Tensor, dims: tuple[int, ...] = (0,)) -> Tensor:
        """Sums of ``rows`` over ``dims`` (the rows) in the products' output dtype."""
        return rows.sum(dim=dims, dtype=self.output_dtype(rows.dtype))


#: Products in the statistics' own dtype (the default).
HIGHEST = GramPrecision()

#: Columns and rows from which a CPU forms a Gram as its upper block triangle (:func:`gram`).
#: On 2 CPU cores 4 blocks took 0.67-0.99 of one product's time on the ResNet-50 statistics
#: at batch 8 that a CPU forms by ``gram`` (256 to 4608 columns, 392 to 6272 rows, and each
#: example's 3136 positions; float32 and bf16 operands: 0.78 and 0.77 of the whole; one
#: shape once 1.29, 0.77-0.86 in other runs; ``benchmarks/gram_blocks.py``,
#: docs/benchmarks.md "A Gram's upper block triangle"), and
#: 1.06-3.3 times it on 128 or fewer rows and on 256 rows of 512 columns (a probe of random
#: rows): there the copies of the mirrored blocks and the products' launches outweigh the
#: work spared. A GPU forms one product until timed: its narrow blocks of tall statistics
#: (ResNet-50 at batch 128: 400k rows of 256 columns, blocks 64 wide) may be bound by memory.
SYMMETRIC_MIN_COLUMNS = 256
SYMMETRIC_MIN_ROWS = 384
#: Column blocks of such a Gram: ``(k+1)/2k`` of the products' work, 5/8 at 4.
SYMMETRIC_BLOCKS = 4


def gram(rows: Tensor, precision: GramPrecision = HIGHEST, blocks: int | None = None) -> Tensor:
    """``rowsᵀ rows`` of a ``(R, n)`` matrix or a ``(L, R, n)`` stack, as ``precision`` forms it.

    A Gram is symmetric, and PyTorch has no product that forms half of one. With ``k`` column
    blocks each block's products with itself and the blocks after it are one product (``k``
    products, ``(k+1)/2k`` of the whole product's work), and the blocks below the diagonal
    are copies of those above, transposed: the result is symmetric bit for bit outside the
    diagonal blocks, each of its entries one product's sum as before (a block's sums run
    over the same rows).

    Args:
        rows: the operands (``precision.operand_dtype`` already).
        precision: how the products are formed.
        blocks: the number of column blocks (1: one product; benchmarks compare the two);
            ``None``: as :func:`symmetric_blocks` decides; inside ``torch.compile``'s
            tracing one product (a choice by size would guard, and recompile, on it).
    """
    if blocks is not None:
        count = blocks
    elif torch.compiler.is_compiling():
        count = 1
    else:
        count = symmetric_blocks(rows.shape[-2], rows.shape[-1], rows.device)
    product = precision.mm if rows.dim() == 2 else precision.bmm
    if count <= 1:
        return product(rows.mT, rows)
    n = rows.shape[-1]
    operands = precision.as_read(rows)  # widened once where bf16 products are emulated
    out: Tensor | None = None
    for index in range(count):
        start, end = n * index // count, n * (index + 1) // count
        block_row = product(operands[..., start:end].mT, operands[..., start:])
        if out is None:  # the products' own dtype (an autocast region may choose it)
            out = block_row.new_empty((*rows.shape[:-2], n, n))
        out[..., start:end, start:] = block_row
        if end < n:
            out[..., end:, start:end] = out[..., start:end, end:].mT
    assert out is not None, "count > 1 forms at least one block row"
    return out


def symmetric_blocks(rows: int, columns: int, device: torch.device) -> int:
    """How many column blocks :func:`gram` forms a ``rows`` by ``columns`` Gram in on ``device``.

    :data:`SYMMETRIC_BLOCKS` on a CPU from :data:`SYMMETRIC_MIN_COLUMNS` columns and
    :data:`SYMMETRIC_MIN_ROWS` rows on; else 1 (one product).
    """
    if device.type != "cpu":
        return 1
    if columns >= SYMMETRIC_MIN_COLUMNS and rows >= SYMMETRIC_MIN_ROWS:
        return SYMMETRIC_BLOCKS
    return 1


def gram_with_ones(rows: Tensor, with_ones: bool, precision: GramPrecision = HIGHEST) -> Tensor:
    """``Σ_r [x_r, 1][x_r, 1]ᵀ`` for the rows ``x_r`` of a 2-D tensor.

    The appended constant is never materialised: its row of the Gram is the column sum and its
    corner the row count, so no ``(R, d+1)`` copy of the input is made.
    """
    core = gram(rows, precision)
    if not with_ones:
        return core
    return bordered_gram(core, precision.sum_rows(rows), rows.shape[0])


def bordered_gram(core: Tensor, sums: Tensor, count: int) -> Tensor:
    """``[[core, sums], [sumsᵀ, count]]``: the Gram of rows extended by a constant 1."""
    d = core.shape[0]
    out = core.new_empty(d + 1, d + 1)
    out[:d, :d] = core
    fill_border(out, sums, count)
    return out


def fill_border(out: Tensor, sums: Tensor, count: int) -> None:
    """Write a bordered Gram's last row and column: ``sums``, and ``count`` at the corner.

    ``out`` may be a stack of Grams (leading dims), ``sums`` then one row per Gram.
    """
    d = out.shape[-1] - 1
    out[..., d, :d] = sums
    out[..., :d, d] = sums
    out[..., d, d] = count


#: Positions per channel from which a channels-first tensor's pixel Gram is summed over
#: per-example products of its channel planes, in place of one product of a channel-major
#: copy. Both read the input once; the copy also writes it and reads it again, the per-example
#: products write ``N·C²`` partial sums instead, at most a quarter of the input from this
#: ratio on (provisional: a bound on that memory, not a measured crossover). On 2 CPU cores
#: (ResNet-50's shapes, batch 16, benchmarks/results/pixel_grams_resnet50_cpu.json) float32
#: statistics gain 8-27% from 6 positions per channel on and are 3.7x slower at 0.024; with
#: bf16 statistics the gains are 2-17% and at 12 positions 1% slower (the cast stays).
#: Formed in blocks on a CPU (:func:`gram`), a block row's products, up to a quarter of those
#: partial sums more, are held while they are copied in.
PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL = 4


def pixel_gram(
    x: Tensor,
    dtype: torch.dtype,
    with_ones: bool,
    precision: GramPrecision = HIGHEST,
    per_example: bool | None = None,
) -> tuple[Tensor, int]:
    """``Σ [v, 1][v, 1]ᵀ`` over the channel vectors ``v`` of every position of every example.

    The ``G`` statistic of a convolution and the ``A`` statistic of a 1x1 one, whose patches
    are its input's pixels. ``x`` is ``(N, C, *spatial)`` in any dtype and layout; its
    operands are cast to ``precision.operand_dtype(dtype)`` in the one copy that lays them
    out. With the channels innermost (channels-last) the vectors are rows already: at most
    one cast copy, reading runs of channels. A contiguous channels-first tensor with many
    positions per channel (a network's early, large activations) is summed over per-example
    products of its ``(C, positions)`` planes, which are views: no layout copy at all (a cast
    where the operands' dtype differs). Otherwise the vectors go to ``(C, N·positions)``:
    each example's channel planes move whole, so the copy reads and writes contiguous runs
    (the ``(positions, C)`` rows would be a strided gather, several times slower on a GPU).

    Args:
        x: ``(N, C, *spatial)`` activations or output gradients.
        dtype: the statistics' dtype (``factor_dtype``).
        with_ones: append a constant 1 to every vector (the bias input).
        precision: how the products are formed.
        per_example: force the per-example products (True) or the channel-major copy
            (False) for a contiguous channels-first ``x`` (benchmarks compare the two);
            ``None``: per-example from
            :data:`PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL` positions per channel on.

    Returns:
        The ``(C [+1])`` square Gram and the number of vectors ``N·positions``.
    """
    operand = precision.operand_dtype(dtype)
    channels = x.shape[1]
    last = x.movedim(1, -1)
    # Under torch.compile the layout is the compiler's to choose (and a gradient hook may not
    # branch on strides: that breaks the graph), so only eager code looks at the strides.
    if torch.compiler.is_compiling():
        rows = _laid_out(x.transpose(0, 1), operand).reshape(channels, -1).t()
    elif x.stride(1) == 1:
        rows = last.to(operand) if last.is_contiguous() else _laid_out(last, operand)
        rows = rows.reshape(-1, channels)
    elif x.is_contiguous() and x.numel() and _per_example(x, per_example):
        planes = x.reshape(x.shape[0], channels, -1).to(operand)  # a view unless cast
        core = gram(planes.mT, precision).sum(dim=0)  # each example's planes' Gram
        count = planes.shape[0] * planes.shape[2]
        if not with_ones:
            return core, count
        return bordered_gram(core, precision.sum_rows(planes, (0, 2)), count), count
    else:
        rows = _laid_out(x.transpose(0, 1), operand).reshape(channels, -1).t()
    return gram_with_ones(rows, with_ones, precision), int(rows.shape[0])


def pixel_grams(
    xs: Sequence[Tensor], dtype: torch.dtype, with_ones: bool, precision: GramPrecision = HIGHEST
) -> tuple[list[Tensor], int]:
    """:func:`pixel_gram` of each of ``xs`` (one shape, dtype and device), in one product.

    The inputs are stacked in one copy, cast to the operands' dtype in it: contiguous
    channels-first ones as their per-example ``(C, positions)`` planes where those pay, the
    others as channel vectors (rows). Inputs of different strides (layouts) take
    :func:`pixel_gram` one at a time, as does a single input or a traced call.

    Returns:
        The Grams in the order of ``xs`` (views of one stack), and the vectors of each.
    """
    x = xs[0]
    if len(xs) == 1 or torch.compiler.is_compiling() or any(e.stride() != x.stride() for e in xs):
        alone = [pixel_gram(each, dtype, with_ones, precision) for each in xs]
        return [gram for gram, _ in alone], alone[0][1]
    layers, examples, channels = len(xs), x.shape[0], x.shape[1]
    operand = precision.operand_dtype(dtype)
    if x.is_contiguous() and x.numel() and _per_example(x, None):
        planes = torch.empty((layers, *x.shape), dtype=operand, device=x.device)
        torch.stack(list(xs), out=planes)  # the stack and the cast in one copy
        flat = planes.view(layers * examples, channels, -1)
        products = gram(flat.mT, precision)
        core = products.view(layers, examples, channels, channels).sum(dim=1)
        vectors = planes.view(layers, examples, channels, -1)
        count, sums = examples * vectors.shape[3], precision.sum_rows(vectors, (1, 3))
    else:
        last = x.movedim(1, -1).shape
        rows = torch.empty((layers, *last), dtype=operand, device=x.device)
        torch.stack([each.movedim(1, -1) for each in xs], out=rows)
        rows = rows.view(layers, -1, channels)
        core = gram(rows, precision)
        count, sums = rows.shape[1], precision.sum_rows(rows, (1,))
    if not with_ones:
        return list(core.unbind(0)), count
    grams = core.new_empty(layers, channels + 1, channels + 1)
    grams[:, :channels, :channels] = core
    fill_border(grams, sums, count)
    return list(grams.unbind(0)), count


def _per_example(x: Tensor, forced: bool | None) -> bool:
    """Whether ``x``'s pixel Gram sums per-example products (see :func:`pixel_gram`)."""
    return per_example_products_pay(x.shape) if forced is None else forced


def per_example_products_pay(shape: Sequence[int]) -> bool:
    """Whether a contiguous channels-first tensor's pixel Gram takes per-example products.

    ``shape``: ``(N, C, *spatial)``. The default of :func:`pixel_gram`: from
    :data:`PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL` positions per channel on.
    """
    if len(shape) < 3 or math.prod(shape) == 0:
        return False
    return math.prod(shape[2:]) >= PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL * shape[1]


def _laid_out(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous copy of ``x`` in ``dtype``: the layout and the cast in one pass."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)
