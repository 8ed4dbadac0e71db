"""Recipes: the keyword arguments a measurement chose, and a preconditioner built from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac.bench.target_run import Method, resolved_keywords
from dkfac.recipes import RECIPES, fast_to_target

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
#: The latest measurement of the recipe (earlier ones: docs/benchmarks.md, "One call").
MEASURED = "time_to_target_fast_to_target_floor_{}.json"


@pytest.mark.parametrize("workload", ["digits", "autoencoder", "charlm"])
def test_fast_to_target_is_what_the_benchmark_measured(workload: str) -> None:
    record = json.loads((RESULTS / MEASURED.format(workload)).read_text())
    # The recipe alone, nothing changed (an entry beside it with "options" changes it).
    alone = [
        kfac
        for kfac in record["kfac"]
        if kfac.get("recipe") == "fast_to_target" and not kfac.get("options")
    ]
    assert len(alone) == 1, f"{MEASURED.format(workload)}: the recipe alone, once: {alone}"
    (given,) = alone
    method = Method(
        given["optimizer"],
        given["lr"],
        kfac=True,
        name=given.get("name", ""),
        recipe="fast_to_target",
    )
    assert record["kfac_resolved"][method.label] == json.loads(
        json.dumps(resolved_keywords(method), default=str)
    )


def test_each_call_gives_new_keyword_arguments_with_the_loss() -> None:
    first, second = fast_to_target(F.cross_entropy), fast_to_target(F.mse_loss)
    assert first is not second and first["adaptive"] is not second["adaptive"]
    assert first["adaptive"].loss_fn is F.cross_entropy
    assert second["adaptive"].loss_fn is F.mse_loss
    first["damping"] = 1.0
    assert fast_to_target(F.cross_entropy)["damping"] == 0.03
    assert RECIPES["fast_to_target"] is fast_to_target


def test_a_preconditioner_from_the_recipe_takes_adaptive_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pre = dkfac.KFACPreconditioner(model, **fast_to_target(F.cross_entropy))
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(256, 8, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    losses = []
    for _ in range(5):
        model.zero_grad()
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        losses.append(float(loss))
        pre.step(x, t)
    report = pre.adaptive_report
    assert report is not None and pre.steps == 5 and losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())  # every layer moved by K-FAC
    assert pre.config.inverse_method == "inverse" and pre.config.statistics_fraction == 0.125
