"""A factor's Gram as one product or as its upper block triangle, on a model's own shapes.

Every K-FAC statistic is a Gram ``Xᵀ X`` of rows ``X``. PyTorch has no product that forms half
of a symmetric one, so ``dkfac.curvature.gram.gram`` cuts a wide Gram's columns into
``SYMMETRIC_BLOCKS`` blocks and forms each block's products with itself and the blocks after it
(``(k+1)/2k`` of the work), copying the blocks below the diagonal from those above (by default
on a CPU, from ``SYMMETRIC_MIN_COLUMNS`` columns and ``SYMMETRIC_MIN_ROWS`` rows on). This
records the rows of every convolution's statistics that reach ``gram`` on the device, at least
256 columns wide: ``A``'s im2col patches ``(N·H_out·W_out, C·kh·kw)`` where
``explicit_patches_pay`` (or the stride is not 1; shifted products otherwise), a 1x1
convolution's and every ``G``'s pixel vectors ``(N·H_out·W_out, C)``, or a stack of each
example's ``(H_out·W_out, C)`` where ``per_example_products_pay`` (their Grams summed over the
examples); then times each shape both ways in float32
and with bf16 operands, as the median of ``--repeats`` calls with the device waited for,
weighted by how many layers have it.

Usage::

    python benchmarks/gram_blocks.py --model resnet50 --batch 128            # on a GPU
    python benchmarks/gram_blocks.py --device cpu --batch 8 --out runs/gram_blocks.json
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gram_ways
from dkfac.curvature.factors import explicit_patches_pay
from dkfac.curvature.gram import (
    SYMMETRIC_BLOCKS,
    GramPrecision,
    gram,
    per_example_products_pay,
    symmetric_blocks,
)
from dkfac.curvature.shifted_gram_plan import ConvGeometry

WAYS = {"one product": 1, "blocks": SYMMETRIC_BLOCKS}
#: Narrower Grams are one product whatever the rule: not timed.
MIN_COLUMNS = 256


def gram_shapes(model_name: str, device: torch.device, batch: int, image: int) -> Counter[Any]:
    """``(stack, rows, columns)`` of the convolutions' statistics ``gram`` forms, and their layers.

    A stack of 1 for one matrix of rows, of ``N`` for the per-example products of a
    channels-first tensor with many positions per channel (each example's positions).
    """
    shapes: Counter[tuple[int, int, int]] = Counter()

    def pixels(tensor: torch.Tensor) -> tuple[int, int, int]:
        """How a pixel Gram of ``tensor`` (stride 1, channels first) reaches ``gram``."""
        n, c, h, w = tensor.shape
        if per_example_products_pay(tensor.shape):
            return (int(n), int(h * w), int(c))
        return (1, int(n * h * w), int(c))

    def note(module: nn.Conv2d, x: torch.Tensor, output: torch.Tensor) -> None:
        positions = int(output.shape[0] * output.shape[2] * output.shape[3])
        kernel, stride = module.kernel_size, module.stride
        ph, pw = module.padding if not isinstance(module.padding, str) else (0, 0)
        pad = (pw, pw, ph, ph)
        if kernel == (1, 1) and pad == (0, 0, 0, 0):
            a_shape = (1, positions, int(x.shape[1])) if stride != (1, 1) else pixels(x)
        else:
            geometry = ConvGeometry(x.shape[2], x.shape[3], kernel, module.dilation, pad)
            im2col = stride != (1, 1) or explicit_patches_pay(geometry, device)
            a_shape = (1, positions, int(x.shape[1]) * kernel[0] * kernel[1]) if im2col else None
        for shape in (a_shape, pixels(output)):
            if shape is not None and shape[2] >= MIN_COLUMNS:
                shapes[shape] += 1

    gram_ways.pass_with_conv_hooks(model_name, device, batch, image, note)
    return shapes


def time_shape(
    shape: tuple[int, int, int], device: torch.device, precision: GramPrecision, repeats: int
) -> dict[str, float]:
    """Median milliseconds of each way's Gram of random rows of ``shape`` (a stack's summed)."""
    stack, rows, columns = shape
    if stack == 1:
        random = torch.randn(rows, columns, device=device)
    else:  # as the library passes each example's planes: a view of (stack, columns, rows)
        random = torch.randn(stack, columns, rows, device=device).mT
    operands = precision.operands(random, torch.float32)

    def formed(blocks: int) -> torch.Tensor:
        grams = gram(operands, precision, blocks)
        return grams if stack == 1 else grams.sum(dim=0)

    return {
        label: gram_ways.median_ms(lambda b=blocks: formed(b), device, repeats)
        for label, blocks in WAYS.items()
    }


def measure(
    model_name: str,
    device: torch.device,
    batch: int,
    image: int,
    repeats: int,
    on_result: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every shape's timings both ways and the model's totals, per precision."""
    items = []
    for shape, layers in sorted(gram_shapes(model_name, device, batch, image).items()):
        stack, rows, columns = shape
        blocked = symmetric_blocks(rows, columns, device) > 1
        row: dict[str, Any] = {"stack": stack, "rows": rows, "columns": columns}
        row.update(layers=layers, default_blocks=blocked)

        def time(precision: GramPrecision, shape: tuple[int, int, int] = shape) -> Any:
            return time_shape(shape, device, precision, repeats)

        items.append(gram_ways.Item(row, "blocks" if blocked else "one product", layers, time))
    return gram_ways.measure_rows(items, list(WAYS), "shapes", on_result)


def table(result: dict[str, Any]) -> str:
    """One row per shape: layers, each way's median ms per precision."""

    def leading(row: dict[str, Any]) -> list[object]:
        default = "blocks" if row["default_blocks"] else "one product"
        return [row["stack"], row["rows"], row["columns"], row["layers"], default]

    labels = ["stack", "rows", "columns", "layers", "default"]
    return gram_ways.table(result, "shapes", labels, list(WAYS), leading)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    args = gram_ways.parse_args(__doc__.split("\n")[0], argv)
    return gram_ways.run(args, measure, table, emit, blocks=SYMMETRIC_BLOCKS)


if __name__ == "__main__":
    sys.exit(main())
