"""What the benchmarks of a statistic's two ways share: arguments, timing, the report.

``pixel_grams.py`` and ``patch_grams.py`` each time one kind of Gram two ways on the shapes a
model's pass gives it; both take the same arguments, time a call the same way and write their
JSON after every shape, so a run a device box cuts short keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dkfac.curvature.gram import GramPrecision
from gpu_breakdown import timed
from gpu_overhead import MODELS, add_model_arguments, environment, fresh_model, write_report


class Measure(Protocol):
    """A benchmark's measurement of a model's shapes."""

    def __call__(
        self,
        model_name: str,
        device: torch.device,
        batch: int,
        image: int,
        repeats: int,
        on_result: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any]:
        """The whole result; ``on_result`` gets the result so far after each shape."""
        ...


def pass_with_conv_hooks(
    model_name: str,
    device: torch.device,
    batch: int,
    image: int,
    hook: Callable[[nn.Conv2d, torch.Tensor, torch.Tensor], None],
) -> None:
    """One forward and backward pass of the model, ``hook(conv, input, output)`` at each Conv2d."""
    spec = MODELS[model_name]
    model, _ = fresh_model(spec, device)

    def forward_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        assert isinstance(module, nn.Conv2d)
        hook(module, inputs[0], output)

    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    handles = [conv.register_forward_hook(forward_hook) for conv in convs]
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, spec.num_classes, (batch,), device=device)
    F.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()


def median_ms(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``call`` over ``repeats`` runs, the device waited for, once warm.

    The first call is not timed: it pays for plans, library handles and kernel choice.
    """
    call()
    return 1e3 * statistics.median(timed(call, device) for _ in range(repeats))


#: The statistics' precisions each way is timed in (``GramPrecision`` names).
PRECISIONS = ("highest", "bf16")


class Item(NamedTuple):
    """One shape to time: its row of the report, its default way, its weight in the totals."""

    row: dict[str, Any]
    default: str
    weight: int
    time: Callable[[GramPrecision], dict[str, float]]  # median ms of each way


def measure_rows(
    items: Sequence[Item],
    ways: Sequence[str],
    key: str,
    on_result: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Time every item in every precision; the rows (under ``key``) and the weighted totals.

    ``on_result`` gets the result so far after each item, so a run cut short keeps it.
    """
    totals = {p: dict.fromkeys([*ways, "default", "best"], 0.0) for p in PRECISIONS}
    rows: list[dict[str, Any]] = []
    for item in items:
        for name in PRECISIONS:
            ms = item.row[name] = item.time(GramPrecision(name))
            total = totals[name]
            for way, value in ms.items():
                total[way] += item.weight * value
            total["default"] += item.weight * ms[item.default]
            total["best"] += item.weight * min(ms.values())
        rows.append(item.row)
        on_result({key: rows, "totals_ms": totals, "complete": len(rows) == len(items)})
    return {key: rows, "totals_ms": totals, "complete": True}


#: How a table names each precision's columns.
PRECISION_LABELS = {"highest": "float32", "bf16": "bf16"}


def table(
    result: dict[str, Any],
    key: str,
    labels: Sequence[str],
    ways: Sequence[str],
    leading: Callable[[dict[str, Any]], Sequence[object]],
) -> str:
    """The report's markdown table: one row per item under ``key``, then the totals.

    Args:
        result: what :func:`measure_rows` returned.
        key: where its rows are.
        labels: the names of the leading columns.
        ways: the ways timed, in their columns' order.
        leading: a row's leading cells (``labels``' values).
    """
    timing = [
        f"{PRECISION_LABELS[p]}: {way}" if i == 0 else way
        for p in PRECISIONS
        for i, way in enumerate(ways)
    ]
    header = [*labels, *timing]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result[key]:
        cells = " | ".join(str(cell) for cell in leading(row))
        lines.append(f"| {cells} | {timing_cells(row, ways)} |")
    lines += total_rows(result["totals_ms"], ways, cells=len(header))
    return "\n".join(lines)


def timing_cells(row: dict[str, Any], ways: Sequence[str]) -> str:
    """A row's median ms, each way in each precision, as table cells."""
    return " | ".join(f"{row[p][way]:.3f}" for p in PRECISIONS for way in ways)


def total_rows(totals: dict[str, dict[str, float]], ways: Sequence[str], cells: int) -> list[str]:
    """The table's last rows: each precision's totals, in a table of ``cells`` columns."""
    rows = []
    for name, total in totals.items():
        values = [f"{way} {total[way]:.2f}" for way in [*ways, "default", "best"]]
        blank = " |" * (cells - len(values) - 1)
        rows.append(f"| **all, {name}** |{blank} " + " | ".join(values) + " |")
    return rows


def parse_args(
    description: str,
    argv: list[str] | None,
    extra: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
) -> argparse.Namespace:
    """The model's arguments (batch 128 by default), ``--repeats``, ``--threads``, ``extra``'s."""
    parser = argparse.ArgumentParser(description=description)
    add_model_arguments(parser, batch=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch's intra-op threads (default: its own)"
    )
    extra(parser)
    return parser.parse_args(argv)


def run(
    args: argparse.Namespace,
    measure: Measure,
    table: Callable[[dict[str, Any]], str],
    emit: Callable[[str], None],
    **header: Any,
) -> int:
    """Measure, saving the JSON report (``header`` included) after every shape; emit the table."""
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    image = args.image_size or MODELS[args.model].image_size
    header = {
        "environment": environment(device),
        "model": args.model,
        "batch": args.batch,
        "image_size": image,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        **header,
    }

    def save(result: dict[str, Any]) -> None:
        write_report(args.out, {**header, **result})

    result = measure(args.model, device, args.batch, image, args.repeats, on_result=save)
    emit(table(result))
    save(result)
    return 0
