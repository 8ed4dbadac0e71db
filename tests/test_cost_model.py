"""Cost model fits against synthetic data, calibration on a real gloo group, and its cache."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.comm import StepRecorder, cost_model
from dkfac.comm.cost_model import (
    AlphaBeta,
    CostModelCache,
    CubicCost,
    calibrate_alpha_beta,
    calibrate_decomposition,
    fit_alpha_beta,
    fit_cubic,
)
from dkfac.strategies import make_strategy, resolve_options


def test_fits_recover_the_generating_parameters() -> None:
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_alpha_beta(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert model.alpha == pytest.approx(2e-4, rel=1e-9)
    assert model.beta == pytest.approx(3e-9, rel=1e-9)
    assert model.seconds(5e5) == pytest.approx(2e-4 + 1.5e-3, rel=1e-9)
    cubic = fit_cubic([16, 32, 64], [1e-5 + 2e-9 * d**3 for d in (16, 32, 64)])
    assert cubic == CubicCost(pytest.approx(1e-5), pytest.approx(2e-9))


def test_a_fit_that_makes_no_sense_says_why() -> None:
    falling = fit_alpha_beta([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])  # noise with a falling trend
    assert falling.beta == pytest.approx(-1.0) and falling.alpha == pytest.approx(4.0)
    assert falling.problems() == ["collective time does not grow with size (beta (s/byte)=-1)"]
    scattered = fit_alpha_beta([1.0, 2.0, 3.0, 4.0], [1.0, 5.0, 1.2, 5.2])
    assert scattered.r_squared == pytest.approx(1 - 12.168 / 16.04, rel=1e-9)  # by hand
    assert scattered.problems() == [
        "collective fit explains too little of the measured times (R²=0.24 < 0.8)"
    ]
    assert fit_alpha_beta([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]).problems() == []
    assert AlphaBeta(-1e-3, 1e-9).problems() == [
        "collective start-up time is negative (alpha=-0.001 s)"
    ]


def test_a_start_up_time_is_never_fitted_negative() -> None:
    # At 100 Mbit/s a 4 MiB allreduce takes 0.34 s; 3% noise on it is 50x the start-up time,
    # and the unconstrained fit puts alpha below zero (as measured on the emulated cluster).
    sizes = [2.0**10, 2.0**14, 2.0**18, 2.0**20, 2.0**22]
    seconds = [2e-4 + 8e-8 * s for s in sizes]
    seconds[-1] *= 1.03
    assert float(np.polyfit(sizes, seconds, 1)[1]) < 0  # numpy's unconstrained intercept
    model = fit_alpha_beta(sizes, seconds)
    # The constrained optimum is the least-squares line through the origin (numpy, float64).
    through_origin = np.linalg.lstsq(np.array(sizes)[:, None], np.array(seconds), rcond=None)
    assert model.alpha == 0.0
    assert model.beta == pytest.approx(float(through_origin[0][0]), rel=1e-12)
    assert model.beta == pytest.approx(8e-8, rel=0.05) and model.problems() == []
    cubic = fit_cubic([10, 20, 30], [1e-3 * d**3 - 5.0 for d in (10, 20, 30)])
    cubes = np.array([1e3, 8e3, 27e3])
    slope = np.linalg.lstsq(cubes[:, None], cubes * 1e-3 - 5.0, rcond=None)[0][0]
    assert cubic.c0 == 0.0 and cubic.c3 == pytest.approx(float(slope), rel=1e-12)


class FakeClock:
    """``time.perf_counter`` that only moves when a timed operation says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_decomposition_is_timed_up_to_the_largest_factor_and_fitted_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cost_model.decomposition_dims(577) == [32, 64, 128, 256, 512, 577]
    assert cost_model.decomposition_dims() == [32, 64, 128, 256]
    assert cost_model.decomposition_dims(6) == [32, 64, 128]  # never only noise-sized ones
    clock = FakeClock()
    timed: list[int] = []

    def decompose(matrix: torch.Tensor, *args: Any) -> None:
        timed.append(matrix.shape[0])
        clock.now += 2e-4 + 3e-11 * matrix.shape[0] ** 3  # the operation's known cost

    monkeypatch.setattr(cost_model, "time", clock)
    monkeypatch.setattr(cost_model, "decompose_factor", decompose)
    cubic = calibrate_decomposition(dims=(32, 64, 577, 1500), repeats=2)
    assert cubic.c0 == pytest.approx(2e-4, rel=1e-9) and cubic.c3 == pytest.approx(3e-11, rel=1e-9)
    assert cubic.r_squared == pytest.approx(1.0) and cubic.problems() == []
    # A warm-up and two timed calls per size; sizes above 1024 once after the warm-up.
    assert timed == [32] * 3 + [64] * 3 + [577] * 3 + [1500] * 2


def calibrate_with_known_costs(rank: int, world_size: int) -> AlphaBeta:
    clock = FakeClock()
    real_allreduce = cost_model.dist.all_reduce
    alpha, beta = (1e-4, 2e-9) if rank == 0 else (3e-4, 5e-9)  # rank 1 is slower in both

    def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        clock.now += alpha + beta * tensor.numel() * tensor.element_size()
        return real_allreduce(tensor, *args, **kwargs)

    with (
        mock.patch.object(cost_model, "time", clock),
        mock.patch.object(cost_model.dist, "all_reduce", allreduce),
    ):
        return calibrate_alpha_beta(sizes=(2**10, 2**16, 2**20), repeats=3)


