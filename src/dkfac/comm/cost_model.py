"""Cost model of the running cluster: collectives (alpha-beta) and decompositions (c·d³).

SPD-KFAC's fusion rule and the placement planners need predicted times. Nothing here is a
hard-coded constant: :func:`calibrate_alpha_beta` times real collectives on the process group
and :func:`calibrate_decomposition` times real eigendecompositions; the fits are pure
functions, testable on synthetic data. A :class:`CostModelCache` measures each once and hands
the result to every later SPD/PAD preconditioner of the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dkfac.comm.communicator import Communicator, ProcessGroup
from dkfac.comm.line_fit import fit_line_nonnegative_intercept
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.factor_decomposition import decompose_factor
from dkfac.curvature.factor_side import is_diagonal

#: Below this coefficient of determination a fit does not explain the measured times well
#: enough to plan with (planners fall back to sizes).
MIN_R_SQUARED = 0.8


@dataclass(frozen=True)
class AlphaBeta:
    """Time of one collective: ``alpha + beta · bytes`` seconds.

    Attributes:
        alpha: start-up time (s).
        beta: time per byte (s).
        r_squared: how much of the measured times' variance the line explains (1 for a
            model given, not fitted).
    """

    alpha: float
    beta: float
    r_squared: float = 1.0

    def seconds(self, nbytes: float) -> float:
        """Predicted time of a collective moving ``nbytes``."""
        return self.alpha + self.beta * nbytes

    def problems(self) -> list[str]:
        """Why this model cannot be planned with (empty when it can)."""
        return _line_problems(
            "collective", self.alpha, self.beta, self.r_squared, "alpha", "beta (s/byte)"
        )


@dataclass(frozen=True)
class CubicCost:
    """Time of decomposing a ``d × d`` factor: ``c0 + c3 · d³`` seconds.

    ``r_squared`` is the fit's, as in :class:`AlphaBeta`.
    """

    c0: float
    c3: float
    r_squared: float = 1.0

    def seconds(self, d: int) -> float:
        """Predicted decomposition time of a ``d × d`` factor (a diagonal one's: ``c0``).

        A factor held as its diagonal (:class:`~dkfac.curvature.factor_side.DiagonalSide`)
        decomposes elementwise: its time is the fixed part alone.
        """
        return self.c0 if is_diagonal(d) else self.c0 + self.c3 * float(d) ** 3

    def problems(self) -> list[str]:
        """Why this model cannot be planned with (empty when it can)."""
        return _line_problems("decomposition", self.c0, self.c3, self.r_squared, "c0", "c3")


def _line_problems(
    what: str, intercept: float, slope: float, r_squared: float, a_name: str, b_name: str
) -> list[str]:
    problems = []
    if not (math.isfinite(intercept) and math.isfinite(slope)):
        problems.append(f"{what} fit is not finite ({a_name}={intercept}, {b_name}={slope})")
        return problems
    if slope <= 0:
        problems.append(f"{what} time does not grow with size ({b_name}={slope:.3g})")
    if intercept < 0:
        problems.append(f"{what} start-up time is negative ({a_name}={intercept:.3g} s)")
    if r_squared < MIN_R_SQUARED:
        problems.append(
            f"{what} fit explains too little of the measured times "
            f"(R²={r_squared:.2f} < {MIN_R_SQUARED})"
        )
    return problems


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """``alpha``, ``beta`` from measured (bytes, seconds) pairs, ``alpha >= 0``.

    See :func:`~dkfac.comm.line_fit.fit_line_nonnegative_intercept`. A fit that still makes
    no sense (time not growing with size, a poor fit) says so in :meth:`AlphaBeta.problems`.
    """
    line = fit_line_nonnegative_intercept(sizes, seconds)
    return AlphaBeta(line.intercept, line.slope, line.r_squared)


def fit_cubic(dims: Sequence[int], seconds: Sequence[float]) -> CubicCost:
    """``c0``, ``c3`` from measured (d, seconds) pairs, ``c0 >= 0`` (as :func:`fit_alpha_beta`)."""
    line = fit_line_nonnegative_intercept([float(d) ** 3 for d in dims], seconds)
    return CubicCost(line.intercept, line.slope, line.r_squared)


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


def _agree(
    values: list[float],
    device: torch.device,
    comm: Communicator | None,
    failure: Exception | None = None,
) -> list[float]:
    """The element-wise maximum over ranks, so every rank plans with the same numbers.

    ``failure``: measuring raised on this rank (``values`` are then placeholders). The ranks
    agree on whether any failed along with the numbers, so a failure on one rank raises on
    every rank instead of leaving the others waiting in the next collective.

    Raises:
        RuntimeError: measuring failed on some rank of several (this rank's ``failure`` is
            the cause); alone, ``failure`` itself is raised.
    """
    if comm is None or comm.world_size == 1:
        if failure is not None:
            raise failure
        return values
    tensor = torch.tensor([float(failure is not None), *values], dtype=torch.float64, device=device)
    comm.allreduce([tensor], phase="calibration", maximum=True, exact=True).wait()
    if bool(tensor[0]):
        where = "this rank" if failure is not None else "another rank (see its error)"
        raise RuntimeError(f"the cost-model calibration failed on {where}") from failure
    return [float(v) for v in tensor[1:].tolist()]


def _world_communicator() -> Communicator | None:
    """A communicator on the default group, or None outside ``torch.distributed``.

    Its recorder is thrown away: calibration traffic belongs to no training step.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return Communicator(StepRecorder())


def calibrate_alpha_beta(
    sizes: Sequence[int] = (2**10, 2**14, 2**18, 2**20, 2**22),
    repeats: int = 9,
    device: torch.device | None = None,
    comm: Communicator | None = None,
) -> AlphaBeta:
    """Time allreduces of ``sizes`` bytes through ``comm`` and fit ``alpha``, ``beta``.

    The allreduces go through the communicator, packing included, as the strategies' own
    collectives do. Every rank must call it (it runs collectives); all ranks return the same
    model because the measured times are combined with a max-allreduce before fitting.

    Args:
        sizes: payload bytes of the timed allreduces.
        repeats: timed calls per size (the fastest counts).
        device: where the buffers live (default: CPU).
        comm: the communicator of the group to measure (default: one on the world).

    Raises:
        RuntimeError: no process group exists.
    """
    comm = comm or _world_communicator()
    if comm is None:
        raise RuntimeError("calibrate_alpha_beta needs torch.distributed: no process group")
    target = device or torch.device("cpu")
    measured = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=target)

        def allreduce(buffer: torch.Tensor = buffer, comm: Communicator = comm) -> None:
            comm.allreduce([buffer], phase="calibration", exact=True).wait()
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)

        measured.append(_fastest_seconds(allreduce, repeats))
    return fit_alpha_beta([float(s) for s in sizes], _agree(measured, target, comm))


