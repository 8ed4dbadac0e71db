"""Shifted patch-Gram products over chunks of rows, against brute-force float64 patches."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import dkfac.curvature.shifted_grams as shifted_grams
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature.factors import conv2d_patch_grams
from dkfac.curvature.gram import GramPrecision
from dkfac.curvature.row_chunks import MIN_CHUNK_ROWS, TARGET_TILES, row_chunks
from dkfac.curvature.shifted_gram_plan import ShiftedGramPlans
from test_factors import brute_force_patch_gram, matrix_products

CUDA = torch.device("cuda")


def random_case(seed: int) -> tuple[dict[str, Any], tuple[int, int, int, int], int]:
    """A stride-1 convolution's options, an input shape and a number of inputs."""
    rng = random.Random(2000 + seed)
    kernel = (rng.randint(1, 4), rng.randint(1, 4))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    pad = tuple(rng.randint(0, 3) for _ in range(4))
    h = max(rng.randint(1, 7), dilation[0] * (kernel[0] - 1) + 1 - pad[2] - pad[3])
    w = max(rng.randint(1, 7), dilation[1] * (kernel[1] - 1) + 1 - pad[0] - pad[1])
    options = {"kernel": kernel, "dilation": dilation, "stride": (1, 1), "pad": pad}
    return options, (rng.randint(1, 3), rng.randint(1, 3), h, w), rng.randint(1, 5)


@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("seed", range(16))
def test_shifted_products_in_chunks_match_brute_force(seed: int, chunks: int) -> None:
    # Chunks of rows change the order of each sum, not its terms: every Gram against its own
    # brute-force patches (float64: to round-off), with and without the bias row, through a
    # layer's plan cache shared with the unchunked path (its border rows are kept per layout).
    options, shape, inputs = random_case(seed)
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(inputs)]
    plans = ShiftedGramPlans()
    for with_ones in (bool(seed % 2), not seed % 2):
        for way in (chunks, chunks + 1, 1):  # one plan: its border rows kept per layout
            grams, rows = conv2d_patch_grams(
                xs, with_ones=with_ones, plans=plans, im2col=False, chunks=way, **options
            )
            for x, got in zip(xs, grams, strict=True):
                want, want_rows = brute_force_patch_gram(
                    x, options["kernel"], options["dilation"], (1, 1), options["pad"], with_ones
                )
                assert rows == want_rows
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_chunked_input_never_meets_another_inputs_values(where: str) -> None:
    # Chunks run across the layouts: a chunk's product reads the next layout's first rows.
    # Zeros at both ends keep those reads against zeros of one's own, and multiplying by
    # zero is not enough (0·inf is NaN): an input with infinities at its first or last pixel
    # leaves the other inputs' Grams finite and exact.
    options = {"kernel": (3, 3), "dilation": (1, 1), "stride": (1, 1), "pad": (1, 1, 1, 1)}
    generator = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3, 5, 6, dtype=torch.float64, generator=generator) for _ in range(3)]
    pixel = (0, 0, 0, 0) if where == "first" else (-1, -1, -1, -1)
    xs[1][pixel] = float("inf")
    grams, _ = conv2d_patch_grams(xs, with_ones=True, im2col=False, chunks=4, **options)
    assert not torch.isfinite(grams[1]).all()
    for index in (0, 2):
        want, _ = brute_force_patch_gram(xs[index], (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), True)
        torch.testing.assert_close(grams[index], want, rtol=1e-12, atol=1e-12)


def test_chunked_shifted_products_take_one_product_per_shift() -> None:
    # A 3x3 kernel: 13 shifts, each one batched product over every input's chunks (whatever
    # the number of inputs), then the border groups' two and the weights' product.
    options = {"kernel": (3, 3), "dilation": (1, 1), "stride": (1, 1), "pad": (1, 1, 1, 1)}
    for inputs in (1, 3, 9):
        xs = [torch.randn(2, 3, 6, 6, dtype=torch.float64) for _ in range(inputs)]
        products = matrix_products(
            lambda xs=xs: conv2d_patch_grams(xs, with_ones=False, im2col=False, chunks=5, **options)
        )
        assert products == ["bmm"] * (13 + 2) + ["mm"]


@pytest.mark.parametrize("inputs", [1, 4])
def test_chunked_bf16_operands_match_their_rounded_values(inputs: int) -> None:
    # statistics_precision="bf16": the chunks' partial sums and their sum in float32, of the
    # bfloat16-rounded inputs (oracle: float64 brute force of the rounded values).
    generator = torch.Generator().manual_seed(inputs)
    xs = [torch.randn(3, 4, 7, 6, generator=generator) for _ in range(inputs)]
    grams, _ = conv2d_patch_grams(
        xs,
        kernel=(3, 3),
        dilation=(1, 1),
        stride=(1, 1),
        pad=(1, 1, 1, 1),
        with_ones=True,
        precision=GramPrecision("bf16"),
        dtype=torch.float32,
        im2col=False,
        chunks=3,
    )
    for x, got in zip(xs, grams, strict=True):
        rounded = x.to(torch.bfloat16).double()
        want, _ = brute_force_patch_gram(rounded, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [0, -1, True, 2.0])
