"""A strategy's plan as data: where each factor goes, who decomposes it, who gets what.

A :class:`Placement` is the whole decision a strategy makes, for every rank at once: pure,
typed and the same on every rank (computed from the same inputs). One runner
(:mod:`dkfac.strategies.runner`) executes any placement, and the dry run
(:mod:`dkfac.strategies.accounting`) runs that same runner against a recording communicator,
so what a plan sends is said once.

Three phases move data:

* **factor exchange**: each factor's summed statistics are allreduced (``reduced_to`` is
  ``None``) or reduced to one rank, at ``step()`` (``exchange="step"``) or from the module
  hooks (``"hooks"``); with ``"none"`` a factor stays on the worker that captured it, built
  from that worker's shard alone (DP-KFAC);
* **decomposition sharing**: each factor is decomposed by one rank (or by every rank,
  :data:`EVERY_WORKER`), and :class:`DecompositionShare` broadcasts carry results to the
  ranks of a group that did not decompose them;
* **gradient sharing**: the ranks that hold a layer's decomposition precondition it, and
  :class:`GradientShare` broadcasts carry the result to the ranks of a group that do not.

Only collectives that move data are planned: a group of one rank has no share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from dkfac.comm.wire import group_by_source
from dkfac.curvature.factor_side import FACTOR_SIDES, decomposition_work, is_diagonal
from dkfac.strategies.plan_report import FactorRow

#: ``decomposed_by`` of a factor that every worker decomposes itself (nothing broadcast).
EVERY_WORKER = -1

#: A factor: ``(layer index, side)``, side ``"a"`` or ``"g"``.
FactorKey = tuple[int, str]

#: When factors travel: never (each owner's own shard), at ``step()``, or from the hooks.
FactorExchange = Literal["none", "step", "hooks"]


@dataclass(frozen=True)
class FactorRoute:
    """Where one Kronecker factor goes.

    Attributes:
        layer: index of the layer in the preconditioner's list.
        side: ``"a"`` or ``"g"``.
        dim: the factor's side length.
        reduced_to: the rank its statistics are reduced to, or ``None`` for every rank (an
            allreduce); with ``exchange="none"`` the factor is not sent and lives on its
            decomposer.
        decomposed_by: the rank that decomposes it, or :data:`EVERY_WORKER`.
    """

    layer: int
    side: str
    dim: int
    reduced_to: int | None
    decomposed_by: int

    @property
    def key(self) -> FactorKey:
        """``(layer, side)``."""
        return (self.layer, self.side)


@dataclass(frozen=True)
class DecompositionShare:
    """One fused broadcast of decompositions from ``source`` inside ``group``.

    Attributes:
        source: the rank that decomposed the factors.
        units: the payloads, in order; each carries some factors and one validity flag
            (KAISA sends a layer's two factors together, SPD/PAD each factor alone).
        group: the ranks that take part (the source among them), ascending.
    """

    source: int
    units: tuple[tuple[FactorKey, ...], ...]
    group: tuple[int, ...]

    @property
    def factors(self) -> list[FactorKey]:
        """Every factor it carries, in payload order."""
        return [key for unit in self.units for key in unit]


@dataclass(frozen=True)
class GradientShare:
    """One fused broadcast of preconditioned gradients from ``source`` inside ``group``.

    Attributes:
        source: the rank that preconditioned the layers (it holds their inverses).
        layers: indices of the layers whose gradients it sends, ascending.
        group: the ranks that take part (the source among them), ascending.
    """

    source: int
    layers: tuple[int, ...]
    group: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """A strategy's complete plan (see the module docstring).

    Attributes:
        world_size: number of ranks it plans for.
        exchange: when factors travel (:data:`FactorExchange`).
        factors: every factor of every layer once, in exchange order.
        decompositions: the decomposition broadcasts, in launch order.
        gradients: the gradient broadcasts, in launch order (per group, sources ascending).
        buckets: with ``exchange="hooks"``, the fusion plan: lists of indices into
            ``factors``, launched in this order, each with one destination.
    """

    world_size: int
    exchange: FactorExchange
    factors: tuple[FactorRoute, ...]
    decompositions: tuple[DecompositionShare, ...] = ()
    gradients: tuple[GradientShare, ...] = ()
    buckets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        keys = [route.key for route in self.factors]
        layers = {layer for layer, _ in keys}
        if sorted(keys) != sorted((layer, side) for layer in layers for side in FACTOR_SIDES):
            raise ValueError("a placement must route both factors of every layer exactly once")
        if self.exchange == "step" and any(route.reduced_to is not None for route in self.factors):
            raise ValueError("factors exchanged at step() are allreduced to every rank")
        for route in self.factors:
            if route.decomposed_by != EVERY_WORKER and route.decomposed_by not in range(
                self.world_size
            ):
                raise ValueError(f"factor {route.key} is decomposed by no rank of the world")
            deciders = self.deciders(route)
            if not all(self.holds_factor(route, rank) for rank in deciders):
                raise ValueError(f"factor {route.key} is decomposed where it is not kept")
            if self.exchange == "none" and self.world_size > 1 and len(deciders) > 1:
                # Each worker would decompose its own statistics' factor: replicas that
                # differ, and batches of them too (decomposition_requests.batching_domain).
                raise ValueError(
                    f"factor {route.key} is decomposed by every worker but never exchanged"
                )
        for share in self.decompositions:
            if not share.units or share.source not in share.group:
                raise ValueError(
                    f"a decomposition share of rank {share.source} is empty or outside its group"
                )
            for key in share.factors:
                if self.route(key).decomposed_by != share.source:
                    raise ValueError(f"factor {key} is shared by a rank that did not decompose it")
        for gradients in self.gradients:
            for layer in gradients.layers:
                if not self.holds_inverse(layer, gradients.source):
                    raise ValueError(
                        f"layer {layer}'s gradient is shared by a rank without its inverse"
                    )
        self._check_buckets()
        # Computed now, not at a first use inside the hooks of a torch.compile'd model:
        # cached_property takes a lock there (Python < 3.12), which breaks the graph.
        _ = self._routes, self._receivers

    def _check_buckets(self) -> None:
        """Hooks: buckets cover every factor once, one destination each; otherwise none."""
        if self.exchange != "hooks":
            if self.buckets:
                raise ValueError(f"exchange={self.exchange!r} has no fusion buckets")
            return
        covered = sorted(i for bucket in self.buckets for i in bucket)
        if covered != list(range(len(self.factors))):
            raise ValueError("the fusion buckets must cover every factor exactly once")
        for bucket in self.buckets:
            if len({self.factors[i].reduced_to for i in bucket}) > 1:
                raise ValueError("a fusion bucket goes to one destination")

    def deciders(self, route: FactorRoute) -> range | tuple[int]:
        """The ranks that decompose ``route``'s factor."""
        if route.decomposed_by == EVERY_WORKER:
            return range(self.world_size)
        return (route.decomposed_by,)

    def deciders_hold_layer(self, route: FactorRoute) -> bool:
        """Whether every rank that decomposes ``route``'s factor keeps both of its layer's.

        Then each of them knows the whole layer: whether its other factor exists yet, and
        both traces for the Tikhonov shift; the same answer on all of them.
        """
        other = self.route((route.layer, other_side(route.side)))
        return all(
            self.holds_factor(factor, rank)
            for rank in self.deciders(route)
            for factor in (route, other)
        )

    @cached_property
    def _routes(self) -> dict[FactorKey, FactorRoute]:
        return {route.key: route for route in self.factors}

    @cached_property
    def _receivers(self) -> dict[FactorKey, frozenset[int]]:
        received: dict[FactorKey, set[int]] = {}
        for share in self.decompositions:
            for key in share.factors:
                received.setdefault(key, set()).update(share.group)
        return {key: frozenset(ranks) for key, ranks in received.items()}

    @property
    def layer_count(self) -> int:
        """Number of layers planned."""
        return len(self.factors) // 2

    def roots(self, ranks: tuple[int, ...]) -> list[int]:
        """Ranks reduced to, or broadcasting to all of ``ranks`` (the roots of their lanes)."""
        reduced = [route.reduced_to for route in self.factors if route.reduced_to is not None]
        sources = [share.source for share in self.decompositions if share.group == ranks]
        return reduced + sources + [s.source for s in self.gradients if s.group == ranks]

    def bucket_destinations(self) -> list[int | None]:
        """Per fusion bucket, the rank its reduce goes to (``None``: an allreduce)."""
        return [self.factors[bucket[0]].reduced_to for bucket in self.buckets]

    def route(self, key: FactorKey) -> FactorRoute:
        """The route of factor ``key``."""
        return self._routes[key]

    # -- who holds what --------------------------------------------------------------------
    def holds_factor(self, route: FactorRoute, rank: int) -> bool:
        """Whether ``rank`` keeps the running average of ``route``'s factor."""
        if self.exchange == "none":
            return route.decomposed_by in (rank, EVERY_WORKER)
        return route.reduced_to is None or route.reduced_to == rank

    def captures(self, layer: int, rank: int) -> bool:
        """Whether ``rank`` collects ``layer``'s statistics in the hooks.

        Every rank contributes to an exchanged factor; one that is not exchanged is captured
        only where it is kept.
        """
        if self.exchange != "none":
            return True
        return any(self.holds_factor(self.route((layer, side)), rank) for side in FACTOR_SIDES)

    def decomposes(self, route: FactorRoute, rank: int) -> bool:
        """Whether ``rank`` decomposes ``route``'s factor."""
        return route.decomposed_by in (rank, EVERY_WORKER)

    def holds_decomposition(self, key: FactorKey, rank: int) -> bool:
        """Whether ``rank`` ends a decomposition step with factor ``key``'s decomposition."""
        return self.decomposes(self.route(key), rank) or rank in self._receivers.get(key, ())

    def holds_inverse(self, layer: int, rank: int) -> bool:
        """Whether ``rank`` holds ``layer``'s inverse (and so preconditions it)."""
        return rank in self._inverse_holders[layer]

    def inverse_holders(self, layer: int) -> frozenset[int]:
        """The ranks that hold ``layer``'s inverse (the same answer on every rank)."""
        return self._inverse_holders[layer]

    @cached_property
    def _inverse_holders(self) -> list[frozenset[int]]:
        ranks = range(self.world_size)
        return [
            frozenset(
                r
                for r in ranks
                if all(self.holds_decomposition((layer, side), r) for side in FACTOR_SIDES)
            )
            for layer in range(self.layer_count)
        ]

    def exchanges_traces(self) -> bool:
        """Whether a decomposer lacks the other factor of its layer (``π`` needs both traces).

        Then the factored Tikhonov damping (``inverse_method`` ``"inverse"`` or ``"cholesky"``)
        takes ``tr(F)/d`` of every factor from the rank that holds it, in one small allreduce.
        """
        return not all(self.deciders_hold_layer(route) for route in self.factors)

    def group_layouts(self) -> list[tuple[int, ...]]:
        """The process groups the shares need, in first-use order (the same on every rank)."""
        layouts: list[tuple[int, ...]] = []
        groups = [share.group for share in self.decompositions]
        for group in groups + [share.group for share in self.gradients]:
            if group not in layouts:
                layouts.append(group)
        return layouts

    # -- accounting ------------------------------------------------------------------------
    def decomposition_work(self, rank: int) -> int:
        """``Σ d³`` over the factors ``rank`` decomposes (``d`` for a diagonal one)."""
        return sum(
            int(decomposition_work(route.dim))
            for route in self.factors
            if self.decomposes(route, rank)
        )

    def describe(self, names: Sequence[str]) -> list[FactorRow]:
        """``plan()["factors"]``: per factor its layer name, dim, destination and decomposer."""
        return [
            {
                "layer": names[route.layer],
                "factor": route.side.upper(),
                "dim": int(route.dim),
                "diagonal": is_diagonal(route.dim),
                "reduced_to": _reduced_to(self.exchange, route.reduced_to),
                "decomposed_by": "all"
                if route.decomposed_by == EVERY_WORKER
                else route.decomposed_by,
            }
            for route in self.factors
        ]


def other_side(side: str) -> str:
    """The other factor of the layer: ``"g"`` for ``"a"`` and back."""
    return FACTOR_SIDES[1 - FACTOR_SIDES.index(side)]


def _reduced_to(exchange: FactorExchange, reduced_to: int | None) -> int | str:
    if exchange == "none":
        return "none (owner's shard only)"
    return "all" if reduced_to is None else reduced_to


def layer_owner_routes(
    dims: Sequence[tuple[int, int]], owners: Sequence[int], reduced_to: int | None = None
) -> tuple[FactorRoute, ...]:
    """Both factors of each layer (A then G, layers in order), decomposed by the layer's owner."""
    return tuple(
        FactorRoute(layer, side, dim, reduced_to, owner)
        for layer, (pair, owner) in enumerate(zip(dims, owners, strict=True))
        for side, dim in zip(FACTOR_SIDES, pair, strict=True)
    )


def gradient_shares(
    owners_in_group: Sequence[int], group: Sequence[int]
) -> tuple[GradientShare, ...]:
    """Per source (ascending) the layers whose preconditioned gradient it sends in ``group``.

    Args:
        owners_in_group: per layer, the rank of ``group`` that preconditions it.
        group: the ranks that take part; a group of one rank shares nothing.
    """
    if len(group) < 2:
        return ()
    return tuple(
        GradientShare(source, tuple(layers), tuple(group))
        for source, layers in group_by_source(owners_in_group)
    )
