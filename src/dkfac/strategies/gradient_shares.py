"""A placement's gradient phase on one rank: its layers preconditioned, the results shared.

A rank preconditions the layers whose inverse it holds (equal-shaped ones together, through
:class:`~dkfac.curvature.layer_stacks.LayerStacks`) and broadcasts the results in the
placement's planned shares. Which layers those are and which shares this rank joins depend
only on the placement and on which layers have a gradient this step; a plain step asks for the
same ones every time, so the answer is kept until either changes (a step's host time is a GPU
step's floor on small models: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.handle import CollectiveHandle
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.layer_stacks import LayerStacks
from dkfac.strategies.plan import GradientShare, Placement


@dataclass(frozen=True, eq=False)
class _Route:
    """What one rank does with the gradients of one set of layers under one placement.

    ``held``: positions (in the call) of the layers whose inverse this rank holds, with the
    ranks that hold each (``domains``); ``shares``: the broadcasts this rank takes part in,
    each with the positions of its layers present in the call (none left empty).
    """

    placement: Placement
    indices: tuple[int, ...]
    held: tuple[int, ...]
    domains: tuple[frozenset[int], ...]
    shares: tuple[tuple[GradientShare, tuple[int, ...]], ...]


def _route(placement: Placement, rank: int, indices: tuple[int, ...]) -> _Route:
    """This rank's part in preconditioning and sharing the layers ``indices``."""
    holders = [placement.inverse_holders(index) for index in indices]
    held = tuple(p for p, ranks in enumerate(holders) if rank in ranks)
    position = {index: p for p, index in enumerate(indices)}
    shares = [
        (share, tuple(position[i] for i in share.layers if i in position))
        for share in placement.gradients
        if rank in share.group
    ]
    return _Route(
        placement,
        indices,
        held,
        tuple(holders[p] for p in held),
        tuple((share, positions) for share, positions in shares if positions),
    )


class GradientShares:
    """Preconditions this rank's layers and shares the results as a placement plans.

    Args:
        rank: this worker's rank in the placements.
        recorder: phase timing and accounting.
        stacks: preconditions equal-shaped layers together.
        comm: the communicator (called only when a share is sent: ``None`` may raise).
        groups: the process groups of the placement's layouts.
    """

    def __init__(
        self,
        rank: int,
        recorder: StepRecorder,
        stacks: LayerStacks,
        comm: Callable[[], Communicator],
        groups: Mapping[tuple[int, ...], Any],
    ) -> None:
        self.rank = rank
        self.recorder = recorder
        self.stacks = stacks
        self._comm = comm
        self._groups = groups
        self._route: _Route | None = None  # the last call's (a plain step repeats it)

    def route(self, placement: Placement, indices: Sequence[int]) -> _Route:
        """This rank's part for ``indices`` under ``placement`` (kept while both repeat)."""
        key = tuple(indices)
        route = self._route
        if route is None or route.placement is not placement or route.indices != key:
            route = self._route = _route(placement, self.rank, key)
        return route

    def precondition(
        self,
        placement: Placement,
        indices: Sequence[int],
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
    ) -> list[Tensor]:
        """Preconditioned gradients of ``layers`` (plan indices ``indices``), on this rank.

        This rank preconditions the layers whose inverse it holds; the rest arrive in shares.
        """
        route = self.route(placement, indices)
        results = list(grads)
        with self.recorder.phase("precondition"):
            held = route.held
            done = self.stacks.precondition(
                [layers[p] for p in held], [grads[p] for p in held], damping, route.domains
            )
            for p, result in zip(held, done, strict=True):
                # No inverse gives the gradient itself: a rounding broadcast must not alter it.
                results[p] = result.clone() if result is grads[p] else result
        return self.share(route, results)

    def share(self, route: _Route, results: Sequence[Tensor]) -> list[Tensor]:
        """Broadcast the preconditioned gradients of ``route``'s shares.

        Layers not in the route's indices (no gradient this step, the same on every rank) are
        left out of their shares; a share left empty is not sent.
        """
        updated = list(results)
        if not route.shares:
            return updated
        comm = self._comm()
        handles: list[CollectiveHandle] = []
        with self.recorder.phase("grad_comm"):
            for share, positions in route.shares:
                buffers = [
                    results[p] if share.source == self.rank else torch.empty_like(results[p])
                    for p in positions
                ]
                handles.append(
                    comm.broadcast(
                        buffers, share.source, phase="grad_comm", group=self._groups[share.group]
                    )
                )
                for p, buffer in zip(positions, buffers, strict=True):
                    updated[p] = buffer
            for handle in handles:
                handle.wait()
        return updated
