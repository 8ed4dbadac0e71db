"""The table ``repr(KFACPreconditioner)`` prints: each layer, its factors, its owner."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dkfac.curvature.factor_side import is_diagonal
from dkfac.curvature.layer import LayerCurvature


@dataclass(frozen=True)
class SkippedModule:
    """A module with parameters that K-FAC leaves to the plain gradient, and why."""

    name: str
    kind: str
    reason: str


def format_layer_table(
    model: nn.Module,
    layers: Mapping[str, LayerCurvature],
    skipped: Sequence[SkippedModule],
    plan: Mapping[str, Any],
    silent: Collection[str] = (),
    broadcast: Collection[str] = (),
) -> list[str]:
    """One line per module with parameters, in module order, plus the fusion summary.

    Args:
        model: the unwrapped model.
        layers: preconditioned layers by module path.
        skipped: modules left to the plain gradient.
        plan: the strategy's ``plan()`` (owners per factor, buckets).
        silent: names of layers found used outside their ``forward()``: they have gradients
            but no statistics, and pass their gradients through unpreconditioned.
        broadcast: names of layers found looked up once and broadcast over the batch:
            passed through likewise.
    """
    owners: dict[str, dict[str, str]] = {}
    for factor in plan["factors"]:
        owners.setdefault(factor["layer"], {})[factor["factor"]] = str(factor["decomposed_by"])
    rows = [("layer", "type", "A", "G", "status", "decomposed by" if owners else "")]
    by_name = {entry.name: entry for entry in skipped}
    for path, _ in model.named_modules():
        if path in layers:
            layer = layers[path]
            block = layer.block
            owner = owners.get(layer.name, {})
            rows.append(
                (
                    layer.name,
                    block.describe(),
                    _factor_size(block.a_dim),
                    _factor_size(block.g_dim),
                    _status(layer.name, silent, broadcast),
                    owner.get("A", "")
                    if owner.get("A") == owner.get("G")
                    else f"A:{owner.get('A')} G:{owner.get('G')}",
                )
            )
        elif path in by_name:
            entry = by_name[path]
            rows.append(
                (entry.name or entry.kind, entry.kind, "-", "-", f"skipped: {entry.reason}", "")
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if plan["buckets"]:
        collectives = sorted({bucket["collective"] for bucket in plan["buckets"]})
        lines.append(
            f"  factor communication: {len(plan['buckets'])} fused "
            f"{'/'.join(collectives)} bucket(s), planned by {plan['fusion']}"
        )
    if "share" in plan:
        share = plan["share"]
        what = "preconditioned gradients" if share["mode"] == "gradients" else "decompositions"
        decompositions = share["decomposition_bytes_per_step"] / 1e6
        gradients = share["gradient_bytes_per_step"] / 1e6
        lines.append(
            f"  owners broadcast {what} (share={share['requested']!r}; per step: "
            f"decompositions {decompositions:.3g} MB at inv_update_steps="
            f"{share['inv_update_steps']}, gradients {gradients:.3g} MB)"
        )
    return lines


def _factor_size(dim: int) -> str:
    """``"dxd"``, or ``"diag(d)"`` for a factor held as its diagonal."""
    return f"diag({dim})" if is_diagonal(dim) else f"{dim}x{dim}"


def _status(name: str, silent: Collection[str], broadcast: Collection[str]) -> str:
    """A preconditioned layer's status, or why its gradient passes through."""
    if name in silent:
        return "passed through: used outside its forward"
    if name in broadcast:
        return "passed through: looked up once and broadcast over the batch"
    return "preconditioned"
