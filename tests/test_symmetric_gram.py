"""A Gram formed as its upper block triangle (``dkfac.curvature.gram.gram``), and every
statistic that forms its products through it, against float64 sums.

Round-off is bounded entry by entry by the standard bound of a sum of ``R`` products,
``R·u·(|X|ᵀ|X|)`` (``u``: the accumulation's unit round-off), whichever order the sums run
in, for the blocks and for one whole product alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from devices import CUDA_TEST_DEVICE, needs_cuda
from dkfac.curvature.blocks import LinearBlock
from dkfac.curvature.factors import conv2d_patch_grams, explicit_patches_pay
from dkfac.curvature.gram import (
    SYMMETRIC_BLOCKS,
    SYMMETRIC_MIN_COLUMNS,
    SYMMETRIC_MIN_ROWS,
    GramPrecision,
    gram,
    per_example_products_pay,
    pixel_gram,
    pixel_grams,
    symmetric_blocks,
)
from dkfac.curvature.shifted_gram_plan import ConvGeometry

UNIT = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
BF16 = GramPrecision("bf16")


def within_round_off(got: torch.Tensor, rows: torch.Tensor, unit: float) -> None:
    """``got`` is ``rowsᵀ rows`` (of each matrix of a stack) to the bound of ``R`` sums."""
    exact = rows.double().mT @ rows.double()
    terms = rows.double().abs().mT @ rows.double().abs()
    bound = rows.shape[-2] * unit * terms
    assert got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


class Products(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def rows_of(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(600, 577), (513, 512), (2, 530, 520)], ids=str)
def test_a_wide_gram_is_formed_in_blocks_to_round_off(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    rows = rows_of(*shape, dtype=dtype)
    with Products() as products:
        got = gram(rows)
    assert products.count == SYMMETRIC_BLOCKS  # one product per block row
    within_round_off(got, rows, UNIT[dtype])
    within_round_off(gram(rows, blocks=1), rows, UNIT[dtype])


def test_blocks_off_the_diagonal_are_symmetric_bit_for_bit() -> None:
    rows = rows_of(700, 601)  # blocks of 150, 150, 150 and 151 columns
    got = gram(rows)
    n = rows.shape[1]
    edges = torch.tensor([n * i // SYMMETRIC_BLOCKS for i in range(1, SYMMETRIC_BLOCKS)])
    block = torch.bucketize(torch.arange(n), edges, right=True)  # the block of each column
    assert torch.equal(torch.bincount(block), torch.tensor([150, 150, 150, 151]))
    apart = block.unsqueeze(0) != block.unsqueeze(1)
    assert torch.equal(got[apart], got.T[apart])
    assert not torch.equal(got[~apart], torch.zeros_like(got[~apart]))


@pytest.mark.parametrize(
    "shape",
    [(SYMMETRIC_MIN_ROWS - 1, 4 * SYMMETRIC_MIN_COLUMNS), (1000, SYMMETRIC_MIN_COLUMNS - 1)],
    ids=["few rows", "narrow"],
)
def test_a_narrow_or_short_gram_is_one_product(shape: tuple[int, int]) -> None:
    rows = rows_of(*shape)
    with Products() as products:
        got = gram(rows)
    assert products.count == 1
    assert torch.equal(got, rows.T @ rows)


def test_only_a_cpu_forms_blocks_by_default() -> None:
    """Timed on 2 CPU cores only; a GPU's narrow blocks of tall statistics may be bound by
    memory (docs/benchmarks.md, "A Gram's upper block triangle")."""
    wide = (SYMMETRIC_MIN_ROWS, SYMMETRIC_MIN_COLUMNS)
    assert symmetric_blocks(*wide, torch.device("cpu")) == SYMMETRIC_BLOCKS
    assert symmetric_blocks(*wide, torch.device("cuda")) == 1
    assert symmetric_blocks(*wide, torch.device("meta")) == 1


def test_a_gpu_takes_im2col_wherever_the_output_fits_the_input() -> None:
    """The rule reads the device's type only: a CPU device object stands for the GPU here.
    A 32x32 'same' 3x3 output: shifted products on a CPU, im2col on a GPU; a larger output
    (padding 2) never takes im2col, whose patches would outgrow kh·kw times the input."""
    same = ConvGeometry(32, 32, (3, 3), (1, 1), (1, 1, 1, 1))
    wider = ConvGeometry(32, 32, (3, 3), (1, 1), (2, 2, 2, 2))
    small = ConvGeometry(3, 3, (3, 3), (1, 1), (1, 1, 1, 1))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not explicit_patches_pay(same, cpu) and explicit_patches_pay(same, cuda)
    assert not explicit_patches_pay(wider, cpu) and not explicit_patches_pay(wider, cuda)
    assert explicit_patches_pay(small, cpu) and explicit_patches_pay(small, cuda)


def test_blocks_under_autocast_return_the_products_dtype() -> None:
    rows = rows_of(600, 520)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, blocked = gram(rows, blocks=1), gram(rows)
    assert blocked.dtype == whole.dtype == torch.bfloat16


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["highest", "bf16"])
def test_blocks_on_a_gpu_to_round_off(precision: str) -> None:
    """Forced on a GPU (not its default): a stack, bf16 operands through ``out_dtype``."""
    rows = rows_of(2, 700, 530).to(CUDA_TEST_DEVICE)
    chosen = GramPrecision(precision)
    operands = chosen.operands(rows, torch.float32)
    got = gram(operands, chosen, blocks=SYMMETRIC_BLOCKS)
    assert got.dtype == torch.float32
    within_round_off(got.cpu(), operands.float().cpu(), UNIT[torch.float32])


def test_bf16_blocks_are_the_float32_sums_of_the_rounded_operands() -> None:
    rows = rows_of(600, 520).to(torch.bfloat16)
    got = gram(rows, BF16)
    assert got.dtype == torch.float32
    within_round_off(got, rows.float(), UNIT[torch.float32])


def test_linear_statistics_in_blocks_against_float64_sums() -> None:
    module = nn.Linear(530, 515)
    block = LinearBlock(module)
    xs = [rows_of(4, 150, 530), rows_of(4, 150, 530) + 1.0]
    dys = [rows_of(3, 200, 515), rows_of(3, 200, 515) - 0.5]
    ones = torch.ones(600, 1)
    a_rows = [torch.cat([x.reshape(-1, 530), ones], dim=1) for x in xs]
    with Products() as products:
        alone = block.a_statistic(xs[0], torch.float32)
        stacked = block.a_statistics(xs, torch.float32)
        g_alone = block.g_statistic(dys[0], torch.float32)
        g_stacked = block.g_statistics(dys, torch.float32)
    assert products.count == 4 * SYMMETRIC_BLOCKS  # every one in blocks
    within_round_off(alone.total, a_rows[0], UNIT[torch.float32])
    assert alone.rows == 600
    for statistic, rows in zip(stacked, a_rows, strict=True):
        within_round_off(statistic.total, rows, UNIT[torch.float32])
    within_round_off(g_alone.total, dys[0].reshape(-1, 515), UNIT[torch.float32])
    for statistic, dy in zip(g_stacked, dys, strict=True):
        within_round_off(statistic.total, dy.reshape(-1, 515), UNIT[torch.float32])


def test_im2col_patch_grams_in_blocks_against_float64_sums() -> None:
    """64 channels, 3x3: 576 patch columns and the bias's one, 2·20·20 = 800 patches."""
    xs = [rows_of(2, 64, 20, 20), rows_of(2, 64, 20, 20) * 0.5]
    with Products() as products:
        grams, count = conv2d_patch_grams(
            xs,
            kernel=(3, 3),
            dilation=(1, 1),
            stride=(1, 1),
            pad=(1, 1, 1, 1),
            with_ones=True,
            im2col=True,
        )
    assert products.count == SYMMETRIC_BLOCKS and count == 800
    for got, x in zip(grams, xs, strict=True):
        patches = F.unfold(x, (3, 3), padding=1).transpose(1, 2).reshape(-1, 576)
        within_round_off(got, torch.cat([patches, torch.ones(800, 1)], dim=1), 2.0**-24)


