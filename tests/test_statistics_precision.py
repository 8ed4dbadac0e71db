"""``statistics_precision="bf16"``: products of bfloat16-rounded operands, summed in float32.

Oracle: the float64 Gram of the operands rounded to bfloat16 (im2col by ``F.unfold`` for
convolutions), which the bf16 statistics must equal to float32 accumulation; each test also
checks that the result is *not* the unrounded Gram, so it cannot pass on the float32 path.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature.block_types import make_block
from dkfac.curvature.blocks import FactorStatistic, LinearBlock
from dkfac.curvature.gram import GramPrecision
from test_layer_blocks import Conv1D

BF16 = GramPrecision("bf16")
DEVICES = ["cpu", on_cuda(str(CUDA_TEST_DEVICE))]


def rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16, in float64."""
    return t.to(torch.bfloat16).double()


def input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows ``a`` of ``A``'s sum (im2col patches of a convolution, plus the bias 1)."""
    if isinstance(module, nn.Linear | Conv1D):
        rows = x.reshape(-1, x.shape[-1])
    else:
        assert isinstance(module, nn.Conv1d | nn.Conv2d) and not isinstance(module.padding, str)
        image = x.unsqueeze(2) if isinstance(module, nn.Conv1d) else x
        pairs = (lambda v: (1, v[0])) if isinstance(module, nn.Conv1d) else (lambda v: tuple(v))
        padding = (0, module.padding[0]) if isinstance(module, nn.Conv1d) else module.padding
        if module.padding_mode != "zeros":  # padded here, as the convolution pads
            widths = [width for width in reversed(padding) for _ in (0, 1)]
            image, padding = F.pad(image, widths, mode=module.padding_mode), (0, 0)
        cols = F.unfold(
            image,
            pairs(module.kernel_size),
            dilation=pairs(module.dilation),
            padding=padding,
            stride=pairs(module.stride),
        )
        rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    if module.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def output_rows(module: nn.Module, dy: torch.Tensor) -> torch.Tensor:
    """The rows of ``G``'s sum: every position of every example, channels last."""
    if isinstance(module, nn.Linear | Conv1D):
        return dy.reshape(-1, dy.shape[-1])
    return dy.movedim(1, -1).reshape(-1, dy.shape[1])


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (lambda: nn.Linear(7, 5), (6, 7)),
    "linear_sequence_no_bias": (lambda: nn.Linear(7, 5, bias=False), (2, 3, 7)),
    "conv_stride1_shifted_gram": (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 8, 9)),
    "conv_strided_im2col": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 6)),
    "conv_1x1_pixels": (lambda: nn.Conv2d(3, 4, 1), (2, 3, 5, 4)),
    # 6 positions of 5 and 6 channels: pixels copied channel-major (the others' G and 1x1 A,
    # with at least 4 positions per channel, are per-example products of channel planes).
    "conv_1x1_few_positions": (lambda: nn.Conv2d(6, 5, 1), (2, 6, 2, 3)),
    "conv_1x1_strided_pixels": (lambda: nn.Conv2d(3, 4, 1, stride=2, bias=False), (2, 3, 5, 4)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1, bias=False), (2, 3, 8)),
    "conv_reflect_padding": (
        lambda: nn.Conv2d(3, 4, (3, 2), padding=(1, 2), padding_mode="reflect"),
        (2, 3, 7, 8),  # 7x11 outputs: shifted products on a CPU
    ),
    "transformers_conv1d": (lambda: Conv1D(5, 7), (2, 3, 7)),
}


def assert_bf16_gram(got: torch.Tensor, rows: torch.Tensor, rounds: bool = True) -> None:
    """``got`` is the Gram of ``rows`` rounded to bfloat16, in float32; not the exact one
    where rounding changes ``rows`` (``rounds``)."""
    assert got.dtype == torch.float32
    expected = rounded(rows).t() @ rounded(rows)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5 * scale)
    exact = rows.double().t() @ rows.double()
    assert (float((got.double().cpu() - exact).abs().max()) > 1e-4 * scale) == rounds


