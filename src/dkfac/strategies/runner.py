"""One runner for every strategy: it executes a :class:`~dkfac.strategies.plan.Placement`.

A strategy decides (its placement, and for SPD/PAD when each factor is handed over); this
module does, on one rank, the three phases of any placement:

* factor exchange: fold the factors a rank captured alone (``exchange="none"``), allreduce
  every factor's summed statistics at ``step()`` (``"step"``), or finish the collectives the
  hooks launched through a :class:`~dkfac.strategies.pipeline.FactorPipeline` (``"hooks"``);
* decompositions: decompose the factors this rank is given, broadcast them in the planned
  shares, install every inverse this rank holds;
* gradients: precondition the layers whose inverse this rank holds, broadcast the results in
  the planned shares (:class:`~dkfac.strategies.gradient_shares.GradientShares`).

The collectives are issued by :meth:`send_factor_sums`, :meth:`share_traces`,
:meth:`share_decompositions` and :meth:`share_gradients`, which the dry run calls on a
:class:`~dkfac.comm.recording.RecordingCommunicator` (shape-only tensors): said here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.handle import CollectiveHandle
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.batching import Batching
from dkfac.curvature.decomposition import decompose_factors
from dkfac.curvature.factor_decomposition import shifted_method
from dkfac.curvature.factor_side import FACTOR_SIDES, sent_symmetric
from dkfac.curvature.inverse import combine_factors
from dkfac.curvature.kronecker_factor import fold_counted, fold_sums, window_sums
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.layer_stacks import LayerStacks
from dkfac.curvature.running_average import FOLD_STACK_BYTES
from dkfac.curvature.staging import host_floats
from dkfac.curvature.tikhonov import shift_table, trace_means
from dkfac.strategies.decomposition_payload import (
    DecompositionPayload,
    DecompositionsByFactor,
    build_payloads,
    valid_flags,
)
from dkfac.strategies.decomposition_requests import decomposes_now, factor_request
from dkfac.strategies.gradient_shares import GradientShares
from dkfac.strategies.pipeline import FactorPipeline, FactorSlot
from dkfac.strategies.plan import (
    EVERY_WORKER,
    DecompositionShare,
    FactorRoute,
    Placement,
)


class PlacementRunner:
    """Executes ``placement`` as rank ``rank``.

    Args:
        placement: the plan (the same on every rank).
        rank: this worker's rank in the placement.
        recorder: phase timing and accounting.
        comm: the communicator; ``None`` for a placement that sends nothing (one worker).
        batching: which equal-shaped work runs batched (default: none); layers and factors
            are batched only with others held, or decomposed, by the same ranks.
    """

    def __init__(
        self,
        placement: Placement,
        rank: int,
        recorder: StepRecorder,
        comm: Communicator | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.placement = placement
        self.rank = rank
        self.recorder = recorder
        self.comm = comm
        self.batching = batching if batching is not None else Batching()
        self.stacks = LayerStacks(self.batching.preconditioning)
        self._stack_bytes = FOLD_STACK_BYTES if self.batching.factor_updates else 0  # 0: alone
        layouts = placement.group_layouts()
        if (layouts or placement.exchange != "none") and comm is None:
            raise ValueError("a placement that sends data needs a communicator")
        self.groups = comm.new_groups(layouts) if comm is not None else {}
        self.gradients = GradientShares(rank, recorder, self.stacks, self._comm, self.groups)
        self.pipeline: FactorPipeline | None = None
        if comm is not None:  # roots are fixed for the run (re-planning only re-buckets)
            comm.open_lanes(placement.roots(comm.ranks))
        if placement.exchange == "hooks":
            assert comm is not None
            slots = [FactorSlot(r.layer, r.side, r.dim) for r in placement.factors]
            destinations = placement.bucket_destinations()
            self.pipeline = FactorPipeline(comm, recorder, slots, placement.buckets, destinations)

    def set_buckets(self, buckets: Sequence[Sequence[int]]) -> None:
        """Replace the fusion plan of a hook exchange (between steps, the same on every rank)."""
        assert self.pipeline is not None, "only placements with exchange='hooks' have buckets"
        self.placement = replace(self.placement, buckets=tuple(tuple(b) for b in buckets))
        self.pipeline.set_plan(buckets, self.placement.bucket_destinations())

    def _comm(self) -> Communicator:
        assert self.comm is not None, "checked at construction"
        return self.comm

    # -- factor exchange ---------------------------------------------------------------------
    def exchange_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
        profile: bool = False,
    ) -> None:
        """Turn the window's statistics into running factors where the plan keeps them.

        Each factor is folded when some worker that contributes to it had statistics (``A``
        where the layer's forward ran, ``G`` where a gradient reached its output), as
        ``strategy="local"`` does alone; ``fold=False`` exchanges as usual, so every worker
        issues the same collectives, and folds nothing. ``profile`` (hooks only) keeps the
        window's ready times for re-planning.
        """
        if self.placement.exchange == "none":
            held = [
                layers[route.layer].factors[route.side]
                for route in self.placement.factors
                if fold and self.placement.holds_factor(route, self.rank)
            ]
            windows, totals, counts = window_sums(held, loss_reduction)
            idle = [factor for factor in held if not factor.statistics.has_statistics]
            fold_counted(windows, totals, counts, decay, self._stack_bytes, idle)
        elif self.placement.exchange == "step":
            self._exchange_at_step(layers, decay, loss_reduction, fold)
        else:
            self._finish_hooked(layers, decay, loss_reduction, fold, profile)
        for layer in layers:
            layer.clear_statistics()

    def _exchange_at_step(
        self, layers: Sequence[LayerCurvature], decay: float, loss_reduction: str, fold: bool
    ) -> None:
        totals, counts = [], []
        for route in self.placement.factors:
            layer = layers[route.layer]
            if layer.statistics(route.side).has_statistics:
                total, count = layer.summed_factor(route.side, loss_reduction)
            else:  # still take part: every worker must issue the same collectives
                total, count = layer.zeros(route.side), 0
            totals.append(total)
            counts.append(count)
        # Counts travel in float64 on their own (also under comm_dtype): exact integers even
        # summed over many workers, and they do not force the factor bucket into float64.
        counts_tensor = host_floats(counts, totals[0].device)
        self.send_factor_sums(totals, counts_tensor)
        if fold:
            factors = [layers[route.layer].factors[route.side] for route in self.placement.factors]
            fold_sums(factors, totals, counts_tensor, decay, stack_bytes=self._stack_bytes)

    def counts_buffer(self, device: torch.device) -> Tensor:
        """The float64 counts (rows or examples) of every factor, zero, in exchange order."""
        return torch.zeros(len(self.placement.factors), dtype=torch.float64, device=device)

    def send_factor_sums(self, totals: Sequence[Tensor], counts: Tensor) -> None:
        """Allreduce the float64 counts and the packed factor sums (fused), and wait."""
        comm = self._comm()
        with self.recorder.phase("factor_comm"):
            count_handle = comm.allreduce([counts], phase="factor_comm", exact=True)
            comm.allreduce(totals, phase="factor_comm", symmetric=sent_symmetric(totals)).wait()
            count_handle.wait()

    def hand_over(
        self, layers: Sequence[LayerCurvature], layer: int, side: str, loss_reduction: str
    ) -> None:
        """Give factor ``(layer, side)``'s summed statistics to the pipeline (from a hook)."""
        assert self.pipeline is not None, "only placements with exchange='hooks' hand over"
        summed = layers[layer].statistics(side).hand_over(loss_reduction)
        self.pipeline.ready(layer, side, summed.total, summed.count)

    def _finish_hooked(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        fold: bool,
        profile: bool,
    ) -> None:
        """Hand over what the hooks did not, correct for late statistics, fold where kept."""
        assert self.pipeline is not None
        routes = self.placement.factors
        for route in routes:
            stats = layers[route.layer].statistics(route.side)
            if stats.has_statistics and not stats.handed_over:
                self.hand_over(layers, route.layer, route.side, loss_reduction)
        late = [layers[r.layer].statistics(r.side).late(loss_reduction) for r in routes]
        received = self.pipeline.finish(
            lambda slot: layers[slot.layer].zeros(slot.side), profile, late
        )
        held = [
            (layers[r.layer].factors[r.side], f)
            for r, f in zip(routes, received, strict=True)
            if fold and self.placement.holds_factor(r, self.rank)
        ]
        kept = [(factor, f) for factor, f in held if f.count > 0]
        idle = [factor for factor, f in held if f.count == 0]
        totals, counts = [f.total for _, f in kept], [f.count for _, f in kept]
        factors = [factor for factor, _ in kept]
        fold_counted(factors, totals, counts, decay, self._stack_bytes, idle)

    # -- decompositions ----------------------------------------------------------------------
    def decompose_and_share(
        self,
        layers: Sequence[LayerCurvature],
        damping: float,
        method: str,
        dtype: torch.dtype,
    ) -> None:
        """Decompose this rank's factors, share them as planned, install the inverses it holds.

        A layer keeps its last inverse unless both of its factors arrived (or were computed
        here) valid; the decision is the same on every rank of a share, because validity
        travels with the payload.
        """
        plan, rank = self.placement, self.rank
        mine = [route for route in plan.factors if decomposes_now(plan, rank, layers, route)]
        shifts = None
        if shifted_method(method):
            shifts = shift_table(self._trace_means(layers, dtype, mine), damping)
        requests = [factor_request(plan, layers, route, shifts, damping) for route in mine]
        with self.recorder.phase("inverse_compute"):
            batch = self.batching.decompositions
            results = decompose_factors(requests, method, dtype, batch_up_to=batch)
        decompositions: DecompositionsByFactor = {
            route.key: result for route, result in zip(mine, results, strict=True)
        }
        device = layers[0].block.weight.device if layers else torch.device("cpu")
        payloads = self.decomposition_payloads(method, dtype, device, decompositions)
        self.share_decompositions(payloads)
        flat = [payload for unit_payloads in payloads for payload in unit_payloads]
        units = [unit for share in self._my_shares() for unit in share.units]
        for unit, payload, ok in zip(units, flat, valid_flags(flat), strict=True):
            for key in unit:
                decompositions[key] = payload.decomposition(key[1]) if ok else None
        for index, layer in enumerate(layers):
            a, g = (decompositions.get((index, side)) for side in FACTOR_SIDES)
            if plan.holds_inverse(index, rank) and a is not None and g is not None:
                layer.inverse = combine_factors(method, a, g)

    def _trace_means(
        self, layers: Sequence[LayerCurvature], dtype: torch.dtype, mine: Sequence[FactorRoute]
    ) -> Tensor:
        """``tr(F)/d`` of the factors the Tikhonov shifts need, ``(L, 2)``, as one worker's.

        Where a decomposer lacks the other factor of its layer (:meth:`Placement.
        exchanges_traces`), each value comes from the factor's decomposer (rank 0 for a
        factor every worker decomposes) and the others add zeros, so every rank gets bitwise
        the single-worker value; otherwise each rank reads both factors of the layers it
        decomposes (``mine``), and the other rows stay zero (unused).
        """
        plan, rank = self.placement, self.rank
        device = layers[0].block.weight.device
        means = self.trace_buffer(dtype, device)
        exchange = self.placement.exchanges_traces()  # asked only by shifted methods
        if exchange:
            wanted = [
                route
                for route in plan.factors
                if route.decomposed_by == rank
                or (route.decomposed_by == EVERY_WORKER and rank == 0)
            ]
        else:
            needed = {route.layer for route in mine}
            wanted = [route for route in plan.factors if route.layer in needed]
        known = [r for r in wanted if layers[r.layer].factors[r.side].running is not None]
        if known:  # the (L, 2) table in one stack: no write per factor
            values = trace_means([layers[r.layer].factors[r.side].value() for r in known], dtype)
            entries = list(means.view(-1).unbind())
            for route, value in zip(known, values.unbind(), strict=True):
                entries[len(FACTOR_SIDES) * route.layer + FACTOR_SIDES.index(route.side)] = value
            means = torch.stack(entries).view_as(means)
        if exchange:
            self.share_traces(means)
        return means

    def trace_buffer(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Zero ``(L, 2)`` trace means, one row per layer (``A``, ``G``)."""
        return torch.zeros(self.placement.layer_count, 2, dtype=dtype, device=device)

    def exchanges_traces(self, method: str) -> bool:
        """Whether a decomposition step allreduces the trace means (:meth:`share_traces`)."""
        return shifted_method(method) and self.placement.exchanges_traces()

    def share_traces(self, means: Tensor) -> None:
        """Allreduce the ``(L, 2)`` trace means (each value from one rank, zeros elsewhere).

        In their own dtype whatever ``comm_dtype`` says: ``L × 2`` values, and the shifts are
        then the single worker's to the bit.
        """
        with self.recorder.phase("inverse_comm"):
            self._comm().allreduce([means], phase="inverse_comm", exact=True).wait()

    def _my_shares(self) -> list[DecompositionShare]:
        return [share for share in self.placement.decompositions if self.rank in share.group]

    def decomposition_payloads(
        self,
        method: str,
        dtype: torch.dtype,
        device: torch.device,
        decompositions: DecompositionsByFactor,
    ) -> list[list[DecompositionPayload]]:
        """Per share of this rank, per unit: what it sends or receives (:func:`build_payloads`)."""
        mine = self._my_shares()
        return build_payloads(
            self.placement, mine, self.rank, method, dtype, device, decompositions
        )

    def share_decompositions(self, payloads: Sequence[Sequence[DecompositionPayload]]) -> None:
        """One fused broadcast per share this rank takes part in (plan order), then wait."""
        if not payloads:
            return
        comm = self._comm()
        handles: list[CollectiveHandle] = []
        with self.recorder.phase("inverse_comm"):
            for share, unit_payloads in zip(self._my_shares(), payloads, strict=True):
                tensors = [t for payload in unit_payloads for t in payload.tensors]
                symmetric = [s for payload in unit_payloads for s in payload.symmetric]
                handles.append(
                    comm.broadcast(
                        tensors,
                        share.source,
                        phase="inverse_comm",
                        symmetric=symmetric,
                        group=self.groups[share.group],
                    )
                )
            for handle in handles:
                handle.wait()

    # -- gradients ---------------------------------------------------------------------------
    def share_gradients(self, indices: Sequence[int], results: Sequence[Tensor]) -> list[Tensor]:
        """Broadcast the preconditioned gradients of the planned shares among ``indices``.

        Layers not in ``indices`` (no gradient this step, the same on every rank) are left
        out of their shares; a share left empty is not sent.
        """
        return self.gradients.share(self.gradients.route(self.placement, indices), results)
