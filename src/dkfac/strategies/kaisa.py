"""``strategy="kaisa"``: KAISA's gradient-worker fraction (Pauloski et al., SC21).

P workers form a ``(P/g) × g`` grid, ``g = grad_worker_fraction · P``: grid rows are the
*gradient-worker groups*, grid columns the *receiver groups*. Per step:

1. factor statistics are allreduced (sums weighted by rows/examples, symmetric factors packed,
   fused) and every worker keeps the global running factors;
2. each layer's owner (LPT over all workers on ``d_A³ + d_G³``) decomposes it and broadcasts the
   decomposition inside its grid row (fused, one bucket list per owner);
3. every worker of that row preconditions the layer; each of them broadcasts the result down
   its grid column, so every worker ends with every preconditioned gradient.

``g = P`` (fraction 1) is COMM-OPT, i.e. D-KFAC: decompositions go to everyone and no gradient
is sent. ``g = 1`` (fraction 1/P) is MEM-OPT: only the owner holds a layer's decomposition and it
broadcasts the preconditioned gradient to all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.inverse import FACTOR_SIDES, inverse_from_tensors
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import DistributedStrategy, layer_owner_factors
from dkfac.strategies.decomposition_payload import (
    DecompositionPayload,
    share_payloads,
    valid_flags,
)
from dkfac.strategies.local import decompose_here
from dkfac.strategies.placement import longest_processing_time
from dkfac.strategies.registry import KAISAOptions


def plan_layer_owners(dims: Sequence[tuple[int, int]], world_size: int) -> list[int]:
    """Owner of each layer: longest-processing-time on the decomposition cost ``d_A³ + d_G³``.

    Args:
        dims: ``(d_A, d_G)`` of each layer, in registration order.
        world_size: number of workers.
    """
    return longest_processing_time([float(a**3 + g**3) for a, g in dims], world_size)


def grid(world_size: int, grad_workers: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows (gradient-worker groups) and columns (receiver groups) of the worker grid."""
    g = grad_workers
    rows = [list(range(r * g, (r + 1) * g)) for r in range(world_size // g)]
    columns = [list(range(c, world_size, g)) for c in range(g)]
    return rows, columns


def row_broadcasts(
    owners: Sequence[int], grad_workers: int, row: int, world_size: int
) -> list[tuple[int, list[int]]]:
    """``(owner, layer indices)`` of every owner in grid row ``row`` that owns layers.

    One fused decomposition broadcast each, inside the row, in this (ascending) order.
    """
    result = []
    for owner in range(world_size):
        if owner // grad_workers != row:
            continue
        owned = [index for index, o in enumerate(owners) if o == owner]
        if owned:
            result.append((owner, owned))
    return result


def column_sources(owners: Sequence[int], grad_workers: int, column: int) -> list[int]:
    """Per layer, the rank of grid column ``column`` that preconditions it (in the owner's row)."""
    return [(owner // grad_workers) * grad_workers + column for owner in owners]


class KAISAStrategy(DistributedStrategy):
    """Gradient-worker fraction ``f``: decompositions shared by ``f·P`` workers per layer."""

    name = "kaisa"

    def __init__(self, comm: Communicator, recorder: StepRecorder, options: KAISAOptions) -> None:
        self.comm = comm
        self.recorder = recorder
        world, rank = comm.world_size, comm.rank
        self.grad_workers = options.grad_workers(world)
        g = self.grad_workers
        self.rows, self.columns = grid(world, g)
        groups = comm.new_groups(self.rows + self.columns)
        self.row_group = [groups[tuple(row)] for row in self.rows]
        self.column_group = groups[tuple(self.columns[rank % g])]
        self.my_row, self.my_column = rank // g, rank % g
        self.owner: dict[str, int] = {}

    def setup(self, layers: Sequence[LayerCurvature], *, accumulation_steps: int = 1) -> None:
        """Owners by longest-processing-time on the decomposition cost ``d_A³ + d_G³``."""
        dims = [(layer.block.a_dim, layer.block.g_dim) for layer in layers]
        owners = plan_layer_owners(dims, self.comm.world_size)
        self.owner = {layer.name: owner for layer, owner in zip(layers, owners, strict=True)}
        self.dims = {layer.name: (layer.block.a_dim, layer.block.g_dim) for layer in layers}

    def plan(self) -> dict[str, Any]:
        """Owner of each layer's factors; one fused allreduce of all factors at ``step()``."""
        factors = layer_owner_factors(self.dims, self.owner, "all")
        return {
            "strategy": self.name,
            "grad_workers": self.grad_workers,
            "factors": factors,
            "buckets": [],
        }

    # -- factors ---------------------------------------------------------------------------
    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Allreduce the weighted statistics, then fold the global batch factors everywhere.

        Each factor pools the workers that have statistics for it (``A`` where the layer's
        forward ran, ``G`` where a gradient reached its output) and is folded when some
        worker had any, as :func:`~dkfac.strategies.local.fold_here` does alone.
        """
        tensors, counts = [], []
        for layer in layers:
            for side in FACTOR_SIDES:
                if layer.statistics(side).has_statistics:
                    total, count = layer.summed_factor(side, loss_reduction)
                else:  # still take part: every worker must issue the same collectives
                    total, count = layer.zeros(side), 0
                tensors.append(total)
                counts.append(count)
            layer.clear_statistics()
        # Counts travel in float64 on their own (also under comm_dtype): exact integers even
        # summed over many workers, and they do not force the factor bucket into float64.
        counts_tensor = torch.tensor(counts, dtype=torch.float64, device=tensors[0].device)
        with self.recorder.phase("factor_comm"):
            count_handle = self.comm.allreduce([counts_tensor], phase="factor_comm", exact=True)
            self.comm.allreduce(
                tensors, phase="factor_comm", symmetric=[True] * len(tensors)
            ).wait()
            count_handle.wait()
        totals = counts_tensor.tolist()  # one host synchronisation per factor update
        for index, layer in enumerate(layers):
            for position, side in enumerate(FACTOR_SIDES):
                slot = 2 * index + position
                if fold and totals[slot] > 0:
                    layer.fold_factor(side, tensors[slot] / totals[slot], decay)

    # -- decompositions --------------------------------------------------------------------
    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Owners decompose; each owner broadcasts inside its gradient-worker row."""
        rank = self.comm.rank
        mine = [layer for layer in layers if self.owner[layer.name] == rank]
        decompose_here(self.recorder, mine, damping, method, dtype)
        owners = [self.owner[layer.name] for layer in layers]
        broadcasts = row_broadcasts(owners, self.grad_workers, self.my_row, self.comm.world_size)
        group = self.row_group[self.my_row]
        received = [i for _, indices in broadcasts for i in indices]
        with self.recorder.phase("inverse_comm"):
            payloads = {
                i: _layer_payload(layers[i], method, dtype, owners[i] == rank) for i in received
            }
            per_source = [(owner, [payloads[i] for i in indices]) for owner, indices in broadcasts]
            share_payloads(self.comm, per_source, group=group, launch=group is not None)
        valid = valid_flags([payloads[i] for i in received])
        for i, ok in zip(received, valid, strict=True):
            layers[i].inverse = inverse_from_tensors(method, payloads[i].named()) if ok else None

    # -- preconditioning -------------------------------------------------------------------
    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Gradient workers precondition; results travel down the grid columns.

        In its grid column, a layer's gradient worker is the one rank of the owner's row.
        Without a column group (f = 1, every worker is a gradient worker) nothing is sent.
        """
        if self.column_group is None:
            return self.precondition_and_broadcast(layers, grads, damping, None)
        owners = [self.owner[layer.name] for layer in layers]
        sources = column_sources(owners, self.grad_workers, self.my_column)
        return self.precondition_and_broadcast(layers, grads, damping, sources, self.column_group)


def _layer_payload(
    layer: LayerCurvature, method: str, dtype: torch.dtype, send: bool
) -> DecompositionPayload:
    """``layer``'s decomposition (both factors) as its owner sends it, or receive buffers."""
    block = layer.block
    inverse = layer.inverse if send else None
    return DecompositionPayload.build(
        method,
        [("a", block.a_dim), ("g", block.g_dim)],
        None if inverse is None else inverse.tensors(),
        dtype,
        block.weight.device,
    )