#: Each layer with its inputs as made, and the convolutions' also in channels-last format
#: (their pixel rows are then a view, or a strided one after a 1x1 convolution's stride).
LAYOUTS = [(name, False) for name in sorted(LAYERS)] + [
    (name, True)
    for name in (
        "conv_stride1_shifted_gram",
        "conv_1x1_pixels",
        "conv_1x1_few_positions",
        "conv_1x1_strided_pixels",
    )
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layer", "channels_last"), LAYOUTS)
def test_bf16_statistics_are_the_float32_sums_of_bf16_rounded_products(
    layer: str, channels_last: bool, device: str
) -> None:
    build, shape = LAYERS[layer]
    torch.manual_seed(0)
    module = build().to(device)
    block = make_block(module)
    assert block is not None
    block.precision = BF16

    def tensor(size: tuple[int, ...] | torch.Size) -> torch.Tensor:
        made = torch.randn(size, device=device)
        return made.contiguous(memory_format=torch.channels_last) if channels_last else made

    x = tensor(shape)
    a = block.a_statistic(x, torch.float32)
    assert_bf16_gram(a.total, input_rows(module, x.cpu().double()))
    # Under autocast a layer sees float16/bfloat16 inputs: rounded from those.
    for amp_dtype in (torch.float16, torch.bfloat16):
        low = x.to(amp_dtype)
        rows = input_rows(module, low.cpu().double())
        got = block.a_statistic(low, torch.float32).total
        assert_bf16_gram(got, rows, rounds=amp_dtype == torch.float16)
    dy = tensor(module(x).shape)
    g = block.g_statistic(dy, torch.float32)
    assert_bf16_gram(g.total, output_rows(module, dy.cpu().double()))
    assert (a.rows, g.rows) == (input_rows(module, x).shape[0], output_rows(module, dy).shape[0])


@pytest.mark.parametrize("device", DEVICES)
def test_the_preconditioner_forms_bf16_factors_from_the_layers_own_inputs(device: str) -> None:
    # The whole path (hooks, counts, normalisation): after one step the running factors are
    # the rounded operands' Grams over the rows (A) and, for G, N times the Gram of the output
    # gradients of the mean loss (the per-example gradients are N·dy, averaged over N).
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    ).to(device)
    seen: dict[nn.Module, list[torch.Tensor]] = {}

    def keep_input(module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        seen[module] = [args[0]]

    def keep_output_grad(module: nn.Module, gin: object, gout: tuple[torch.Tensor]) -> None:
        seen[module].append(gout[0])

    for module in (model[0], model[3]):
        module.register_forward_hook(keep_input)
        module.register_full_backward_hook(keep_output_grad)
    pre = dkfac.KFACPreconditioner(model, statistics_precision="bf16")
    x, y = torch.randn(6, 3, 5, 5, device=device), torch.randint(0, 3, (6,), device=device)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    factors = pre.factors()
    for name, module in (("0", model[0]), ("3", model[3])):
        inputs, grads = (t.detach().cpu().double() for t in seen[module])
        a_rows, g_rows = input_rows(module, inputs), output_rows(module, grads)
        a, g = factors[name]
        assert_bf16_gram(a * a_rows.shape[0], a_rows)
        assert_bf16_gram(g / 6, g_rows)


def test_a_convolution_without_output_positions_gives_a_float32_zero_factor() -> None:
    block = make_block(nn.Conv2d(2, 3, 5, bias=True))
    assert block is not None
    block.precision = BF16
    statistic = block.a_statistic(torch.randn(1, 2, 3, 3), torch.float32)
    assert statistic.rows == 0 and statistic.total.dtype == torch.float32
    assert torch.equal(statistic.total, torch.zeros(51, 51))


class HalfPrecisionBlock(LinearBlock):
    """A user's block that returns its sums in bfloat16 (ignoring ``dtype``)."""

    def a_statistic(self, x: torch.Tensor, dtype: torch.dtype) -> FactorStatistic:
        statistic = super().a_statistic(x, dtype)
        return statistic._replace(total=statistic.total.to(torch.bfloat16))


def test_a_blocks_sums_in_another_dtype_become_factor_dtype() -> None:
    model = nn.Linear(4, 3)
    pre = dkfac.KFACPreconditioner(model, blocks={nn.Linear: HalfPrecisionBlock})
    F.mse_loss(model(torch.randn(5, 4)), torch.randn(5, 3)).backward()
    pre.step()
    ((a, g),) = pre.factors().values()
    assert a.dtype == g.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"statistics_precision": "tf32"}, r"statistics_precision='tf32' is not allowed: "),
        (
            {"statistics_precision": "bf16", "factor_dtype": torch.float64},
            r"statistics_precision='bf16' is not allowed with factor_dtype=torch.float64",
        ),
    ],
)
def test_a_bad_statistics_precision_is_refused(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        dkfac.KFACPreconditioner(nn.Linear(3, 2), **kwargs)
