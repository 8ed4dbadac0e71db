"""The interface every placement strategy implements, and its one implementation.

A K-FAC step has four phases: capture statistics (in the module hooks), update factors,
update decompositions, precondition gradients. A strategy decides which worker runs which
phase for which layer (its :class:`~dkfac.strategies.plan.Placement`); the one runner
(:class:`~dkfac.strategies.runner.PlacementRunner`) executes that plan and moves the results
between workers. The preconditioner only calls these methods in order, with no knowledge of
the strategy behind them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.batching import Batching
from dkfac.curvature.inverse import bit_checksum
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.plan import Placement
from dkfac.strategies.plan_report import PlanReport
from dkfac.strategies.runner import PlacementRunner


class Strategy(ABC):
    """Placement of the K-FAC phases across workers: a plan, executed by the one runner.

    A subclass decides its :class:`~dkfac.strategies.plan.Placement` (:meth:`place`) and,
    for factors exchanged from the hooks, when each factor is handed over
    (:meth:`statistic_added`); :class:`~dkfac.strategies.runner.PlacementRunner` does the
    rest for every strategy.

    Args:
        recorder: phase timing and accounting.
        comm: the communicator; ``None`` for a strategy of one worker.
    """

    #: The ``strategy=`` name that selects this class.
    name: ClassVar[str]
    #: Whether :meth:`statistic_added` starts work (collectives) while the passes go on:
    #: statistics formed later (``batched_statistics``) would start it later.
    starts_work_from_hooks: ClassVar[bool] = False

    def __init__(self, recorder: StepRecorder, comm: Communicator | None = None) -> None:
        self.recorder = recorder
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.world_size = comm.world_size if comm is not None else 1
        self.layers: list[LayerCurvature] = []

    @abstractmethod
    def place(self, dims: Sequence[tuple[int, int]]) -> Placement:
        """The plan for layers of factor dims ``(d_A, d_G)``, in registration order.

        Pure given the strategy's construction (world size, options, cost model): the same
        on every rank, and what the dry run counts.
        """

    def setup(
        self,
        layers: Sequence[LayerCurvature],
        *,
        accumulation_steps: int = 1,
        batching: Batching | None = None,
    ) -> None:
        """Plan the placement once the preconditioned layers are known; make its groups.

        ``accumulation_steps`` is the number of backward passes a capture window is meant to
        have (a strategy may learn the real number of statistics per window from the hooks).
        ``batching``: which of this worker's equal-shaped work runs batched (default: none).
        """
        self.layers = list(layers)
        self._index = {id(layer): index for index, layer in enumerate(self.layers)}
        placement = self.place([(layer.block.a_dim, layer.block.g_dim) for layer in layers])
        self.runner = PlacementRunner(placement, self.rank, self.recorder, self.comm, batching)

    @property
    def placement(self) -> Placement:
        """The plan the runner executes (set up by :meth:`setup`)."""
        return self.runner.placement

    def index(self, layer: LayerCurvature) -> int:
        """``layer``'s index in the plan."""
        return self._index[id(layer)]

    def _indices(self, layers: Sequence[LayerCurvature]) -> list[int]:
        """The plan indices of ``layers`` (looked up in C: a plain step asks for all)."""
        return list(map(self._index.__getitem__, map(id, layers)))

    @property
    def profiling(self) -> bool:
        """Whether a coming factor update may still change the plan from measurements."""
        return False

    def statistic_added(  # noqa: B027
        self, layer: LayerCurvature, side: str, loss_reduction: str
    ) -> None:
        """The hooks added a statistic to factor ``side`` of ``layer`` (``"a"`` or ``"g"``).

        Called after every forward (``"a"``) and backward (``"g"``) statistic of the window,
        so a strategy can start moving a factor while forward/backward go on. Default:
        nothing (work waits for ``step()``).
        """

    def close(self) -> None:
        """Release the process groups the communicator made (its own, KAISA's sub-groups)."""
        if self.comm is not None:
            self.comm.close()

    def after_load(self, layers: Sequence[LayerCurvature]) -> None:
        """Drop loaded factors and decompositions the plan does not give this worker."""
        for route in self.placement.factors:
            if not self.placement.holds_factor(route, self.rank):
                layers[route.layer].set_factor(route.side, None)
        for index, layer in enumerate(layers):
            if not self.placement.holds_inverse(index, self.rank):
                layer.inverse = None

    def plan(self) -> PlanReport:
        """The placement as plain data; see ``KFACPreconditioner.plan``."""
        names = [layer.name for layer in self.layers]
        return {"strategy": self.name, "factors": self.placement.describe(names), "buckets": []}

    def captures(self, layer: LayerCurvature) -> bool:
        """Whether this worker collects ``layer``'s factor statistics in the hooks."""
        return self.placement.captures(self.index(layer), self.rank)

    def holds_factors(self, layer: LayerCurvature) -> bool:
        """Whether this worker keeps both of ``layer``'s running factors (for ``factors()``)."""
        index = self.index(layer)
        return all(
            factor.running is not None
            and self.placement.holds_factor(self.placement.route((index, side)), self.rank)
            for side, factor in layer.factors.items()
        )

    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Turn the captured statistics into running factors where the plan keeps them.

        ``fold=False`` (a step whose gradients are not finite, which the GradScaler skips):
        the statistics are exchanged as usual, so every worker issues the same collectives,
        then dropped; no running factor changes.
        """
        self.runner.exchange_factors(layers, decay, loss_reduction, fold=fold)

    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Decompose and share the decompositions as planned."""
        self.runner.decompose_and_share(layers, damping, method, dtype)

    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Preconditioned gradient matrices of ``layers``, on every worker."""
        indices = self._indices(layers)
        runner = self.runner
        return runner.gradients.precondition(runner.placement, indices, layers, grads, damping)

    def precondition_is_local(self, layers: Sequence[LayerCurvature]) -> bool:
        """Whether :meth:`precondition` of ``layers`` issues no collective on this rank."""
        return not self.runner.gradients.route(self.placement, self._indices(layers)).shares

    def check_replicas(self, layers: Sequence[LayerCurvature]) -> None:
        """Compare every layer's decomposition bits across the workers that hold it.

        Each worker sends, per layer, whether it holds a decomposition and its
        :func:`~dkfac.curvature.inverse.bit_checksum` (one all-gather of ``2·L`` int64). Workers
        that decompose the same factor independently (SPD-KFAC's "everywhere" factors) can
        round differently on mixed hardware, and the replicas of the model then drift apart.
        One worker has nothing to compare.

        Raises:
            RuntimeError: some layer's decomposition differs between workers (every worker
                raises the same error, naming the layers and the ranks).
        """
        if self.comm is None:
            return
        device = layers[0].block.weight.device
        local = torch.zeros(len(layers), 2, dtype=torch.int64, device=device)
        for index, layer in enumerate(layers):
            if layer.inverse is not None:
                local[index, 0] = 1
                local[index, 1] = bit_checksum(layer.inverse.tensors())
        gathered = torch.empty(
            self.comm.world_size * local.numel(), dtype=torch.int64, device=device
        )
        with self.recorder.phase("inverse_comm"):
            self.comm.all_gather(local.reshape(-1), gathered, phase="replica_check").wait()
        table = gathered.reshape(self.comm.world_size, len(layers), 2).tolist()
        differing = []
        for index, layer in enumerate(layers):
            holders = {rank: row[index][1] for rank, row in enumerate(table) if row[index][0]}
            if len(set(holders.values())) > 1:
                first = min(holders)
                others = sorted(r for r, c in holders.items() if c != holders[first])
                differing.append(f"{layer.name!r} (ranks {others} differ from rank {first})")
        if differing:
            raise RuntimeError(
                "K-FAC replicas diverged: workers hold different decompositions of layer(s) "
                + ", ".join(differing)
                + ". Workers that decompose a factor independently must compute bitwise the "
                "same result (same hardware, same libraries); otherwise use a strategy that "
                "decomposes each factor once and broadcasts it (strategy='pad' or 'dkfac')"
            )

    def average(self, values: Tensor) -> Tensor:
        """The element-wise mean of a float64 vector over all workers (one allreduce).

        Sent as float64 whatever ``comm_dtype`` says; every worker gets the same bits.
        """
        if self.comm is None:
            return values
        averaged = values.clone()
        self.comm.allreduce([averaged], phase="adaptive", average=True, exact=True).wait()
        return averaged

    def any_worker(self, flags: Sequence[bool], device: torch.device) -> list[bool]:
        """Element-wise OR of ``flags`` over all workers.

        One maximum-allreduce of ``len(flags)`` values and one host read; one worker answers
        alone.
        """
        # The agreement is factor-step traffic.
        values = self._maximum(
            [float(flag) for flag in flags], device, "factor_comm", "layer_usage"
        )
        return [value > 0 for value in values]

    def largest(self, values: Sequence[int], device: torch.device) -> list[int]:
        """Element-wise largest of every worker's ``values``: the intervals all of them take.

        One maximum-allreduce and one host read; one worker answers alone.
        """
        reduced = self._maximum([float(v) for v in values], device, "inverse_comm", "intervals")
        return [int(value) for value in reduced]

    def _maximum(
        self, values: list[float], device: torch.device, step_phase: str, phase: str
    ) -> list[float]:
        """Element-wise maximum of float64 ``values`` over all workers.

        Recorded under ``step_phase`` (the step's part) and ``phase`` (the collective's name).
        """
        if self.comm is None:
            return values
        reduced = torch.tensor(values, dtype=torch.float64, device=device)
        with self.recorder.phase(step_phase):
            self.comm.allreduce([reduced], phase=phase, maximum=True, exact=True).wait()
        return [float(value) for value in reduced.tolist()]
