"""How decompositions travel: one payload per layer or factor, fused per source, one flag each.

A payload is the tensors of some factors' decompositions in the order their class lays them
out (:meth:`~dkfac.curvature.factor_decomposition.FactorDecomposition.layout`; zeros on ranks
that receive), then a one-value validity flag: a decomposition that failed on its owner
arrives marked invalid, and every rank keeps its last good one alike. KAISA sends a layer's
two factors in one payload (inside a grid row), SPD-KFAC and PAD-KFAC send each factor on its
own (to every worker); the runner (:mod:`dkfac.strategies.runner`) broadcasts them as the
placement's shares say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dkfac.curvature.factor_decomposition import (
    FactorDecomposition,
    factor_decomposition,
    factor_tensor_shapes,
)
from dkfac.curvature.factor_side import is_diagonal
from dkfac.strategies.plan import DecompositionShare, FactorKey, Placement

#: The factors a payload carries: ``(side, dim)`` each, e.g. ``[("a", d_A), ("g", d_G)]``.
FactorDims = Sequence[tuple[str, int]]

#: Per factor, the decomposition a rank computed or received (``None``: none usable).
DecompositionsByFactor = dict[FactorKey, FactorDecomposition | None]


def payload_shapes(method: str, factors: FactorDims) -> list[tuple[tuple[int, ...], bool]]:
    """Shapes and symmetry of a payload's tensors, the validity flag last.

    Args:
        method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        factors: the factors the payload carries, ``(side, dim)`` each, in order.
    """
    shapes = [
        (shape, symmetric)
        for side, dim in factors
        for _, shape, symmetric in factor_tensor_shapes(method, side, dim)
    ]
    return [*shapes, ((1,), False)]


@dataclass
class DecompositionPayload:
    """The tensors one collective carries for some factors' decompositions, flag last.

    Attributes:
        method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        factors: the factors it carries, ``(side, dim)`` each, in order.
        names: the decomposition tensors' names (without the flag).
        tensors: the tensors, then the flag (1: valid).
        symmetric: per tensor, whether only its upper triangle travels.
    """

    method: str
    factors: list[tuple[str, int]]
    names: list[str]
    tensors: list[Tensor]
    symmetric: list[bool]

    @classmethod
    def build(
        cls,
        method: str,
        factors: FactorDims,
        stored: Mapping[str, Tensor] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DecompositionPayload:
        """The payload of ``stored`` decomposition tensors, or zeros marked invalid if None.

        Args:
            method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
            factors: the factors it carries, ``(side, dim)`` each, in order.
            stored: the decomposition tensors by name (a sender's), or None (a receiver's
                buffers, or a failed decomposition: sent as invalid).
            dtype: transport dtype of the decompositions.
            device: where the buffers live.
        """
        specs = [spec for side, dim in factors for spec in factor_tensor_shapes(method, side, dim)]
        if stored is not None:
            parts = [stored[name].to(dtype).contiguous() for name, _, _ in specs]
        else:  # a receiver's buffers, or a failed decomposition
            parts = [torch.zeros(shape, dtype=dtype, device=device) for _, shape, _ in specs]
        # Filled on the device: a tensor built from a host list would be a copy that waits.
        flag = torch.full((1,), 0.0 if stored is None else 1.0, dtype=dtype, device=device)
        return cls(
            method=method,
            factors=list(factors),
            names=[name for name, _, _ in specs],
            tensors=[*parts, flag],
            symmetric=[symmetric for _, _, symmetric in specs] + [False],
        )

    def named(self) -> dict[str, Tensor]:
        """The decomposition tensors by name (without the flag)."""
        return dict(zip(self.names, self.tensors[:-1], strict=True))

    def decomposition(self, side: str) -> FactorDecomposition:
        """Factor ``side``'s decomposition as received (a payload may carry both factors)."""
        dim = dict(self.factors)[side]
        named = self.named()
        tensors = {name: named[name] for name, _, _ in factor_tensor_shapes(self.method, side, dim)}
        diagonal = is_diagonal(dim)
        return factor_decomposition(self.method, side, tensors, self.flag > 0, diagonal=diagonal)

    @property
    def flag(self) -> Tensor:
        """The one-value validity flag (1: valid)."""
        return self.tensors[-1]


def build_payloads(
    placement: Placement,
    shares: Sequence[DecompositionShare],
    rank: int,
    method: str,
    dtype: torch.dtype,
    device: torch.device,
    decompositions: DecompositionsByFactor,
) -> list[list[DecompositionPayload]]:
    """Per share, per unit: what ``rank`` sends (its ``decompositions``), or receive buffers.

    A source sends a unit only when every factor of it decomposed; otherwise the unit travels
    marked invalid.
    """
    result = []
    for share in shares:
        unit_payloads = []
        for unit in share.units:
            routes = [placement.route(key) for key in unit]
            stored: dict[str, Tensor] | None = None
            if share.source == rank:
                found = [decompositions.get(key) for key in unit]
                parts = [part for part in found if part is not None]
                if len(parts) == len(unit):
                    stored = {name: t for part in parts for name, t in part.tensors.items()}
            factors = [(route.side, route.dim) for route in routes]
            unit_payloads.append(DecompositionPayload.build(method, factors, stored, dtype, device))
        result.append(unit_payloads)
    return result


def valid_flags(payloads: Sequence[DecompositionPayload]) -> list[bool]:
    """Per payload, whether it arrived valid: one host synchronisation for all of them."""
    if not payloads:
        return []
    return [value > 0 for value in torch.cat([payload.flag for payload in payloads]).tolist()]
