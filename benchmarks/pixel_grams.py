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

import argparse
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dkfac.curvature.gram import (
    PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL,
    GramPrecision,
    per_example_products_pay,
    pixel_gram,
)
from gpu_breakdown import timed
from gpu_overhead import MODELS, add_model_arguments, environment, fresh_model, write_report

Shape = tuple[int, ...]
PATHS = {"copy": False, "per-example": True}
PRECISIONS = ("highest", "bf16")


def pixel_gram_shapes(
    model_name: str, device: torch.device, batch: int, image: int
) -> Counter[Shape]:
    """Shapes of the channels-first tensors one pass of the model gives pixel Grams.

    ``A`` of every unpadded stride-1 1x1 convolution (its input) and ``G`` of every
    convolution (its output gradient), when contiguous.
    """
    spec = MODELS[model_name]
    model, _ = fresh_model(spec, device)
    shapes: Counter[Shape] = Counter()

    def note(tensor: torch.Tensor) -> None:
        if tensor.dim() > 2 and tensor.is_contiguous() and tensor.stride(1) != 1:
            shapes[tuple(tensor.shape)] += 1

    def forward_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        assert isinstance(module, nn.Conv2d)
        if module.kernel_size == (1, 1) and module.stride == (1, 1) and module.padding == (0, 0):
            note(inputs[0])
        output.register_hook(note)

    handles = [
        m.register_forward_hook(forward_hook) for m in model.modules() if isinstance(m, nn.Conv2d)
    ]
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, spec.num_classes, (batch,), device=device)
    F.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
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

        gram()  # warm (library handles, kernel choice)
        result[label] = 1e3 * statistics.median(timed(gram, device) for _ in range(repeats))
    return result


def measure(
    model_name: str,
    device: torch.device,
    batch: int,
    image: int,
    repeats: int,
    on_shape: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every shape's timings both ways and the model's totals, per precision.

    The largest shapes first; ``on_shape`` gets the result so far after each shape (its
    totals cover the shapes measured), so a run cut short keeps what it measured.
    """
    shapes = pixel_gram_shapes(model_name, device, batch, image)
    rows = []
    totals = {p: {"copy": 0.0, "per-example": 0.0, "auto": 0.0, "best": 0.0} for p in PRECISIONS}
    for shape, count in sorted(shapes.items(), key=lambda item: -item[1] * math.prod(item[0])):
        row: dict[str, Any] = {"shape": list(shape), "count": count}
        row["per_example_by_default"] = per_example_products_pay(shape)
        for name in PRECISIONS:
            ms = time_shape(shape, device, GramPrecision(name), repeats)
            row[name] = ms
            total = totals[name]
            total["copy"] += count * ms["copy"]
            total["per-example"] += count * ms["per-example"]
            total["auto"] += count * ms["per-example" if row["per_example_by_default"] else "copy"]
            total["best"] += count * min(ms.values())
        rows.append(row)
        on_shape({"shapes": rows, "totals_ms": totals, "complete": len(rows) == len(shapes)})
    return {"shapes": rows, "totals_ms": totals, "complete": True}


def table(result: dict[str, Any]) -> str:
    """One row per shape: count, positions per channel, each path's median ms per precision."""
    lines = [
        "| shape (N, C, H, W) | count | positions per channel | default | float32: copy | "
        "per-example | bf16: copy | per-example |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["shapes"]:
        shape = row["shape"]
        ratio = math.prod(shape[2:]) / shape[1]
        cells = [f"{row[p][path]:.3f}" for p in PRECISIONS for path in PATHS]
        default = "per-example" if row["per_example_by_default"] else "copy"
        lines.append(
            f"| {tuple(shape)} | {row['count']} | {ratio:.3g} | {default} | "
            + " | ".join(cells)
            + " |"
        )
    for name, total in result["totals_ms"].items():
        lines.append(
            f"| **all, {name}** | | | | copy {total['copy']:.2f} | per-example "
            f"{total['per-example']:.2f} | default {total['auto']:.2f} | best {total['best']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, batch=128)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    image = args.image_size or MODELS[args.model].image_size
    header = {
        "environment": environment(device),
        "model": args.model,
        "batch": args.batch,
        "image_size": image,
        "repeats": args.repeats,
        "per_example_min_positions_per_channel": PER_EXAMPLE_MIN_POSITIONS_PER_CHANNEL,
    }

    def save(result: dict[str, Any]) -> None:  # after every shape: a cut run keeps its rows
        write_report(args.out, {**header, **result})

    result = measure(args.model, device, args.batch, image, args.repeats, on_shape=save)
    emit(table(result))
    save(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
