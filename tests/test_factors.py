"""Factor kernels against brute-force float64 formulas on random configurations."""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac.curvature.running_average as running_average_module
import dkfac.curvature.shifted_gram_plan as plan_module
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature.conv_blocks import Conv2dBlock
from dkfac.curvature.factors import conv2d_patch_gram, conv2d_patch_grams
from dkfac.curvature.finite import all_finite, finite_flags
from dkfac.curvature.gram import (
    PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL,
    GramPrecision,
    gram_with_ones,
    pixel_gram,
    pixel_grams,
)
from dkfac.curvature.kronecker_factor import KroneckerFactor, fold_sums
from dkfac.curvature.running_average import (
    _chunk_plan,
    _waves,
    running_average,
    running_averages,
)
from dkfac.curvature.shifted_gram_plan import ShiftedGramPlans


def brute_force_patch_gram(
    x: torch.Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int, int, int],
    with_ones: bool,
) -> tuple[torch.Tensor, int]:
    """Σ a aᵀ with every patch read pixel by pixel from the zero-padded input."""
    n, c, h, w = x.shape
    left, right, top, bottom = pad
    padded = torch.zeros(n, c, h + top + bottom, w + left + right, dtype=x.dtype)
    padded[:, :, top : top + h, left : left + w] = x
    kh, kw = kernel
    h_out = (h + top + bottom - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (w + left + right - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    patches = []
    for b, t1, t2 in itertools.product(range(n), range(h_out), range(w_out)):
        values = [
            padded[b, ch, t1 * stride[0] + i * dilation[0], t2 * stride[1] + j * dilation[1]]
            for ch in range(c)
            for i in range(kh)
            for j in range(kw)
        ]
        if with_ones:
            values.append(torch.tensor(1.0, dtype=x.dtype))
        patches.append(torch.stack(values))
    matrix = torch.stack(patches)
    return matrix.t() @ matrix, matrix.shape[0]


@pytest.mark.parametrize("im2col", [False, True], ids=["shifted", "im2col"])
@pytest.mark.parametrize("seed", range(40))
def test_patch_gram_matches_brute_force_on_random_configurations(seed: int, im2col: bool) -> None:
    # Stride 1 both ways (shifted products, explicit im2col); other strides always im2col.
    rng = random.Random(seed)
    kernel = (rng.randint(1, 4), rng.randint(1, 4))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    stride = (1, 1) if seed % 3 else (rng.randint(1, 3), rng.randint(1, 3))
    pad = tuple(rng.randint(0, 3) for _ in range(4))
    # Sizes from 1 up, but at least one output position.
    h = max(rng.randint(1, 7), dilation[0] * (kernel[0] - 1) + 1 - pad[2] - pad[3])
    w = max(rng.randint(1, 7), dilation[1] * (kernel[1] - 1) + 1 - pad[0] - pad[1])
    x = torch.randn(
        rng.randint(1, 3),
        rng.randint(1, 3),
        h,
        w,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(seed),
    )
    with_ones = bool(seed % 2)
    got, rows = conv2d_patch_gram(
        x,
        kernel=kernel,
        dilation=dilation,
        stride=stride,
        pad=pad,  # type: ignore[arg-type]
        with_ones=with_ones,
        im2col=im2col,
    )
    expected, expected_rows = brute_force_patch_gram(x, kernel, dilation, stride, pad, with_ones)
    assert rows == expected_rows
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_ones", [False, True])
@pytest.mark.parametrize(
    ("dilation", "stride"), [((1, 1), (1, 1)), ((2, 3), (1, 1)), ((1, 1), (2, 3))]
)
def test_a_1x1_convolution_gram_is_its_pixels_gram(
    with_ones: bool, dilation: tuple[int, int], stride: tuple[int, int]
) -> None:
    # The direct path for 1x1 kernels (no padding, any stride: every stride-th pixel) against
    # brute-force patches; channels-last input too (its pixels are already rows), and a
    # float32 input whose statistics are asked for in float64 (cast in the layout's copy).
    x = torch.randn(3, 5, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected, expected_rows = brute_force_patch_gram(
        x, (1, 1), dilation, stride, (0, 0, 0, 0), with_ones
    )
    outputs = ((5 - 1) // stride[0] + 1) * ((7 - 1) // stride[1] + 1)
    single = x.float()
    for layout, dtype in [
        (x, None),
        (x.contiguous(memory_format=torch.channels_last), None),
        (single, torch.float64),
        (single.contiguous(memory_format=torch.channels_last), torch.float64),
    ]:
        got, rows = conv2d_patch_gram(
            layout,
            kernel=(1, 1),
            dilation=dilation,
            stride=stride,
            pad=(0, 0, 0, 0),
            with_ones=with_ones,
            dtype=dtype,
        )
        assert rows == expected_rows == 3 * outputs
        assert got.dtype == torch.float64
        if layout.dtype == torch.float64:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        else:  # exact products of the float32 values
            rounded, _ = brute_force_patch_gram(
                single.double(), (1, 1), dilation, stride, (0, 0, 0, 0), with_ones
            )
            torch.testing.assert_close(got, rounded, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kernel", "stride", "pad"),
    [
        ((3, 3), (1, 1), (1, 1, 1, 1)),
        ((3, 2), (2, 1), (1, 0, 2, 1)),
        ((1, 1), (2, 2), (0, 0, 0, 0)),
    ],
)
def test_float32_inputs_give_float64_statistics_of_their_exact_values(
    kernel: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int, int, int]
) -> None:
    # Every path (shifted Gram, im2col, pixels) casts in its layout copy: float32 values asked
    # for in float64 give the exact float64 Gram of those values, channels-first or -last.
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(4))
    expected, expected_rows = brute_force_patch_gram(x.double(), kernel, (1, 1), stride, pad, True)
    layouts = (x, x.contiguous(memory_format=torch.channels_last))
    for layout, im2col in itertools.product(layouts, (False, True)):  # shifted or im2col
        got, rows = conv2d_patch_gram(
            layout,
            kernel=kernel,
            dilation=(1, 1),
            stride=stride,
            pad=pad,
            with_ones=True,
            dtype=torch.float64,
            im2col=im2col,
        )
        assert rows == expected_rows and got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def outer_product_sum(x: torch.Tensor, with_ones: bool) -> torch.Tensor:
    """Σ [v, 1][v, 1]ᵀ over the channel vectors ``x[n, :, position]``, one by one in float64."""
    grid = x.double().reshape(x.shape[0], x.shape[1], -1)
    total = torch.zeros(x.shape[1] + with_ones, x.shape[1] + with_ones, dtype=torch.float64)
    for n, position in itertools.product(range(grid.shape[0]), range(grid.shape[2])):
        v = grid[n, :, position]
        if with_ones:
            v = torch.cat([v, v.new_ones(1)])
        total += torch.outer(v, v)
    return total


@pytest.mark.parametrize("per_example", [None, True, False])
@pytest.mark.parametrize("with_ones", [False, True])
@pytest.mark.parametrize(
    "shape", [(3, 4, 5, 6), (2, 3, 7), (1, 4, 3, 2), (4, 5), (2, 3, 12), (3, 5, 2, 2)]
)
def test_pixel_gram_sums_every_channel_vector_in_any_layout(
    shape: tuple[int, ...], with_ones: bool, per_example: bool | None
) -> None:
    # Channels-first (per-example products of its planes or a channel-major copy, by default
    # chosen by positions per channel), channels-last (a view), a non-contiguous input, and
    # float32 values cast to float64 (their exact products).
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layouts = [x, x.float(), x.movedim(1, -1).contiguous().movedim(-1, 1)]
    if len(shape) == 4:
        layouts.append(x.transpose(2, 3).contiguous().transpose(2, 3))
    for layout in layouts:
        got, rows = pixel_gram(layout, torch.float64, with_ones, per_example=per_example)
        assert rows == x.numel() // shape[1] and got.dtype == torch.float64
        expected = outer_product_sum(layout, with_ones)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def matrix_products(fn: Callable[[], object]) -> list[str]:
    """Names of the matrix products ``fn`` calls (below autograd)."""
    names: list[str] = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name in ("mm", "bmm"):
                names.append(name)
            return func(*args, **(kwargs or {}))

    with Products():
        fn()
    return names


@pytest.mark.parametrize("with_ones", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (2, 3, 7), (3, 5, 2, 2), (4, 5)])
def test_pixel_grams_of_several_inputs_sum_each_ones_channel_vectors(
    shape: tuple[int, ...], with_ones: bool
) -> None:
    # Several inputs in one stacked copy and product: channels-first (per-example planes where
    # they pay, else rows), channels-last, a transposed layout, float32 cast to float64; and
    # inputs of different layouts (one at a time). Each against its own vectors' sum.
    generator = torch.Generator().manual_seed(4)
    xs = [torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(3)]
    layouts: list[list[torch.Tensor]] = [xs, [x.float() for x in xs]]
    layouts.append([x.movedim(1, -1).contiguous().movedim(-1, 1) for x in xs])
    if len(shape) == 4:
        layouts.append([x.transpose(2, 3).contiguous().transpose(2, 3) for x in xs])
    layouts.append([xs[0], layouts[2][1], xs[2]])
    for inputs in layouts:
        grams, rows = pixel_grams(inputs, torch.float64, with_ones)
        assert rows == xs[0].numel() // shape[1] and len(grams) == len(inputs)
        for x, got in zip(inputs, grams, strict=True):
            assert got.dtype == torch.float64
            expected = outer_product_sum(x, with_ones)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((2, 3, 3, 4), ["bmm"]),  # 12 positions per channel: per-example products
        ((2, 4, 3, 5), ["mm"]),  # 15 of 4 channels: fewer than 4 per channel, one product
        ((2, 3, 12), ["bmm"]),  # a sequence (Conv1d's outputs)
        ((6, 3), ["mm"]),  # no positions: rows
    ],
)
def test_the_pixel_gram_takes_per_example_products_from_four_positions_per_channel(
    shape: tuple[int, ...], expected: list[str]
) -> None:
    # The layout rule itself (the results of both paths are checked above): channels-first
    # tensors with at least PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL positions per channel take
    # one batched product and no channel-major copy; channels-last ones are rows whatever.
    assert PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL == 4
    x = torch.randn(shape)
    assert matrix_products(lambda: pixel_gram(x, torch.float32, True)) == expected
    if x.dim() == 4:
        rows = x.contiguous(memory_format=torch.channels_last)
        assert matrix_products(lambda: pixel_gram(rows, torch.float32, True)) == ["mm"]