def test_chunks_must_be_a_positive_int(chunks: object) -> None:
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunks="):
        conv2d_patch_grams(
            [x],
            kernel=(3, 3),
            dilation=(1, 1),
            stride=(1, 1),
            pad=(1, 1, 1, 1),
            with_ones=False,
            im2col=False,
            chunks=chunks,  # type: ignore[arg-type]
        )


def test_the_rule_is_not_asked_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    # A choice of chunks by the batch's size, made while torch.compile traces, would guard
    # the graph on that size (a recompilation per batch size). With a rule that cuts rows on
    # this CPU too, eager calls ask it and take its chunks, traced calls do not ask it.
    asked: list[bool] = []

    def every_call_cuts(rows: int, columns: int, products: int, device: torch.device) -> int:
        asked.append(torch.compiler.is_compiling())
        return 3

    monkeypatch.setattr(shifted_grams, "row_chunks", every_call_cuts)
    plans = ShiftedGramPlans()

    def grams(x: torch.Tensor) -> list[torch.Tensor]:
        return conv2d_patch_grams(
            [x, 2 * x],
            kernel=(3, 3),
            dilation=(1, 1),
            stride=(1, 1),
            pad=(1, 1, 1, 1),
            with_ones=True,
            plans=plans,
            im2col=False,
        )[0]

    eager = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    # 13 shifts, 2 border group sizes, the weights, the bias row's sums.
    assert matrix_products(lambda: grams(eager)) == ["bmm"] * (13 + 2) + ["mm", "bmm"]
    assert asked == [False]
    torch._dynamo.reset()
    compiled = torch.compile(grams, backend="eager", dynamic=True)
    for n in (4, 5, 6):
        generator = torch.Generator().manual_seed(n)
        x = torch.randn(n, 2, 6, 6, dtype=torch.float64, generator=generator)
        for scale, got in zip((1, 2), compiled(x), strict=True):
            want, _ = brute_force_patch_gram(scale * x, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), True)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
    assert asked == [False]


def test_a_cpu_never_chunks() -> None:
    assert row_chunks(430_592, 64, 3, torch.device("cpu")) == 1


@pytest.mark.parametrize(
    ("rows", "columns", "products", "expected"),
    [
        # ResNet-50's 56x56 3x3 group at batch 128: a shift's product of 3 inputs, 64 x 64
        # results (3 tiles), over 128·58·58 rows: ceil(512 / 3) chunks (of 2520 rows, with
        # the layouts' zero rows).
        (430_592, 64, 3, 171),
        # Its 7x7 group: 2 results of 512 x 512 (32 tiles) over 128·9·9 rows: 16 chunks
        # wanted, 5 of at least 2048 rows.
        (10_368, 512, 2, 5),
        # Results that fill the GPU alone are not cut.
        (10**6, 2048, 13, 1),
        # Nor rows fewer than two chunks' minimum.
        (2 * MIN_CHUNK_ROWS - 1, 16, 1, 1),
        (2 * MIN_CHUNK_ROWS, 16, 1, 2),
        # Nothing to form.
        (0, 64, 3, 1),
        (100, 0, 3, 1),
    ],
)
def test_a_gpu_cuts_rows_until_the_batch_has_its_tiles(
    rows: int, columns: int, products: int, expected: int
) -> None:
    chunks = row_chunks(rows, columns, products, CUDA)
    assert chunks == expected
    assert chunks == 1 or rows // chunks >= MIN_CHUNK_ROWS
    tiles = products * (-(-columns // 128)) ** 2
    assert chunks == 1 or 0 < (chunks - 1) * tiles < TARGET_TILES


@pytest.mark.parametrize("device", [on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("precision", ["highest", "bf16"])
def test_chunked_products_on_a_gpu_to_round_off(device: str, precision: str) -> None:
    # The device's own choice of chunks (several, for these 64-channel inputs of 24x24 at
    # batch 16) against float64 brute force of the operands' values: the float32 sums' bound
    # relative to their terms' magnitudes (a sum of |a||b| over the patches).
    generator = torch.Generator().manual_seed(7)
    xs = [torch.randn(16, 64, 24, 24, generator=generator) for _ in range(3)]
    gram_precision = GramPrecision(precision)
    span = 16 * 26 * 26
    assert row_chunks(span, 64, 3, torch.device(device)) == 5 or device == "cpu"
    # torch's default: float32 products in IEEE float32 (no TF32), the bound's assumption.
    assert not torch.backends.cuda.matmul.allow_tf32
    grams, _ = conv2d_patch_grams(
        [x.to(device) for x in xs],
        kernel=(3, 3),
        dilation=(1, 1),
        stride=(1, 1),
        pad=(1, 1, 1, 1),
        with_ones=False,
        precision=gram_precision,
        dtype=torch.float32,
        im2col=False,
    )
    for x, got in zip(xs, grams, strict=True):
        exact = x.to(torch.bfloat16).double() if precision == "bf16" else x.double()
        want, rows = brute_force_unfolded(exact)
        magnitudes, _ = brute_force_unfolded(exact.abs())
        bound = rows * 2.0**-24 * magnitudes + 1e-30
        assert ((got.cpu().double() - want).abs() <= bound).all()


def brute_force_unfolded(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The 3x3, padding-1 patch Gram of ``x`` from ``unfold`` (float64 products)."""
    patches = torch.nn.functional.unfold(x, (3, 3), padding=1)  # (N, C·9, positions)
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return rows.T @ rows, rows.shape[0]
