"""Cost model of the running cluster: collectives (alpha-beta) and decompositions (c·d³).

SPD-KFAC's fusion rule and the placement planners need predicted times. Nothing here is a
hard-coded constant: :func:`calibrate_alpha_beta` times real collectives on the process group
and :func:`calibrate_decomposition` times real eigendecompositions; the fits are pure
functions, testable on synthetic data. A :class:`CostModelCache` measures each once and hands
the result to every later SPD/PAD preconditioner of the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dkfac.curvature.inverse import decompose_factor
from dkfac.distributed.communicator import ProcessGroup


@dataclass(frozen=True)
class AlphaBeta:
    """Time of one collective: ``alpha + beta · bytes`` seconds."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        """Predicted time of a collective moving ``nbytes``."""
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class CubicCost:
    """Time of decomposing a ``d × d`` factor: ``c0 + c3 · d³`` seconds."""

    c0: float
    c3: float

    def seconds(self, d: int) -> float:
        """Predicted decomposition time of a ``d × d`` matrix."""
        return self.c0 + self.c3 * float(d) ** 3


def _least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line, both clamped at >= 0."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(
            f"need at least two (x, y) points of equal count, got {len(xs)} and {len(ys)}"
        )
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("the x values must not all be equal")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    slope = max(0.0, slope)
    intercept = max(0.0, mean_y - slope * mean_x)
    return intercept, slope


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares ``alpha``, ``beta`` from measured (bytes, seconds) pairs."""
    alpha, beta = _least_squares_line(sizes, seconds)
    return AlphaBeta(alpha, beta)


def fit_cubic(dims: Sequence[int], seconds: Sequence[float]) -> CubicCost:
    """Least-squares ``c0``, ``c3`` from measured (d, seconds) pairs."""
    c0, c3 = _least_squares_line([float(d) ** 3 for d in dims], seconds)
    return CubicCost(c0, c3)


def _fastest_seconds(action: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call.

    Noise on a shared machine only ever adds time (preemption, another process's burst), so
    the minimum is the least biased estimate of what the operation itself costs.
    """
    action()  # warm-up: first calls allocate and connect
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return min(samples)


def _agree(values: list[float], device: torch.device) -> list[float]:
    """The element-wise maximum over ranks, so every rank plans with the same numbers."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def calibrate_alpha_beta(
    sizes: Sequence[int] = (2**10, 2**14, 2**18, 2**20, 2**22),
    repeats: int = 5,
    device: torch.device | None = None,
    group: object | None = None,
) -> AlphaBeta:
    """Time allreduces of ``sizes`` bytes on the process group and fit ``alpha``, ``beta``.

    Every rank must call it (it runs collectives); all ranks return the same model because the
    measured times are combined with a max-allreduce before fitting.
    """
    target = device or torch.device("cpu")
    measured = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=target)

        def allreduce(buffer: torch.Tensor = buffer) -> None:
            dist.all_reduce(buffer, group=group)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)

        measured.append(_fastest_seconds(allreduce, repeats))
    return fit_alpha_beta([float(s) for s in sizes], _agree(measured, target))


def calibrate_decomposition(
    dims: Sequence[int] = (32, 64, 128, 256),
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    method: str = "eigen",
) -> CubicCost:
    """Time one factor's decomposition (``method``) at ``dims`` and fit ``c0 + c3·d³``.

    ``"eigen"`` times ``torch.linalg.eigh``, ``"inverse"`` the damped Cholesky inverse. Under
    ``torch.distributed`` the times are max-reduced so all ranks agree.
    """
    target = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    measured = []
    for d in dims:
        x = torch.randn(d, d, generator=generator, dtype=dtype).to(target)
        matrix = x @ x.t() + torch.eye(d, dtype=dtype, device=target)

        shift = torch.tensor(1e-3, dtype=dtype, device=target)

        def decompose(matrix: torch.Tensor = matrix, shift: torch.Tensor = shift) -> None:
            decompose_factor(matrix, "a", method, dtype, shift)

        measured.append(_fastest_seconds(decompose, repeats))
    return fit_cubic(list(dims), _agree(measured, target))


@dataclass(frozen=True)
class ClusterCostModel:
    """What the planners need to know about the running cluster.

    Attributes:
        collective: time of one collective on the strategy's process group.
        decomposition: time of decomposing one ``d × d`` factor.
    """

    collective: AlphaBeta
    decomposition: CubicCost

    def as_dict(self) -> dict[str, float]:
        """Plain numbers (for ``pre.plan()`` and logs)."""
        return {
            "alpha_s": self.collective.alpha,
            "beta_s_per_byte": self.collective.beta,
            "decomposition_c0_s": self.decomposition.c0,
            "decomposition_c3_s": self.decomposition.c3,
        }


def calibrate_cluster(
    method: str,
    dtype: torch.dtype,
    device: torch.device | None = None,
    group: object | None = None,
) -> ClusterCostModel:
    """Measure the alpha-beta model of ``group`` and the decomposition cost (about a second).

    Every rank must call it; all ranks return the same model. Nothing is kept: a
    :class:`CostModelCache` measures once for several preconditioners.
    """
    return CostModelCache().get(method, dtype, device, group)


class CostModelCache:
    """Calibrations measured once and reused by every SPD/PAD preconditioner built after.

    Whoever builds several preconditioners owns one (a training script, a benchmark); there is
    no global cache. A calibration is reused only where it measured the same thing: the
    alpha-beta model per (ranks of the group, backend, device type), so a new group over the
    same ranks (each SPD/PAD preconditioner makes one) reuses it; the decomposition cost per
    (method, dtype, device type). Keys never depend on the rank (``cuda:0`` and ``cuda:1`` are
    both ``"cuda"``), so every rank hits or misses together: a miss runs collectives, and
    every rank must call :meth:`get` with the same arguments in the same order, like building
    the preconditioners themselves.

    Example::

        cache = CostModelCache()
        for config in configs:  # every rank, same order
            cost = cache.get("eigen", torch.float32, device)  # measured on the first call only
            pre = dkfac.KFACPreconditioner(model, strategy="pad", cost_model=cost)
    """

    def __init__(self) -> None:
        self._collective: dict[tuple[tuple[int, ...], str, str], AlphaBeta] = {}
        self._decomposition: dict[tuple[str, torch.dtype, str], CubicCost] = {}

    def get(
        self,
        method: str,
        dtype: torch.dtype,
        device: torch.device | None = None,
        group: ProcessGroup | None = None,
    ) -> ClusterCostModel:
        """The cost model of ``group`` for decompositions ``method`` in ``dtype``.

        Measures (:func:`calibrate_alpha_beta`, :func:`calibrate_decomposition`) only what
        is not cached yet. Every rank must call it.

        Args:
            method: ``"eigen"`` or ``"inverse"``, the decomposition that is timed.
            dtype: dtype of the decompositions.
            device: where the collectives and decompositions run (default: CPU).
            group: the process group (default: the world).
        """
        target = device or torch.device("cpu")
        ranks = (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(dist.get_world_size()))
        )
        collective_key = (ranks, str(dist.get_backend(group)), target.type)
        if collective_key not in self._collective:
            self._collective[collective_key] = calibrate_alpha_beta(device=target, group=group)
        decomposition_key = (method, dtype, target.type)
        if decomposition_key not in self._decomposition:
            self._decomposition[decomposition_key] = calibrate_decomposition(
                dtype=dtype, device=target, method=method
            )
        return ClusterCostModel(
            self._collective[collective_key], self._decomposition[decomposition_key]
        )