def decomposition_dims(largest: int | None = None, smallest: int = 32) -> list[int]:
    """Sizes to time decompositions at: powers of two from ``smallest``, then ``max(largest, 128)``.

    The fit is made up to the model's largest factor, so the biggest decompositions (the
    ones that matter for placement) are measured, not extrapolated from small ones; and at
    least up to 128, where the cubic term is well above the clock's noise (a model whose
    factors are all tiny would otherwise fit microseconds of noise at 8, 16 and 32, and its
    profile be refused for a poor fit).
    """
    top = max(largest or 256, smallest, 128)
    dims = [smallest]
    while dims[-1] * 2 < top:
        dims.append(dims[-1] * 2)
    if dims[-1] != top:
        dims.append(top)
    if len(dims) < 3:  # a line through two points has no fit quality
        dims = sorted({max(2, smallest // 4), max(3, smallest // 2), *dims})
    return dims


def calibrate_decomposition(
    dims: Sequence[int] = (32, 64, 128, 256),
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    method: str = "eigen",
    comm: Communicator | None = None,
) -> CubicCost:
    """Time one factor's decomposition (``method``) at ``dims`` and fit ``c0 + c3·d³``.

    ``"eigen"`` times ``torch.linalg.eigh``, ``"inverse"`` the damped Cholesky inverse,
    ``"cholesky"`` the damped factorisation alone (its solves are preconditioning). Sizes
    above 1024 are timed once (each takes seconds on a CPU). Under ``torch.distributed`` the
    times are max-reduced over ``comm``'s group (default: the world) so all ranks agree.

    Raises:
        RuntimeError: a decomposition raised on some rank (out of memory, say): every rank of
            the group raises, none is left waiting for the others.
    """
    target = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    measured: list[float] = []
    failure: Exception | None = None
    try:  # local work only: a failure here (out of memory, say) is agreed on below
        for d in dims:
            x = torch.randn(d, d, generator=generator, dtype=dtype).to(target)
            matrix = x @ x.t() + torch.eye(d, dtype=dtype, device=target)
            shift = torch.tensor(1e-3, dtype=dtype, device=target)

            def decompose(matrix: torch.Tensor = matrix, shift: torch.Tensor = shift) -> None:
                decompose_factor(matrix, "a", method, dtype, shift)
                if matrix.is_cuda:
                    torch.cuda.synchronize(matrix.device)

            measured.append(_fastest_seconds(decompose, repeats if d <= 1024 else 1))
    except Exception as error:
        failure, measured = error, [0.0] * len(dims)
    agreed = _agree(measured, target, comm or _world_communicator(), failure)
    return fit_cubic(list(dims), agreed)


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
            "collective_r_squared": self.collective.r_squared,
            "decomposition_c0_s": self.decomposition.c0,
            "decomposition_c3_s": self.decomposition.c3,
            "decomposition_r_squared": self.decomposition.r_squared,
        }

    def problems(self) -> list[str]:
        """Why the planners cannot use this model (empty when they can)."""
        return self.collective.problems() + self.decomposition.problems()


class CostModelCache:
    """Calibrations measured once and reused by every SPD/PAD preconditioner built after.

    Whoever builds several preconditioners owns one (a training script, a benchmark); there is
    no global cache. A calibration is reused only where it measured the same thing: the
    alpha-beta model per (ranks of the group, backend, device type), so a new group over the
    same ranks (each SPD/PAD preconditioner makes one) reuses it; the decomposition cost per
    (ranks of the group, method, dtype, device type), as the group's ranks agree on the
    slowest one's times and another group's agreement may differ. Keys never depend on the
    rank (``cuda:0`` and ``cuda:1`` are both ``"cuda"``), so every rank hits or misses
    together: a miss runs collectives, and
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
        # Per key: the fit and the largest size it measured.
        self._decomposition: dict[
            tuple[tuple[int, ...], str, torch.dtype, str], tuple[CubicCost, int]
        ] = {}

    def get(
        self,
        method: str,
        dtype: torch.dtype,
        device: torch.device | None = None,
        group: ProcessGroup | None = None,
        largest_dim: int | None = None,
    ) -> ClusterCostModel:
        """The cost model of ``group`` for decompositions ``method`` in ``dtype``.

        Measures (:func:`calibrate_alpha_beta`, :func:`calibrate_decomposition`) only what
        is not cached yet; a decomposition fit that stopped short of ``largest_dim`` is
        measured again up to it. Every rank must call it (with the same arguments).

        Args:
            method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``, the decomposition that is timed.
            dtype: dtype of the decompositions.
            device: where the collectives and decompositions run (default: CPU).
            group: the process group (default: the world).
            largest_dim: the largest factor the model has: decompositions are timed up to it,
                and at least to 128 (:func:`decomposition_dims`).
        """
        target = device or torch.device("cpu")
        comm = Communicator(StepRecorder(), group=group)  # calibration: no step's traffic
        collective_key = (comm.ranks, comm.backend, target.type)
        if collective_key not in self._collective:
            self._collective[collective_key] = calibrate_alpha_beta(device=target, comm=comm)
        # The group is part of the key: its ranks agree on the times (their maximum), and
        # another group's agreement may differ.
        decomposition_key = (comm.ranks, method, dtype, target.type)
        cached = self._decomposition.get(decomposition_key)
        dims = decomposition_dims(largest_dim)
        if cached is None or cached[1] < dims[-1]:
            fit = calibrate_decomposition(
                dims, dtype=dtype, device=target, method=method, comm=comm
            )
            self._decomposition[decomposition_key] = (fit, dims[-1])
        return ClusterCostModel(
            self._collective[collective_key], self._decomposition[decomposition_key][0]
        )