def test_pixel_grams_in_blocks_against_float64_sums() -> None:
    """512 channels on 12x12 positions: the channel-major copy's rows, 4·144 = 576 of them."""
    xs = [rows_of(4, 512, 12, 12), rows_of(4, 512, 12, 12) + 0.25]
    with Products() as products:
        alone, count = pixel_gram(xs[0], torch.float32, with_ones=False)
    assert products.count == SYMMETRIC_BLOCKS and count == 576
    within_round_off(alone, xs[0].transpose(0, 1).reshape(512, -1).T, 2.0**-24)
    with Products() as products:
        grams, _ = pixel_grams(xs, torch.float32, with_ones=False)
    assert products.count == SYMMETRIC_BLOCKS
    for got, x in zip(grams, xs, strict=True):
        within_round_off(got, x.transpose(0, 1).reshape(512, -1).T, 2.0**-24)


class BatchedProducts(TorchDispatchMode):
    """The batch sizes of the batched products run inside it (``bmm`` only)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.bmm.default:
            self.batches.append(int(args[0].shape[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["highest", "bf16"])
def test_per_example_pixel_grams_in_blocks_against_float64_sums(name: str) -> None:
    """256 channels on 32x32 positions (4 per channel: each example's planes' products, batched
    over the examples): each example's Gram in blocks (1024 rows of 256 columns), summed over
    the examples; bf16: of the rounded operands, summed in float32."""
    precision = GramPrecision(name)
    xs = [rows_of(2, 256, 32, 32), rows_of(2, 256, 32, 32) - 0.25]
    assert per_example_products_pay(xs[0].shape)
    rounded = [precision.operands(x, torch.float32).float() for x in xs]
    vectors = [x.transpose(0, 1).reshape(256, -1).T for x in rounded]
    with BatchedProducts() as products:
        alone, count = pixel_gram(xs[0], torch.float32, True, precision)
    assert products.batches == [2] * SYMMETRIC_BLOCKS and count == 2048  # one per example
    assert alone.dtype == torch.float32
    ones = torch.ones(2048, 1)
    within_round_off(alone, torch.cat([vectors[0], ones], dim=1), UNIT[torch.float32])
    with BatchedProducts() as products:
        grams, _ = pixel_grams(xs, torch.float32, False, precision)
    assert products.batches == [4] * SYMMETRIC_BLOCKS  # 2 inputs of 2 examples each
    for got, rows in zip(grams, vectors, strict=True):
        within_round_off(got, rows, UNIT[torch.float32])