def test_alpha_beta_calibration_recovers_the_slowest_ranks_costs_on_every_rank() -> None:
    # Real collectives on a gloo group, timed by a clock that advances by known costs: the
    # fit recovers them exactly, and every rank plans with the slowest rank's (max) times.
    for model in run_workers(calibrate_with_known_costs, 2, timeout=90):
        assert model.alpha == pytest.approx(3e-4, rel=1e-9)
        assert model.beta == pytest.approx(5e-9, rel=1e-9)
        assert model.problems() == []


def calibrate_with_rank_1_out_of_memory(rank: int, world_size: int) -> dict[str, Any]:
    real = cost_model.decompose_factor

    def decompose(matrix: torch.Tensor, *args: Any) -> Any:
        if rank == 1 and matrix.shape[0] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory (made up by the test)")
        return real(matrix, *args)

    with mock.patch.object(cost_model, "decompose_factor", decompose):
        try:
            calibrate_decomposition(dims=(32, 64, 128), repeats=1)
        except RuntimeError as error:
            cause = error.__cause__
            return {"message": str(error), "cause": None if cause is None else str(cause)}
    return {"message": None}


def test_a_decomposition_failing_on_one_rank_raises_on_every_rank() -> None:
    # Before, rank 0 went on to the agreement's allreduce and waited there for rank 1 until
    # the process group's timeout (the workers' 60 s here: the test would time out).
    ranks = run_workers(calibrate_with_rank_1_out_of_memory, 2, timeout=60)
    assert ranks[0] == {
        "message": "the cost-model calibration failed on another rank (see its error)",
        "cause": None,
    }
    assert ranks[1]["message"] == "the cost-model calibration failed on this rank"
    assert "out of memory" in ranks[1]["cause"]


def test_alone_a_failing_decomposition_raises_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def decompose(matrix: torch.Tensor, *args: Any) -> None:
        raise torch.OutOfMemoryError("made up")

    monkeypatch.setattr(cost_model, "decompose_factor", decompose)
    with pytest.raises(torch.OutOfMemoryError, match="made up"):
        calibrate_decomposition(dims=(32, 64, 128), repeats=1)


def cached_builds(rank: int, world_size: int) -> dict[str, Any]:
    calls: collections.Counter[str] = collections.Counter()

    def spy(name: str, measure: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return measure(*args, **kwargs)

        return counted

    out: dict[str, Any] = {"costs": [], "plans": []}
    with (
        mock.patch.object(
            cost_model, "calibrate_alpha_beta", spy("alpha_beta", cost_model.calibrate_alpha_beta)
        ),
        mock.patch.object(
            cost_model,
            "calibrate_decomposition",
            spy("decomposition", cost_model.calibrate_decomposition),
        ),
    ):
        cache = CostModelCache()
        for strategy in ("spd", "pad"):  # each makes its own process group over the same ranks
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
            )
            # The calibration taken from the cache, or the cache itself: both reuse.
            cost = cache.get("eigen", torch.float32) if strategy == "spd" else cache
            pre = dkfac.KFACPreconditioner(model, strategy=strategy, cost_model=cost)
            out["plans"].append(pre.plan())
            # A strategy handed the cache itself takes it from there too.
            direct = make_strategy(resolve_options(strategy, cost_model=cache), StepRecorder())
            direct.setup(pre.layers)
            out["costs"].append(direct.plan()["cost_model"])
            direct.close()
            pre.remove()
        out["after_builds"] = dict(calls)
        cache.get("inverse", torch.float32)  # another decomposition: only that is measured
        out["after_inverse"] = dict(calls)
    return out


def test_a_second_preconditioner_reuses_the_cached_calibration() -> None:
    results = run_workers(cached_builds, 2, timeout=120)
    for result in results:
        assert result["after_builds"] == {"alpha_beta": 1, "decomposition": 1}
        assert result["after_inverse"] == {"alpha_beta": 1, "decomposition": 2}
        first = result["plans"][0]["cost_model"]
        assert all(plan["cost_model"] == first for plan in result["plans"])
        assert all(cost == first for cost in result["costs"])
    # Every rank hit and missed together and plans with the same numbers.
    assert results[0]["plans"] == results[1]["plans"]
    assert results[0]["costs"] == results[1]["costs"]


def calibrations_per_group(rank: int, world_size: int) -> dict[str, int]:
    import torch.distributed as dist

    calls: collections.Counter[str] = collections.Counter()
    measure = cost_model.calibrate_decomposition

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["decomposition"] += 1
        return measure(*args, **kwargs)

    alone = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group
    with mock.patch.object(cost_model, "calibrate_decomposition", counted):
        cache = CostModelCache()
        cache.get("eigen", torch.float32, group=alone[rank])
        cache.get("eigen", torch.float32)  # the world agrees on other times: measured again
        cache.get("eigen", torch.float32)
    for group in alone:
        dist.destroy_process_group(group)
    return dict(calls)


def test_decomposition_costs_agreed_in_one_group_are_not_reused_for_another() -> None:
    # Ranks of a group plan with the group's maximum times; a rank's own sub-group measured
    # other times, and reusing them would give ranks different plans (mismatched collectives).
    for calls in run_workers(calibrations_per_group, 2, timeout=90):
        assert calls == {"decomposition": 2}
