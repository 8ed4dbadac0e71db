"""``conv_patches``: a stride-1 convolution's ``A`` from shifted products or im2col, as asked.

Oracle: explicit patches and ``torch.func`` per-example gradients in float64
(:func:`test_oracle_numerics.oracle_layer_factors`); the way asked is checked by the products
each way makes (:func:`test_factors.matrix_products`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dkfac
import dkfac.curvature.conv_blocks as conv_blocks
from dkfac.cli.config import ConfigError, TrainConfig
from dkfac.curvature.factors import (
    CONV_PATCHES,
    conv2d_patch_gram,
    explicit_patches_pay,
    im2col_asked,
)
from dkfac.curvature.shifted_gram_plan import ConvGeometry
from test_batched_statistics import batch, equal_layers_model
from test_factors import matrix_products
from test_oracle_numerics import (
    assert_factors,
    batch_loss,
    kfac_layers,
    make_pre,
    oracle_layer_factors,
)


def ways_taken(monkeypatch: pytest.MonkeyPatch) -> list[bool | None]:
    """Records the ``im2col`` argument of every patch Gram a convolution's block asks for."""
    taken: list[bool | None] = []

    def recording(function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            taken.append(kwargs["im2col"])
            return function(*args, **kwargs)

        return call

    for name in ("conv2d_patch_gram", "conv2d_patch_grams"):
        monkeypatch.setattr(conv_blocks, name, recording(getattr(conv_blocks, name)))
    return taken


@pytest.mark.parametrize("batched", [True, False], ids=["together", "in-hooks"])
@pytest.mark.parametrize("way", list(CONV_PATCHES))
def test_each_way_gives_the_float64_oracles_factors(
    way: str, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3x3 convolutions of equal and unequal shapes, with and without bias, a strided one,
    # 1x1 ones and linear layers: every factor the oracle's whichever way is asked, each
    # convolution's block asking for that way (the strided one and the 1x1 ones take im2col
    # and pixel Grams whatever is asked).
    model = equal_layers_model()
    x, t = batch(0)
    expected = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    taken = ways_taken(monkeypatch)
    pre = make_pre(model, conv_patches=way, batched_statistics=batched)
    batch_loss(model(x), t).backward()
    pre.step()
    assert_factors(pre, expected)
    assert taken and set(taken) == {im2col_asked(way)}


def test_shifted_and_im2col_form_their_own_products() -> None:
    # What each way asks for is what the Gram is formed by: one batched product of im2col
    # matrices, or the shifted products (13 for a 3x3 kernel, in 3 launches for one input)
    # and their border corrections.
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    options: dict[str, Any] = {
        "kernel": (3, 3),
        "dilation": (1, 1),
        "stride": (1, 1),
        "pad": (1, 1, 1, 1),
        "with_ones": False,
    }
    im2col = matrix_products(lambda: conv2d_patch_gram(x, im2col=im2col_asked("im2col"), **options))
    shifted = matrix_products(
        lambda: conv2d_patch_gram(x, im2col=im2col_asked("shifted"), **options)
    )
    assert im2col == ["bmm"]  # every input's (here one) in one batched product
    assert shifted == ["bmm"] * 5 + ["mm"]


def test_equal_layers_asked_other_ways_are_not_formed_together() -> None:
    # The way is part of what makes two convolutions' statistics one batched call.
    first, second = (dkfac.curvature.Conv2dBlock(torch.nn.Conv2d(3, 3, 3, padding=1)) for _ in "ab")
    second.patches = "im2col"
    x = torch.randn(2, 3, 6, 6)
    assert first.a_batch_key(x) != second.a_batch_key(x)
    second.patches = "auto"
    assert first.a_batch_key(x) == second.a_batch_key(x)


@pytest.mark.parametrize("way", ["none", "IM2COL", "", None, ["im2col"]])
def test_another_way_is_refused(way: object) -> None:
    with pytest.raises(ValueError, match="conv_patches="):
        make_pre(equal_layers_model(), conv_patches=way)


def test_the_command_line_passes_the_way_on_and_refuses_others() -> None:
    assert TrainConfig(conv_patches="shifted").conv_patches == "shifted"
    with pytest.raises(ConfigError, match="--conv-patches"):
        TrainConfig(conv_patches="unfold")


@pytest.mark.parametrize(
    ("height", "width", "kernel", "pad", "im2col"),
    [
        (7, 7, (3, 3), (1, 1, 1, 1), True),  # 49 positions: CPU_IM2COL_MAX_POSITIONS
        (3, 16, (3, 3), (1, 1, 1, 1), True),  # 48, not square
        (8, 8, (3, 3), (1, 1, 1, 1), False),  # 64
        (1, 40, (1, 3), (1, 1, 0, 0), False),  # a Conv1d's 40 positions: a 1-D kernel
        (1, 3, (1, 3), (1, 1, 0, 0), True),  # as many positions as the kernel
        (5, 5, (3, 3), (2, 2, 2, 2), False),  # 7x7 output of a 5x5 input: larger than it
    ],
)
def test_a_cpu_takes_im2col_on_small_outputs_of_2d_kernels(
    height: int, width: int, kernel: tuple[int, int], pad: tuple[int, ...], im2col: bool
) -> None:
    geometry = ConvGeometry(height, width, kernel, (1, 1), pad)  # type: ignore[arg-type]
    assert explicit_patches_pay(geometry, torch.device("cpu")) == im2col