@pytest.mark.parametrize(
    ("kernel", "dilation", "pad", "shape", "expected"),
    [
        # 3x3, padding 1: 13 shifts in 3 kernel rows; 8 border groups, 4 corners and 4 edges.
        ((3, 3), (1, 1), (1, 1, 1, 1), (2, 3, 6, 6), ["bmm"] * 5 + ["mm"]),
        # Non-square: the edges are 2 pairs of sizes 4 and 3 besides the corners.
        ((3, 3), (1, 1), (1, 1, 1, 1), (2, 3, 5, 6), ["bmm"] * 6 + ["mm"]),
        # 5x3, dilation (1, 2): 5 kernel rows of shifts.
        ((5, 3), (1, 2), (2, 2, 2, 2), (1, 2, 7, 8), None),
    ],
)
def test_shifted_products_take_one_launch_per_kernel_row_and_group_size(
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    pad: tuple[int, int, int, int],
    shape: tuple[int, int, int, int],
    expected: list[str] | None,
) -> None:
    # On a GPU a small model's factor step waits for the host, which prepares each launch:
    # the shifted products of one kernel row share a batched product, and so do the border
    # groups of one size (results: test_patch_gram_matches_brute_force_on_random_configurations).
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def gram(with_ones: bool) -> tuple[torch.Tensor, int]:
        return conv2d_patch_gram(
            x,
            kernel=kernel,
            dilation=dilation,
            stride=(1, 1),
            pad=pad,
            with_ones=with_ones,
            im2col=False,  # outputs this small take im2col by default on a CPU
        )

    products = matrix_products(lambda: gram(False))
    if expected is None:  # the rows of shifts: kh of them, then the groups and the weights
        assert products[: kernel[0]] == ["bmm"] * kernel[0] and products[-1] == "mm"
    else:
        assert products == expected
    for with_ones in (False, True):
        got, rows = gram(with_ones)
        want, want_rows = brute_force_patch_gram(x, kernel, dilation, (1, 1), pad, with_ones)
        assert rows == want_rows
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("im2col", [False, True], ids=["shifted", "im2col"])
@pytest.mark.parametrize("seed", range(24))
def test_patch_grams_of_several_inputs_each_match_brute_force(seed: int, im2col: bool) -> None:
    # Several inputs of one shape in one set of launches (their layouts one after another):
    # each Gram against its own brute-force patches, and against the one-input path.
    rng = random.Random(1000 + seed)
    kernel = (rng.randint(1, 4), rng.randint(1, 4))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    stride = (1, 1) if seed % 4 else (rng.randint(1, 3), 2)
    pad = tuple(rng.randint(0, 3) for _ in range(4))
    h = max(rng.randint(1, 7), dilation[0] * (kernel[0] - 1) + 1 - pad[2] - pad[3])
    w = max(rng.randint(1, 7), dilation[1] * (kernel[1] - 1) + 1 - pad[0] - pad[1])
    shape = (rng.randint(1, 3), rng.randint(1, 3), h, w)
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(1 + seed % 6)]
    with_ones = bool(seed % 2)
    options: dict[str, Any] = {
        "kernel": kernel,
        "dilation": dilation,
        "stride": stride,
        "pad": pad,
        "with_ones": with_ones,
        "plans": ShiftedGramPlans(),
        "im2col": im2col,
    }
    grams, rows = conv2d_patch_grams(xs, **options)
    assert len(grams) == len(xs)
    for x, got in zip(xs, grams, strict=True):
        expected, want_rows = brute_force_patch_gram(x, kernel, dilation, stride, pad, with_ones)
        assert rows == want_rows
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        alone, _ = conv2d_patch_gram(x, **options)
        torch.testing.assert_close(got, alone, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(("inputs", "shift_products"), [(2, 6), (4, 12), (5, 13), (9, 13)])
def test_several_inputs_take_one_launch_per_shift_and_group_size(
    inputs: int, shift_products: int
) -> None:
    # A 3x3 kernel on 6x6 inputs: 13 shifts in 3 kernel rows, so a product per row of each
    # input up to 4 inputs, one per shift for all of them from 5 on; then one per group size
    # (edges, corners) and the weights' product, whatever the number of inputs.
    xs = [torch.randn(2, 3, 6, 6, dtype=torch.float64) for _ in range(inputs)]
    options: dict[str, Any] = {
        "kernel": (3, 3),
        "dilation": (1, 1),
        "stride": (1, 1),
        "pad": (1, 1, 1, 1),
        "im2col": False,  # 6x6 outputs take im2col by default on a CPU
    }
    products = matrix_products(lambda: conv2d_patch_grams(xs, with_ones=False, **options))
    assert products == ["bmm"] * (shift_products + 2) + ["mm"]
    for with_ones in (False, True):
        grams, _ = conv2d_patch_grams(xs, with_ones=with_ones, **options)
        for x, got in zip(xs, grams, strict=True):
            want, _ = brute_force_patch_gram(x, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), with_ones)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("size", "pad", "dilation", "explicit"),
    [
        (1, 1, 1, True),  # 1x1 output
        (3, 1, 1, True),  # 3x3: as many positions as the kernel
        (4, 1, 1, True),  # 4x4
        (5, 0, 1, True),  # 3x3 output, no padding
        (6, 0, 1, True),  # 4x4
        (6, 1, 2, True),  # 4x4, dilated
        (5, 1, 2, True),  # 3x3, dilated
        (7, 1, 1, True),  # 7x7: CPU_IM2COL_MAX_POSITIONS
        (8, 1, 1, False),  # 8x8
        (9, 0, 1, True),  # 7x7 output, no padding
        (10, 1, 2, False),  # 8x8, dilated
        (1, 2, 1, False),  # 3x3 output of a 1x1 image: patches 81 times the input
    ],
)
def test_small_outputs_take_explicit_patches_on_a_cpu(
    size: int, pad: int, dilation: int, explicit: bool
) -> None:
    # Most positions of such an output are at the border, where the shifted products'
    # corrections cost most: one batched product of im2col matrices forms every Gram instead,
    # up to 7x7 outputs (CPU_IM2COL_MAX_POSITIONS), where an output fits its input.
    xs = [torch.randn(2, 3, size, size, dtype=torch.float64) for _ in range(3)]
    options: dict[str, Any] = {
        "kernel": (3, 3),
        "dilation": (dilation, dilation),
        "stride": (1, 1),
        "pad": (pad,) * 4,
    }
    products = matrix_products(lambda: conv2d_patch_grams(xs, with_ones=False, **options))
    assert (products == ["bmm"]) == explicit
    for with_ones in (False, True):
        grams, rows = conv2d_patch_grams(xs, with_ones=with_ones, **options)
        for x, got in zip(xs, grams, strict=True):
            want, want_rows = brute_force_patch_gram(
                x, (3, 3), (dilation, dilation), (1, 1), (pad,) * 4, with_ones
            )
            assert rows == want_rows
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def assert_zero_grams(
    xs: list[torch.Tensor], stride: tuple[int, int], pad: int, im2col: bool | None
) -> None:
    """Every 3x3 patch Gram of ``xs`` is zero (bias row too), a tensor of its own; no rows."""
    for with_ones in (False, True):
        grams, rows = conv2d_patch_grams(
            xs,
            kernel=(3, 3),
            dilation=(1, 1),
            stride=stride,
            pad=(pad,) * 4,
            with_ones=with_ones,
            im2col=im2col,
        )
        side = xs[0].shape[1] * 9 + with_ones
        assert rows == 0 and len(grams) == len(xs) == len({id(gram) for gram in grams})
        for gram in grams:
            assert torch.equal(gram, torch.zeros(side, side, dtype=torch.float64))


