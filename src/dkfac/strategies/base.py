"""The interface every placement strategy implements.

A K-FAC step has four phases: capture statistics (in the module hooks), update factors,
update decompositions, precondition gradients. A strategy decides which worker runs which
phase for which layer and moves the results between workers; the preconditioner only calls
these methods in order, with no knowledge of the strategy behind them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.inverse import bit_checksum
from dkfac.curvature.layer import LayerCurvature


class Strategy(ABC):
    """Placement of the K-FAC phases across workers."""

    #: The ``strategy=`` name that selects this class.
    name: ClassVar[str]

    def setup(  # noqa: B027
        self, layers: Sequence[LayerCurvature], *, accumulation_steps: int = 1
    ) -> None:
        """Plan ownership once the preconditioned layers are known (default: nothing).

        ``accumulation_steps`` is the number of backward passes a capture window is meant to
        have (a strategy may learn the real number of statistics per window from the hooks).
        """

    def statistic_added(  # noqa: B027
        self, layer: LayerCurvature, side: str, loss_reduction: str
    ) -> None:
        """The hooks added a statistic to factor ``side`` of ``layer`` (``"a"`` or ``"g"``).

        Called after every forward (``"a"``) and backward (``"g"``) statistic of the window,
        so a strategy can start moving a factor while forward/backward go on. Default:
        nothing (work waits for ``step()``).
        """

    def close(self) -> None:  # noqa: B027
        """Release what the strategy created (process groups); default: nothing."""

    def after_load(self, layers: Sequence[LayerCurvature]) -> None:  # noqa: B027
        """Drop loaded state this worker does not keep (default: keep everything)."""

    def plan(self) -> dict[str, Any]:
        """The placement (and fusion) plan as plain data; see ``KFACPreconditioner.plan``."""
        return {"strategy": self.name, "factors": [], "buckets": []}

    def check_replicas(self, layers: Sequence[LayerCurvature]) -> None:  # noqa: B027
        """Raise if workers hold different decompositions of a layer (default: one worker)."""

    def any_worker(self, flags: Sequence[bool], device: torch.device) -> list[bool]:
        """Element-wise OR of ``flags`` over all workers (default: this worker is all there is).

        Distributed strategies answer with one small collective and one host read.
        """
        return list(flags)

    def captures(self, layer: LayerCurvature) -> bool:
        """Whether this worker collects ``layer``'s factor statistics in the hooks."""
        return True

    def holds_factors(self, layer: LayerCurvature) -> bool:
        """Whether this worker keeps ``layer``'s running factors (for ``factors()``)."""
        return layer.a is not None

    @abstractmethod
    def update_factors(
        self,
        layers: Sequence[LayerCurvature],
        decay: float,
        loss_reduction: str,
        *,
        fold: bool = True,
    ) -> None:
        """Turn the captured statistics into running factors where they are needed.

        ``fold=False`` (a step whose gradients are not finite, which the GradScaler skips):
        the statistics are exchanged as usual, so every worker issues the same collectives,
        then dropped; no running factor changes.
        """

    @abstractmethod
    def update_inverses(
        self, layers: Sequence[LayerCurvature], damping: float, method: str, dtype: torch.dtype
    ) -> None:
        """Refresh the decompositions where they are needed."""

    @abstractmethod
    def precondition(
        self, layers: Sequence[LayerCurvature], grads: Sequence[Tensor], damping: float
    ) -> list[Tensor]:
        """Preconditioned gradient matrices of ``layers``, on every worker."""


class DistributedStrategy(Strategy):
    """A strategy whose workers talk through a :class:`Communicator`."""

    comm: Communicator
    recorder: StepRecorder

    def close(self) -> None:
        """Release the process groups the communicator made (its own, KAISA's sub-groups)."""
        self.comm.close()

    def check_replicas(self, layers: Sequence[LayerCurvature]) -> None:
        """Compare every layer's decomposition bits across the workers that hold it.

        Each worker sends, per layer, whether it holds a decomposition and its
        :func:`~dkfac.curvature.inverse.bit_checksum` (one all-gather of ``2·L`` int64). Workers
        that decompose the same factor independently (SPD-KFAC's "everywhere" factors) can
        round differently on mixed hardware, and the replicas of the model then drift apart.

        Raises:
            RuntimeError: some layer's decomposition differs between workers (every worker
                raises the same error, naming the layers and the ranks).
        """
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

    def precondition_and_broadcast(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
        sources: Sequence[int] | None,
        group: Any = None,
    ) -> list[Tensor]:
        """Each layer preconditioned by its source rank, then broadcast from there.

        ``sources``: per layer, the (global) rank that preconditions it and sends the result
        to the other members of ``group`` (default: the world), fused per source; ``None``:
        this worker preconditions every layer itself and nothing is sent.
        """
        results: list[Tensor] = list(grads)
        rank = self.comm.rank
        with self.recorder.phase("precondition"):
            for index, layer in enumerate(layers):
                if sources is None or sources[index] == rank:
                    results[index] = layer.precondition(grads[index], damping)
        if sources is None:
            return results
        with self.recorder.phase("grad_comm"):
            return self.comm.broadcast_from(results, sources, phase="grad_comm", group=group)

    def any_worker(self, flags: Sequence[bool], device: torch.device) -> list[bool]:
        """Element-wise OR over the workers: one maximum-allreduce of ``len(flags)`` values."""
        values = torch.tensor([float(flag) for flag in flags], dtype=torch.float64, device=device)
        with self.recorder.phase("factor_comm"):  # the agreement is factor-step traffic
            self.comm.allreduce([values], phase="layer_usage", maximum=True, exact=True).wait()
        return [value > 0 for value in values.tolist()]


def layer_owner_factors(
    dims: dict[str, tuple[int, int]], owner: dict[str, int], reduced_to: str
) -> list[dict[str, Any]]:
    """``plan()["factors"]`` of a strategy that places whole layers: both factors, one owner."""
    return [
        {
            "layer": name,
            "factor": side,
            "dim": dim,
            "reduced_to": reduced_to,
            "decomposed_by": owner[name],
        }
        for name, pair in dims.items()
        for side, dim in zip("AG", pair, strict=True)
    ]
