"""A convolution's patch Grams two ways, on a model's own groups of layers: where im2col pays.

The ``A`` statistic of a stride-1 convolution with a kernel larger than 1x1 is the Gram of its
im2col patches. dkfac forms it from shifted products of the input with itself, corrected at
the border (``shifted``: a dozen or more launches for a 3x3 kernel, no copy of the patches),
or from explicit im2col matrices (``im2col``: a handful of launches, ``kh·kw`` times the
input's memory, ``kh·kw`` times the products' work); it takes im2col where
``dkfac.curvature.factors.explicit_patches_pay`` (on a CPU outputs of at most ``kh·kw``
positions, on a GPU every output no larger than its input) and the shifted products elsewhere
(``default``). The shifted products cut their rows into chunks on a GPU
(``dkfac.curvature.row_chunks``, ``chunks``: a batched product of a few ``C x C`` results over
every position leaves most of a GPU idle); ``shifted`` times them uncut, as before that rule,
and each row records the chunks the rule takes. With ``batched_statistics`` the inputs of equal
layers are formed together, so this records the groups one forward pass gives (equal shape and
convolution settings), then times each group every way, in float32 and with
``statistics_precision="bf16"``, as the median of ``--repeats`` calls with the device waited
for. A group larger than the pending-statistics byte budget would be cut into chunks in a run;
here it is timed whole.

``--chunks N`` times the ``chunks`` way with ``N`` chunks on any device (a CPU's rule takes
1), ``--threads T`` with ``T`` intra-op threads.

Usage::

    python benchmarks/patch_grams.py --model resnet32 --batch 128            # on a GPU
    python benchmarks/patch_grams.py --device cpu --batch 8 --out runs/patch_grams.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

import gram_ways
from dkfac.curvature.factors import conv2d_patch_grams, explicit_patches_pay
from dkfac.curvature.gram import GramPrecision
from dkfac.curvature.row_chunks import row_chunks
from dkfac.curvature.shifted_gram_plan import ConvGeometry, ShiftedGramPlans

#: Each way's ``im2col`` and ``chunks`` (``None``: as the library decides).
WAYS: dict[str, tuple[bool, int | None]] = {
    "shifted": (False, 1),
    "chunks": (False, None),
    "im2col": (True, None),
}


class Group(NamedTuple):
    """Convolutions whose inputs one batched call forms together (the same key)."""

    shape: tuple[int, int, int, int]
    kernel: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]
    with_ones: bool

    def geometry(self) -> ConvGeometry:
        """The stride-1 geometry :func:`explicit_patches_pay` decides on."""
        return ConvGeometry(self.shape[2], self.shape[3], self.kernel, self.dilation, self.pad)


def patch_gram_groups(
    model_name: str, device: torch.device, batch: int, image: int
) -> Counter[Group]:
    """The groups of stride-1, zero-padded convolutions larger than 1x1, and their sizes.

    Convolutions with string padding (``"same"``) are not recorded: the models timed here
    have none.
    """
    groups: Counter[Group] = Counter()

    def note(module: nn.Conv2d, x: torch.Tensor, output: torch.Tensor) -> None:
        if module.stride != (1, 1) or module.kernel_size == (1, 1) or module.groups != 1:
            return
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return
        ph, pw = module.padding
        kh, kw = module.kernel_size
        dh, dw = module.dilation
        n, c, h, w = x.shape
        with_ones = module.bias is not None
        groups[Group((n, c, h, w), (kh, kw), (dh, dw), (pw, pw, ph, ph), with_ones)] += 1

    gram_ways.pass_with_conv_hooks(model_name, device, batch, image, note)
    return groups


def time_group(
    group: Group,
    layers: int,
    device: torch.device,
    precision: GramPrecision,
    repeats: int,
    chunks_asked: int | None = None,
) -> dict[str, float]:
    """Median milliseconds of each way's Grams of ``layers`` random inputs of the group.

    ``chunks_asked``: the ``chunks`` way's chunks (``None``: the library's rule's).
    """
    xs = [torch.randn(group.shape, device=device) for _ in range(layers)]
    plans = ShiftedGramPlans()
    result = {}
    for label, (im2col, way_chunks) in WAYS.items():
        chunks = chunks_asked if label == "chunks" and chunks_asked is not None else way_chunks

        def grams(im2col: bool = im2col, chunks: int | None = chunks) -> None:
            conv2d_patch_grams(
                xs,
                kernel=group.kernel,
                dilation=group.dilation,
                stride=(1, 1),
                pad=group.pad,
                with_ones=group.with_ones,
                plans=plans,
                precision=precision,
                dtype=torch.float32,
                im2col=im2col,
                chunks=chunks,
            )

        result[label] = gram_ways.median_ms(grams, device, repeats)
    return result


def measure(
    model_name: str,
    device: torch.device,
    batch: int,
    image: int,
    repeats: int,
    on_result: Callable[[dict[str, Any]], None] = lambda result: None,
    chunks_asked: int | None = None,
) -> dict[str, Any]:
    """Every group's timings every way and the model's totals, per precision.

    ``on_result`` gets the result so far after each group, so a run cut short keeps it;
    ``chunks_asked``: the ``chunks`` way's chunks (``None``: the library's rule's).
    """
    groups = patch_gram_groups(model_name, device, batch, image)
    items = []
    for group, layers in groups.items():
        explicit = explicit_patches_pay(group.geometry(), device)
        geometry = group.geometry()
        n, c = group.shape[:2]
        # The shifted products' rows: each example's zero-padded image (the plan's layout).
        padded = (geometry.height + geometry.dilation[0] * (group.kernel[0] - 1)) * (
            geometry.width + geometry.dilation[1] * (group.kernel[1] - 1)
        )
        chunks = chunks_asked or row_chunks(n * padded, c, layers, device)
        # The library's way: the chunks way unless it was given chunks the rule would not take.
        rule = chunks_asked is None or chunks_asked == row_chunks(n * padded, c, layers, device)
        default = "im2col" if explicit else "chunks" if rule else "shifted"
        row: dict[str, Any] = {
            **group._asdict(),
            "layers": layers,
            "default_im2col": explicit,
            "default": default,
            "chunks": chunks,
        }

        def time(precision: GramPrecision, group: Group = group, layers: int = layers) -> Any:
            return time_group(group, layers, device, precision, repeats, chunks_asked)

        items.append(gram_ways.Item(row, default, 1, time))
    return gram_ways.measure_rows(items, list(WAYS), "groups", on_result)


def table(result: dict[str, Any]) -> str:
    """One row per group: layers, output size, each way's median ms per precision."""

    def leading(row: dict[str, Any]) -> list[object]:
        kernel = "x".join(map(str, row["kernel"]))
        return [tuple(row["shape"]), kernel, row["layers"], row["chunks"], row["default"]]

    labels = ["input (N, C, H, W)", "kernel", "layers", "chunks", "default"]
    return gram_ways.table(result, "groups", labels, list(WAYS), leading)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    def chunks_argument(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--chunks",
            type=int,
            default=None,
            help="the chunks way's chunks, on any device (default: as the library cuts them)",
        )

    args = gram_ways.parse_args(__doc__.split("\n")[0], argv, chunks_argument)
    if args.chunks is not None and args.chunks < 1:
        raise SystemExit(f"--chunks {args.chunks}: expected an integer >= 1")
    return gram_ways.run(args, functools.partial(measure, chunks_asked=args.chunks), table, emit)


if __name__ == "__main__":
    sys.exit(main())