@pytest.mark.parametrize("im2col", [None, True], ids=["default", "im2col"])
@pytest.mark.parametrize("stride", [(1, 1), (2, 1)])
def test_an_output_without_positions_has_zero_grams(
    im2col: bool | None, stride: tuple[int, int]
) -> None:
    # A 3x3 kernel, unpadded, on 2x5 images: no output row, no patch.
    assert_zero_grams(
        [torch.randn(2, 3, 2, 5, dtype=torch.float64) for _ in range(3)], stride, 0, im2col
    )


@pytest.mark.parametrize("im2col", [None, False, True], ids=["default", "shifted", "im2col"])
def test_an_empty_batch_has_zero_grams_whichever_way_is_asked(im2col: bool | None) -> None:
    # No example, no patch, either way (the shifted products' border gathers cannot shape
    # zero rows: they return the zeros first).
    assert_zero_grams(
        [torch.randn(0, 3, 6, 6, dtype=torch.float64) for _ in range(2)], (1, 1), 1, im2col
    )


@pytest.mark.parametrize("im2col", [False, True], ids=["shifted", "im2col"])
@pytest.mark.parametrize("inputs", [3, 6])
def test_several_inputs_in_bf16_operands_match_their_rounded_values(
    inputs: int, im2col: bool
) -> None:
    # statistics_precision="bf16": each Gram is that of its bfloat16-rounded input, summed in
    # float32 (oracle: float64 brute force of the rounded values), both ways.
    generator = torch.Generator().manual_seed(inputs)
    xs = [torch.randn(2, 3, 5, 6, generator=generator) for _ in range(inputs)]
    grams, _ = conv2d_patch_grams(
        xs,
        kernel=(3, 3),
        dilation=(1, 1),
        stride=(1, 1),
        pad=(1, 1, 1, 1),
        with_ones=True,
        precision=GramPrecision("bf16"),
        dtype=torch.float32,
        im2col=im2col,
    )
    for x, got in zip(xs, grams, strict=True):
        rounded = x.to(torch.bfloat16).double()
        want, _ = brute_force_patch_gram(rounded, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_patch_grams_refuse_inputs_of_different_shapes_or_dtypes() -> None:
    options: dict[str, Any] = {
        "kernel": (3, 3),
        "dilation": (1, 1),
        "stride": (1, 1),
        "pad": (1, 1, 1, 1),
        "with_ones": False,
    }
    x = torch.randn(2, 3, 6, 6)
    for others in ([], [x, torch.randn(2, 3, 6, 5)], [x, x.double()]):
        with pytest.raises(ValueError, match="one or more inputs of one shape and dtype"):
            conv2d_patch_grams(others, **options)


def test_a_compiled_patch_gram_is_not_specialised_on_the_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The plan caches border rows per batch size for eager calls; a traced call must not
    # even look them up (a lookup keyed by the size pins the graph to it: one recompilation
    # per batch size, as the review of the cache found). Oracle: the graphs compiled with
    # the cache never consulted (torch 2.13: one; 2.11 specialises elsewhere too).
    from torch._dynamo.utils import counters

    def graphs(rows_cache: bool) -> int:
        plans = ShiftedGramPlans()

        def gram(x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return conv2d_patch_gram(
                x,
                kernel=(3, 3),
                dilation=(1, 1),
                stride=(1, 1),
                pad=(1, 1, 1, 1),
                with_ones=True,
                plans=plans,
                im2col=False,  # the shifted products, whose border rows the cache keeps
            )

        if not rows_cache:

            def uncached(
                plan: plan_module.ShiftedGramPlan,
                examples: int,
                layers: int = 1,
                head: int = 0,
                length: int | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                assert (layers, head) == (1, 0)  # one input, unchunked on a CPU
                per_example = torch.arange(examples) * (plan.hp * plan.wp)
                rows = (plan.border[:, None] + per_example).flatten()
                return rows, rows[:, None] + plan.offsets

            monkeypatch.setattr(plan_module.ShiftedGramPlan, "border_rows", uncached)
        gram(torch.randn(4, 2, 5, 5, dtype=torch.float64))  # the plan, and eager cache entries
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(gram, backend="eager", dynamic=True)
        for n in (4, 4, 5, 6, 7, 4):
            generator = torch.Generator().manual_seed(n)
            x = torch.randn(n, 2, 5, 5, dtype=torch.float64, generator=generator)
            got, rows = compiled(x)
            want, want_rows = brute_force_patch_gram(x, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), True)
            assert rows == want_rows
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        count = int(counters["stats"]["unique_graphs"])
        torch._dynamo.reset()
        return count

    assert graphs(rows_cache=True) == graphs(rows_cache=False)


def unfold_patch_gram(x: torch.Tensor, conv: nn.Conv2d) -> tuple[torch.Tensor, int]:
    """Σ a aᵀ (plus the bias 1) over the ``F.unfold`` patches of ``conv``'s input, in float64."""
    assert not isinstance(conv.padding, str)
    cols = F.unfold(
        x.double(), conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=1
    )  # (N, C·kh·kw, L), PyTorch's (c, i, j) patch order
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    if conv.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows.t() @ rows, rows.shape[0]


def test_conv_a_factor_over_alternating_input_sizes_never_uses_a_stale_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One stride-1 Conv2d layer (asymmetric kernel, dilation and padding) fed more distinct
    # input sizes than its plan cache holds, alternating so that sizes come back after they
    # were evicted (re-planned) and while still cached (reused). Sizes that share a height,
    # a width, or are each other's transpose catch a plan keyed on too little.
    conv = nn.Conv2d(2, 3, kernel_size=(3, 2), dilation=(1, 2), padding=(1, 2), bias=True)
    block = Conv2dBlock(conv)
    bound = ShiftedGramPlans.MAX_PLANS
    sizes = [(4, 5), (5, 4), (4, 7), (6, 5), (3, 3), (7, 4), (5, 6), (2, 9), (9, 2), (6, 6)]
    assert len(sizes) > bound
    order = sizes + sizes[::-1] + sizes[::2] + sizes[1::2] + [sizes[0], sizes[-1]] * 3
    planned: list[plan_module.ConvGeometry] = []
    plan = plan_module.plan_shifted_gram

    def counting_plan(
        geometry: plan_module.ConvGeometry, device: torch.device
    ) -> plan_module.ShiftedGramPlan:
        planned.append(geometry)
        return plan(geometry, device)

    monkeypatch.setattr(plan_module, "plan_shifted_gram", counting_plan)
    generator = torch.Generator().manual_seed(0)
    for step, (h, w) in enumerate(order):
        x = torch.randn(1 + step % 3, 2, h, w, dtype=torch.float64, generator=generator)
        got = block.a_statistic(x, torch.float64)
        expected, rows = unfold_patch_gram(x, conv)
        assert (got.rows, got.examples) == (rows, x.shape[0]), (h, w)
        torch.testing.assert_close(got.total, expected, rtol=1e-10, atol=1e-10)
        assert len(block.gram_plans) <= bound
    # Evicted sizes were planned again, cached ones were reused.
    assert len(sizes) < len(planned) < len(order)
    assert {(g.height, g.width) for g in planned} == set(sizes)


def test_gram_with_ones_appends_the_constant() -> None:
    rows = torch.randn(7, 3, dtype=torch.float64)
    extended = torch.cat([rows, torch.ones(7, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(gram_with_ones(rows, True), extended.t() @ extended)
    torch.testing.assert_close(gram_with_ones(rows, False), rows.t() @ rows)


def test_running_average_formula_and_non_finite_batches() -> None:
    first = torch.randn(3, 3, dtype=torch.float64)
    second = torch.randn(3, 3, dtype=torch.float64)
    running = running_average(None, first, 0.9)
    assert torch.equal(running, first)
    torch.testing.assert_close(running_average(running, second, 0.9), 0.9 * first + 0.1 * second)
    bad = second.clone()
    bad[0, 1] = float("inf")
    assert torch.equal(running_average(running, bad, 0.9), running)
    assert torch.isnan(running_average(None, bad, 0.9)).all()  # "no estimate yet"
    torch.testing.assert_close(
        running_average(torch.full((3, 3), float("nan"), dtype=torch.float64), second, 0.9), second
    )


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_isfinite_everywhere(dtype: torch.dtype, device: str) -> None:
    # Oracle: torch.isfinite(t).all(), on every shape the checks meet (empty, a scalar, a
    # vector, a transposed matrix, a batch) and with a NaN, +Inf or -Inf at every place a
    # reduction could lose it (first, last, middle of a large tensor).
    torch.manual_seed(0)
    shapes = [(0,), (), (7,), (5, 3), (3, 700, 5), (260, 260)]  # the last: CPU reduces in chunks
    for shape, bad, where in itertools.product(
        shapes, [None, float("nan"), float("inf"), float("-inf")], ["first", "middle", "last"]
    ):
        tensor = torch.randn(shape, dtype=torch.float64).to(device, dtype)
        if tensor.dim() == 2:
            tensor = tensor.t()  # not contiguous
        if bad is not None and tensor.numel():
            index = {"first": 0, "middle": tensor.numel() // 2, "last": tensor.numel() - 1}[where]
            tensor[torch.unravel_index(torch.tensor(index), tensor.shape)] = bad
        want = bool(torch.isfinite(tensor).all())
        assert bool(all_finite(tensor)) is want, (shape, bad, where)
        assert finite_flags([tensor]).tolist() == [want], (shape, bad, where)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
def test_finite_flags_of_mixed_dtypes_checked_together(device: str) -> None:
    # The extremes of all tensors are checked in one promoted stack: each dtype's largest
    # finite value must stay finite there, and a NaN or Inf of any one tensor mark it alone.
    # Oracle: torch.isfinite(t).all() of each.
    tensors = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        top = torch.finfo(dtype).max
        tensors += [
            torch.tensor([top, -top], dtype=dtype),
            torch.tensor([1.0, float("inf")], dtype=dtype),
            torch.tensor([float("nan"), 2.0], dtype=dtype),
            torch.tensor([float("-inf")], dtype=dtype),
            torch.empty(0, dtype=dtype),
        ]
    tensors = [t.to(device) for t in tensors]
    want = [bool(torch.isfinite(t).all()) for t in tensors]
    assert want.count(True) == 8
    assert finite_flags(tensors).tolist() == want
    assert finite_flags(tensors[::-1]).tolist() == want[::-1]


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_many_factors_fold_together_exactly_as_one_at_a_time(
    dtype: torch.dtype, device: str
) -> None:
    # Every case of the rule at once: both finite, a NaN or an Inf batch (kept), an average
    # with no estimate yet (NaN: the batch is taken), and both bad. Oracle: the float64
    # formula ``0.9·running + 0.1·batch`` where both are finite; the one-at-a-time path must
    # agree bit for bit (mixed paths would give replicas different bits).
    torch.manual_seed(0)
    sizes = [3, 5, 4, 6, 2, 1]
    # A large factor too: a GPU reduces it in many blocks, and NaN must survive all of them.
    sizes = [*sizes, 700]
    runnings = [torch.randn(d, d, dtype=torch.float64).to(device, dtype) for d in sizes]
    batches = [torch.randn(d, d, dtype=torch.float64).to(device, dtype) for d in sizes]
    batches[6][456, 321] = float("nan")
    batches[1][2, 3] = float("nan")
    batches[2][0, 0] = float("-inf")
    runnings[3].fill_(float("nan"))
    runnings[4].fill_(float("nan"))
    batches[4][1, 1] = float("inf")
    flags = [True, False, False, True, False, True, False]
    assert finite_flags(batches).tolist() == flags
    folded, batch_ok = running_averages(runnings, batches, 0.9)
    assert batch_ok.tolist() == flags
    for index, (new, old, batch) in enumerate(zip(folded, runnings, batches, strict=True)):
        torch.testing.assert_close(
            new, running_average(old, batch, 0.9), rtol=0, atol=0, equal_nan=True
        )
        if index in (0, 5):
            expected = 0.9 * old.double() + 0.1 * batch.double()
            tolerance = {torch.float64: 1e-15, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
            torch.testing.assert_close(new.double(), expected, rtol=tolerance, atol=tolerance)
        elif index in (1, 2, 6):
            assert torch.equal(new, old)
        elif index == 3:
            assert torch.equal(new, batch)
        else:
            assert torch.isnan(new).all()


def _stacking_case(
    dtype: torch.dtype, device: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Averages, sums and counts of 11 factors of 3 shapes (a diagonal one too), in mixed
    order, with every case of the rule inside the stacks: a NaN or Inf sum, an average with
    no estimate, both bad, and factors with no statistics (count 0)."""
    torch.manual_seed(0)
    shapes = [(5, 5), (3, 3), (5, 5), (7,), (5, 5), (3, 3), (5, 5), (7,), (3, 3), (5, 5), (3, 3)]
    runnings = [torch.randn(s, dtype=torch.float64).to(device, dtype) for s in shapes]
    totals = [(torch.randn(s, dtype=torch.float64) * 40).to(device, dtype) for s in shapes]
    totals[2][1, 3] = float("nan")
    totals[5][0, 0] = float("-inf")
    totals[7][6] = float("inf")
    runnings[4].fill_(float("nan"))
    runnings[8].fill_(float("nan"))
    totals[8][2, 1] = float("nan")
    counts = torch.tensor([3, 8, 5, 2, 1, 0, 6, 4, 9, 0, 70000], dtype=torch.float64)
    return runnings, totals, counts.to(device)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_stacked_folds_equal_folds_one_at_a_time_bit_for_bit(
    dtype: torch.dtype, device: str
) -> None:
    # Stacking changes which operation computes an entry, never its arithmetic: stacks of
    # whole groups, stacks split in chunks of two 5x5 factors, and one factor at a time must
    # agree bit for bit; each with the one-factor formula (running_average of the sum divided
    # by its device count in float32 at least), and that with the float64 oracle
    # 0.9·running + 0.1·total/count where all is finite. Neither the averages nor the sums
    # given are written.
    runnings, totals, counts = _stacking_case(dtype, device)
    given = [t.clone() for t in runnings + totals]
    present = counts > 0
    pair = 2 * 25 * totals[0].element_size()  # bytes of two 5x5 factors
    plan = _chunk_plan(totals, pair)
    assert [spec.indices for spec in plan if spec.shape == (5, 5)] == [[0, 2], [4, 6], [9]]
    # Stacked one wave at a time, each wave's stacked sums within the bound: three waves.
    waves = _waves(plan, pair)
    assert len(waves) == 3 and all(sum(s.stacked_bytes for s in w) <= pair for w in waves)
    results = {}
    for stack_bytes in (0, pair, 1 << 20):
        results[stack_bytes] = running_averages(
            runnings, totals, 0.9, present, counts.clamp_min(1.0), stack_bytes
        )
    for mine, before in zip(runnings + totals, given, strict=True):
        torch.testing.assert_close(mine, before, rtol=0, atol=0, equal_nan=True)
    flags = [True, True, False, True, True, False, True, False, False, True, True]
    for folded, batch_ok in results.values():
        assert batch_ok.tolist() == flags
        for new, other in zip(folded, results[0][0], strict=True):
            torch.testing.assert_close(new, other, rtol=0, atol=0, equal_nan=True)
    wide = torch.promote_types(dtype, torch.float32)
    for index, new in enumerate(results[1 << 20][0]):
        old, total, count = runnings[index], totals[index], counts[index]
        if count == 0:
            assert torch.equal(new, old)  # no statistics: kept
            continue
        batch = (total.to(wide) / count.to(wide)).to(dtype)
        torch.testing.assert_close(
            new, running_average(old, batch, 0.9), rtol=0, atol=0, equal_nan=True
        )
        if index in (0, 1, 3, 6, 10):
            expected = 0.9 * old.double() + 0.1 * total.double() / float(count)
            tolerance = {torch.float64: 1e-14, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(new.double(), expected, rtol=tolerance, atol=tolerance)
        elif index in (2, 7):
            assert torch.equal(new, old)  # non-finite batch dropped
        elif index == 4:
            assert torch.equal(new, batch)  # no estimate yet: the batch
        else:
            assert torch.isnan(new).all()  # both bad: still no estimate


def test_a_wave_of_stacks_is_freed_before_the_next_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stacks of one wave at a time: when a chunk of wave w is stacked, no stack made for an
    # earlier wave is alive any more (the bound on a step's extra memory). Three waves.
    runnings, totals, counts = _stacking_case(torch.float32, "cpu")
    pair = 2 * 25 * totals[0].element_size()
    waves = _waves(_chunk_plan(totals, pair), pair)
    wave_of = {spec.start: w for w, wave in enumerate(waves) for spec in wave}
    made: list[tuple[int, weakref.ref[torch.Tensor]]] = []
    original = running_average_module._Chunk.__init__

    def spy(chunk: Any, spec: Any, *args: Any) -> None:
        wave = wave_of[spec.start]
        alive = [w for w, ref in made if w < wave and ref() is not None]
        assert alive == [], (wave, alive)
        original(chunk, spec, *args)
        if not chunk.alone:
            made.extend((wave, weakref.ref(t)) for t in (chunk.batches, chunk.runnings))

    monkeypatch.setattr(running_average_module._Chunk, "__init__", spy)
    running_averages(runnings, totals, 0.9, counts > 0, counts.clamp_min(1.0), pair)
    assert {w for w, _ in made} == {0, 1, 2}


def test_no_factors_fold_to_nothing() -> None:
    folded, ok = running_averages([], [], 0.9, stack_bytes=1 << 20)
    assert folded == [] and ok.shape == (0,)


def test_stacked_factors_without_divisors_fold_and_leave_the_batches_alone() -> None:
    # Batches that are factors already (no counts): stacked and one at a time agree bit for
    # bit, and the caller's batches are not written (the selects write only into copies).
    runnings, totals, _ = _stacking_case(torch.float32, "cpu")
    given = [t.clone() for t in totals]
    stacked, ok = running_averages(runnings, totals, 0.9, stack_bytes=1 << 20)
    alone, ok_alone = running_averages(runnings, totals, 0.9)
    assert torch.equal(ok, ok_alone)
    for new, other in zip(stacked, alone, strict=True):
        torch.testing.assert_close(new, other, rtol=0, atol=0, equal_nan=True)
    for mine, before in zip(totals, given, strict=True):
        torch.testing.assert_close(mine, before, rtol=0, atol=0, equal_nan=True)


def test_a_second_stacked_fold_takes_the_averages_stack_without_copying_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After a stacked fold each average is a row of one stack; folding the same factors
    # again stacks only the sums, and writes the new averages elsewhere (the first fold's
    # stack, which a state_dict may hold, is unchanged). The same rows in another order are
    # stacked anew. Oracle for the values: the same folds one at a time.
    runnings, totals, counts = _stacking_case(torch.float32, "cpu")
    present, divisors = counts > 0, counts.clamp_min(1.0)
    first, _ = running_averages(runnings, totals, 0.9, present, divisors, 1 << 20)
    held = [average.clone() for average in first]
    stacked: list[torch.Tensor] = []
    original = torch.stack

    def spy(tensors: list[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        stacked.extend(tensors)
        return original(tensors, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "stack", spy)
    second, _ = running_averages(first, totals, 0.9, present, divisors, 1 << 20)
    monkeypatch.undo()
    assert not any(any(t is average for t in stacked) for average in first)
    assert any(any(t is total for t in stacked) for total in totals)  # the sums were stacked
    for average, before in zip(first, held, strict=True):
        torch.testing.assert_close(average, before, rtol=0, atol=0, equal_nan=True)
    alone, _ = running_averages(runnings, totals, 0.9, present, divisors, 0)
    alone, _ = running_averages(alone, totals, 0.9, present, divisors, 0)
    for new, other in zip(second, alone, strict=True):
        torch.testing.assert_close(new, other, rtol=0, atol=0, equal_nan=True)
    # The five 5x5 averages, rows of one stack, given with the first two swapped: stacked anew.
    order = [2, 0, 4, 6, 9]
    swapped, _ = running_averages(
        [first[i] for i in order], [totals[i] for i in order], 0.9, stack_bytes=1 << 20
    )
    one_by_one, _ = running_averages([first[i] for i in order], [totals[i] for i in order], 0.9)
    for new, other in zip(swapped, one_by_one, strict=True):
        torch.testing.assert_close(new, other, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("batch_dtype", [torch.float64, torch.bfloat16])
def test_a_batch_of_another_dtype_folds_promoted_as_before(batch_dtype: torch.dtype) -> None:
    # A running factor loaded with another factor_dtype meets batches of the layer's dtype:
    # the blend runs in the wider dtype (as ε·running + (1−ε)·batch promoted), never raises.
    running = torch.randn(4, 4, dtype=torch.float64).float()
    batch = torch.randn(4, 4, dtype=torch.float64).to(batch_dtype)
    factors = [KroneckerFactor("a", 4, batch_dtype), KroneckerFactor("a", 4, batch_dtype)]
    factors[0].running = running.clone()
    factors[1].running = running.clone()
    fold_sums(factors, [batch, batch.clone()], torch.ones(2, dtype=torch.float64), 0.9)
    wide = torch.promote_types(torch.float32, batch_dtype)
    expected = 0.9 * running.double() + 0.1 * batch.double()
    for factor in factors:
        assert factor.value().dtype == wide
        torch.testing.assert_close(factor.value().double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stack_bytes", [0, 1 << 20])
def test_fold_sums_counts_dropped_batches_like_fold(stack_bytes: int) -> None:
    def factors() -> list[KroneckerFactor]:
        made = [KroneckerFactor("a", 3, torch.float32) for _ in range(3)]
        for factor in made:
            factor.running = torch.eye(3)
        return made

    batches = [torch.ones(3, 3), torch.full((3, 3), float("nan")), torch.zeros(3, 3)]
    together, alone = factors(), factors()
    ones = torch.ones(3, dtype=torch.float64)
    fold_sums(together, batches, ones, 0.5, stack_bytes=stack_bytes)
    fold_sums(together, batches, ones, 0.5, stack_bytes=stack_bytes)
    for factor, batch in zip(alone, batches, strict=True):
        factor.fold(batch, 0.5)
        factor.fold(batch, 0.5)
    for one, other in zip(together, alone, strict=True):
        assert torch.equal(one.value(), other.value())
    dropped = [[int(f.take_nonfinite_count()) for f in made] for made in (together, alone)]
    assert dropped == [[0, 2, 0], [0, 2, 0]]
    torch.testing.assert_close(together[0].value(), 0.25 * torch.eye(3) + 0.75 * torch.ones(3, 3))
