"""Cost model fits against synthetic data, calibration on a real gloo group, and its cache."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.distributed import StepRecorder, cost_model, make_strategy
from dkfac.distributed.cost_model import (
    AlphaBeta,
    CostModelCache,
    CubicCost,
    calibrate_alpha_beta,
    calibrate_decomposition,
    fit_alpha_beta,
    fit_cubic,
)


def test_fits_recover_the_generating_parameters() -> None:
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_alpha_beta(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert model.alpha == pytest.approx(2e-4, rel=1e-9)
    assert model.beta == pytest.approx(3e-9, rel=1e-9)
    assert model.seconds(5e5) == pytest.approx(2e-4 + 1.5e-3, rel=1e-9)
    cubic = fit_cubic([16, 32, 64], [1e-5 + 2e-9 * d**3 for d in (16, 32, 64)])
    assert cubic == CubicCost(pytest.approx(1e-5), pytest.approx(2e-9))


def test_fits_never_predict_negative_costs() -> None:
    model = fit_alpha_beta([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])  # noise with a falling trend
    assert model.alpha >= 0 and model.beta == 0.0
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="not all be equal"):
        fit_cubic([8, 8], [1.0, 2.0])


def test_decomposition_calibration_gives_a_usable_model() -> None:
    # Wall-clock values are machine noise; only the model's form is checked here.
    cubic = calibrate_decomposition(dims=(16, 64, 128), repeats=2)
    assert math.isfinite(cubic.c0) and math.isfinite(cubic.c3)
    assert cubic.c0 >= 0 and cubic.c3 >= 0


def calibrate(rank: int, world_size: int) -> AlphaBeta:
    torch.manual_seed(rank)
    return calibrate_alpha_beta(sizes=(2**10, 2**16, 2**20), repeats=3)


def test_alpha_beta_calibration_agrees_on_every_rank() -> None:
    models = run_workers(calibrate, 2, timeout=90)
    # Every rank must plan with the same model; the values themselves are machine noise.
    assert models[0] == models[1]
    assert math.isfinite(models[0].alpha) and math.isfinite(models[0].beta)
    assert models[0].alpha >= 0 and models[0].beta >= 0


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
            direct = make_strategy(strategy, StepRecorder(), cost_model=cache)
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
