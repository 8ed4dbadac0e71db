"""A convolution's pixel Grams two ways, on a model's own shapes: which layout pays, and where.

Every convolution's ``G`` statistic and a 1x1 convolution's ``A`` statistic are pixel Grams
(``dkfac.curvature.gram.pixel_gram``). A channels-first tensor's Gram is either one product
of a channel-major copy (``copy``) or a sum of per-example products of its channel planes,
which are views (``per-example``); dkfac takes the second from
``PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL`` positions per channel on (``auto``). This records
the shapes one forward and backward pass of the model gives those statistics (contiguous
channels-first ones: the others are rows or strided pixels, which both paths copy), then
times each distinct shape both ways, in the statistics' float32 and with
``statistics_precision="bf16"``, as the median of ``--repeats`` calls with the device waited
for; the totals weight each shape by how often the pass made it.

Usage::

    python benchmarks/pixel_grams.py --model resnet50 --batch 128            # on a GPU
    python benchmarks/pixel_grams.py --device cpu --batch 8 --out runs/pixel_grams.json
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gram_ways
from dkfac.curvature.gram import (
    PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL,
    GramPrecision,
    per_example_products_pay,
    pixel_gram,
)

Shape = tuple[int, ...]
PATHS = {"copy": False, "per-example": True}


def pixel_gram_shapes(
    model_name: str, device: torch.device, batch: int, image: int
) -> Counter[Shape]:
    """Shapes of the channels-first tensors one pass of the model gives pixel Grams.

    ``A`` of every unpadded stride-1 1x1 convolution (its input) and ``G`` of every
    convolution (its output gradient), when contiguous.
    """
    shapes: Counter[Shape] = Counter()

    def note(tensor: torch.Tensor) -> None:
        if tensor.dim() > 2 and tensor.is_contiguous() and tensor.stride(1) != 1:
            shapes[tuple(tensor.shape)] += 1

    def note_both(module: nn.Conv2d, x: torch.Tensor, output: torch.Tensor) -> None:
        if module.kernel_size == (1, 1) and module.stride == (1, 1) and module.padding == (0, 0):
            note(x)
        output.register_hook(note)

    gram_ways.pass_with_conv_hooks(model_name, device, batch, image, note_both)
    return shapes


def time_shape(
    shape: Shape, device: torch.device, precision: GramPrecision, repeats: int
) -> dict[str, float]:
    """Median milliseconds of each path's pixel Gram of a random ``shape`` tensor."""
    x = torch.randn(shape, device=device)
    result = {}
    for label, per_example in PATHS.items():

        def gram(per_example: bool = per_example) -> None:
            pixel_gram(x, torch.float32, False, precision, per_example=per_example)

        result[label] = gram_ways.median_ms(gram, device, repeats)
    return result


def measure(
    model_name: str,
    device: torch.device,
    batch: int,
    image: int,
    repeats: int,
    on_result: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every shape's timings both ways and the model's totals, per precision.

    The largest shapes first; ``on_result`` gets the result so far after each shape (its
    totals cover the shapes measured), so a run cut short keeps what it measured.
    """
    shapes = pixel_gram_shapes(model_name, device, batch, image)
    items = []
    for shape, count in sorted(shapes.items(), key=lambda item: -item[1] * math.prod(item[0])):
        default = per_example_products_pay(shape)
        row: dict[str, Any] = {"shape": list(shape), "count": count}
        row["per_example_by_default"] = default

        def time(precision: GramPrecision, shape: Shape = shape) -> Any:
            return time_shape(shape, device, precision, repeats)

        items.append(gram_ways.Item(row, "per-example" if default else "copy", count, time))
    return gram_ways.measure_rows(items, list(PATHS), "shapes", on_result)


def table(result: dict[str, Any]) -> str:
    """One row per shape: count, positions per channel, each path's median ms per precision."""

    def leading(row: dict[str, Any]) -> list[object]:
        shape = row["shape"]
        ratio = math.prod(shape[2:]) / shape[1]
        default = "per-example" if row["per_example_by_default"] else "copy"
        return [tuple(shape), row["count"], f"{ratio:.3g}", default]

    labels = ["shape (N, C, H, W)", "count", "positions per channel", "default"]
    return gram_ways.table(result, "shapes", labels, list(PATHS), leading)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    args = gram_ways.parse_args(__doc__.split("\n")[0], argv)
    minimum = PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL
    return gram_ways.run(args, measure, table, emit, per_example_min_positions_per_channel=minimum)


if __name__ == "__main__":
    sys.exit(main())
