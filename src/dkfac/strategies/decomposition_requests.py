"""Which factors a rank decomposes at a decomposition step, and with what Tikhonov shift.

Pure functions of the plan and the layers' running factors: the runner
(:class:`~dkfac.strategies.runner.PlacementRunner`) turns their answers into
:class:`~dkfac.curvature.decomposition.FactorRequest` batches and shares the results.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from torch import Tensor

from dkfac.curvature.decomposition import FactorRequest
from dkfac.curvature.factor_side import FACTOR_SIDES
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.plan import EVERY_WORKER, FactorRoute, Placement, other_side


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
    layers: Sequence[LayerCurvature],
    route: FactorRoute,
    shifts: Tensor | None,
    damping: float,
) -> FactorRequest:
    """One factor to decompose, with its Tikhonov shift when the method needs one.

    Everything in it is the same on every rank that decomposes the factor, so replicas of a
    factor every worker decomposes compute the same bits:

    * its domain (:func:`batching_domain`), which decides what it is batched with;
    * the damping, given when every decomposer keeps both factors of the layer, so a float64
      retry recomputes the shift from float64 traces (otherwise a retry reuses the shift).

    ``shifts``: the ``(L, 2)`` Tikhonov shifts (:func:`~dkfac.curvature.inverse.shift_table`;
    ``None``: the method takes none).
    """
    layer, domain = layers[route.layer], batching_domain(plan, route)
    if shifts is None:
        return FactorRequest(layer, route.side, domain=domain)
    shift = shifts[route.layer, FACTOR_SIDES.index(route.side)]
    whole_layer = plan.deciders_hold_layer(route)
    return FactorRequest(layer, route.side, shift, damping if whole_layer else None, domain)


def batching_domain(plan: Placement, route: FactorRoute) -> Hashable:
    """With which factors ``route``'s may be decomposed in one batched call.

    A batch's results depend on its members by round-off, so a factor every worker
    decomposes may only be batched with companions that are the same on every worker. They
    are when every worker keeps the layer's other factor: factors every worker decomposes are
    exchanged (:class:`~dkfac.strategies.plan.Placement` refuses them unexchanged), so each
    exists on all workers or on none, and :func:`decomposes_now` decides alike everywhere.
    Otherwise a worker keeping the other factor could leave out a factor that the others
    decompose, and such a factor is decomposed alone. A factor one rank decomposes is
    batched with that rank's own (its results are sent from there).
    """
    if route.decomposed_by == EVERY_WORKER and not plan.deciders_hold_layer(route):
        return ("alone", route.key)
    return route.decomposed_by
