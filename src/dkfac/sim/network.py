"""How long one collective takes on a switched cluster: what each worker's uplink carries.

Every worker has a full-duplex link of the same rate to a non-blocking switch (the emulated
cluster of :mod:`dkfac.bench.emulated_cluster`, a 10 GbE rack, one InfiniBand port per node).
A collective is bandwidth-bound on the uplinks it loads: it lasts ``max(load) / bandwidth``
plus one start-up latency per communication step of its algorithm. The loads are those of
the bandwidth-optimal algorithms the backends run:

* allreduce (ring): every member sends ``2(p-1)/p`` of the payload, in ``2(p-1)`` steps;
* reduce-scatter, all-gather (ring): ``(p-1)/p``, in ``p-1`` steps;
* reduce to a root, broadcast from a root (pipelined chain): every member but the chain's
  last sends the whole payload, in ``p-1`` steps. At two ranks this is one send: the reduce
  of :class:`~dkfac.comm.communicator.Communicator` on gloo is exactly that, and leaves the
  root's uplink free for traffic the other way.

These loads average to the ``wire_bytes`` the :class:`~dkfac.comm.recorder.StepRecorder`
counts for a real run; here they are kept per member, because which uplink a reduce loads
decides what can travel at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dkfac.bench.link_shape import LinkShape
from dkfac.comm.cost_model import AlphaBeta

#: Share of a shaped Ethernet link's rate that is TCP payload: 1448 bytes of segment data
#: (MTU 1500, TCP timestamps) per 1514-byte frame, which is what a shaper such as tc counts.
#: The emulated cluster measures 95.6 Mbit/s of payload at 100 Mbit/s (docs/benchmarks.md).
ETHERNET_PAYLOAD_SHARE = 1448 / 1514

#: Collectives the model knows (the ones :class:`~dkfac.comm.communicator.Communicator` runs).
COLLECTIVES: tuple[str, ...] = ("allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast")


@dataclass(frozen=True)
class LinkModel:
    """Each worker's link: payload bandwidth per direction and start-up time per step.

    Attributes:
        bytes_per_s: payload bytes per second each uplink (and downlink) carries.
        step_latency_s: time added per communication step of a collective (propagation,
            switch, software: what an alpha-beta fit calls alpha, divided by the steps).
    """

    bytes_per_s: float
    step_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive, got {self.bytes_per_s}")
        if not self.step_latency_s >= 0:
            raise ValueError(f"step_latency_s must be >= 0, got {self.step_latency_s}")

    @classmethod
    def from_link_shape(cls, shape: LinkShape, *, overhead_s: float = 0.0) -> LinkModel:
        """A shaped Ethernet link: its rate's TCP payload share, its delay plus ``overhead_s``."""
        return cls(shape.bytes_per_second * ETHERNET_PAYLOAD_SHARE, shape.delay_s + overhead_s)

    @classmethod
    def from_allreduce_fit(cls, fit: AlphaBeta, world_size: int) -> LinkModel:
        """The link behind a measured allreduce line (``ClusterCostModel.collective``) at P.

        A ring allreduce of ``n`` bytes lasts ``2(P-1)·latency + 2(P-1)/P · n / bandwidth``,
        so ``bandwidth = 2(P-1) / (P·beta)`` and ``latency = alpha / (2(P-1))``.

        Raises:
            ValueError: fewer than two workers (no allreduce to fit), or a fit the planners
                would refuse (see :meth:`AlphaBeta.problems`).
        """
        if world_size < 2:
            raise ValueError(f"an allreduce fit needs at least 2 workers, got {world_size}")
        problems = fit.problems()
        if problems:
            raise ValueError(f"the allreduce fit cannot describe a link: {'; '.join(problems)}")
        steps = 2 * (world_size - 1)
        return cls(steps / (world_size * fit.beta), fit.alpha / steps)

    def allreduce_fit(self, world_size: int) -> AlphaBeta:
        """The alpha-beta line SPD/PAD would fit for an allreduce over ``world_size`` workers."""
        steps = 2 * (world_size - 1)
        return AlphaBeta(steps * self.step_latency_s, steps / (world_size * self.bytes_per_s))

    def seconds(self, op: str, nbytes: float, size: int, root: int | None = None) -> float:
        """Time of collective ``op`` of ``nbytes`` payload over ``size`` members."""
        loads = uplink_loads(op, nbytes, size, root)
        return max(loads) / self.bytes_per_s + steps(op, size) * self.step_latency_s


def steps(op: str, size: int) -> int:
    """Communication steps (start-up latencies) of ``op`` over ``size`` members."""
    _check(op, size)
    if size == 1:
        return 0
    return 2 * (size - 1) if op == "allreduce" else size - 1


def uplink_loads(op: str, nbytes: float, size: int, root: int | None = None) -> list[float]:
    """Bytes each member (by its index in the group) sends for ``op`` of ``nbytes`` payload.

    ``root`` is the index of a reduce's destination or a broadcast's source. The chain of a
    broadcast starts at the root and ends at the member before it; a reduce's chain ends at
    the root, so every member but the root sends.

    Raises:
        ValueError: an unknown ``op``, a rooted op without a valid ``root`` or the reverse.
    """
    _check(op, size)
    rooted = op in ("reduce", "broadcast")
    if rooted != (root is not None) or (root is not None and not 0 <= root < size):
        raise ValueError(f"{op} over {size} members needs a root in [0, {size}) iff rooted")
    if size == 1:
        return [0.0]
    if op == "allreduce":
        return [2.0 * (size - 1) / size * nbytes] * size
    if op in ("reduce_scatter", "all_gather"):
        return [(size - 1) / size * nbytes] * size
    assert root is not None
    silent = root if op == "reduce" else (root - 1) % size
    return [0.0 if member == silent else float(nbytes) for member in range(size)]


def _check(op: str, size: int) -> None:
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(COLLECTIVES)}")
    if size < 1:
        raise ValueError(f"a collective needs at least one member, got {size}")
