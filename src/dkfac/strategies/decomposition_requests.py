"""Which factors a rank decomposes at a decomposition step, and with what Tikhonov shift.

Pure functions of the plan and the layers' running factors: the runner
(:class:`~dkfac.strategies.runner.PlacementRunner`) turns their answers into
:class:`~dkfac.curvature.decomposition.FactorRequest` batches and shares the results.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from dkfac.curvature.decomposition import FactorRequest
from dkfac.curvature.inverse import FACTOR_SIDES
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.plan import FactorRoute, Placement, other_side


def decomposes_now(
    plan: Placement, rank: int, layers: Sequence[LayerCurvature], route: FactorRoute
) -> bool:
    """Whether ``route``'s factor is ``rank``'s to decompose and has a running average.

    Not when ``rank`` keeps the other factor of the layer and it has none yet (no inverse
    could be built: the layer's forward or backward has not run).
    """
    layer = layers[route.layer]
    if not plan.decomposes(route, rank) or layer.factor(route.side) is None:
        return False
    other = plan.route((route.layer, other_side(route.side)))
    return not (plan.holds_factor(other, rank) and layer.factor(other.side) is None)


def factor_request(
    plan: Placement,
    rank: int,
    layers: Sequence[LayerCurvature],
    route: FactorRoute,
    shifts: Tensor | None,
    damping: float,
) -> FactorRequest:
    """One factor to decompose, with its Tikhonov shift when the method needs one.

    Its domain is who decomposes it (``rank`` alone, or every worker: then every worker
    batches it with the same others).

    ``shifts``: the ``(L, 2)`` Tikhonov shifts (:func:`~dkfac.curvature.inverse.shift_table`;
    ``None``: the method takes none). The damping goes with the request when the plan gives
    ``rank`` both factors of the layer, so a float64 retry recomputes the shift from float64
    traces.
    """
    layer, domain = layers[route.layer], route.decomposed_by  # one rank, or every worker
    if shifts is None:
        return FactorRequest(layer, route.side, domain=domain)
    shift = shifts[route.layer, FACTOR_SIDES.index(route.side)]
    both_held = all(
        plan.holds_factor(plan.route((route.layer, side)), rank) for side in FACTOR_SIDES
    )
    return FactorRequest(layer, route.side, shift, damping if both_held else None, domain)
