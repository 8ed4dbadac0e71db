"""The per-step check that the preconditioned layers are still the model's, and its cost.

:class:`dkfac.layer_discovery.LayerWatch` checks the parent-child links on the layers' paths
instead of walking each path; these tests change the model every way a user can after
building the preconditioner and expect what walking the paths (the check before the watch)
says: the same refusal naming the same layer, or acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import dkfac
from dkfac.layer_discovery import LayerWatch, discover_layers


class Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def nested_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5)),
        nn.Sequential(nn.Sequential(nn.Linear(5, 3))),
    )


def stepped(model: nn.Module, pre: dkfac.KFACPreconditioner) -> None:
    model.zero_grad(set_to_none=True)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(x), torch.arange(6) % 3).backward()
    pre.step()


CHANGED = r"the model changed after KFACPreconditioner was built: layer '{}'"


def test_an_unchanged_model_passes_without_walking_the_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nested_model()
    pre = dkfac.KFACPreconditioner(model)

    def walked(self: nn.Module, target: str) -> nn.Module:
        raise AssertionError(f"get_submodule({target!r}) called on an unchanged model")

    monkeypatch.setattr(nn.Module, "get_submodule", walked)
    for _ in range(3):
        stepped(model, pre)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda m: m[0].__setitem__(2, nn.Linear(5, 5)), "0.2"),  # a layer replaced
        (lambda m: m.__setitem__(1, nn.Sequential(nn.Sequential(nn.Linear(5, 3)))), "1.0.0"),
        (lambda m: m[1][0].__setitem__(0, nn.Identity()), "1.0.0"),
        (lambda m: setattr(m[0][0], "weight", nn.Parameter(torch.randn(5, 4))), "0.0"),
        (lambda m: setattr(m[0][0].weight, "data", torch.randn(5, 2)), "0.0"),  # resized
        (lambda m: delattr(m[0], "2"), "0.2"),
        # An instance attribute shadowing the registered module: getattr (and a forward
        # calling self.<name>) sees the shadow.
        (lambda m: m[0].__dict__.__setitem__("2", nn.Linear(5, 5)), "0.2"),
        # The same for the weight: the registered parameter is still there, unused.
        (lambda m: m[0][0].__dict__.__setitem__("weight", torch.randn(5, 4)), "0.0"),
        # A parametrization moves the registered weight away and computes one per access.
        (lambda m: parametrize.register_parametrization(m[0][0], "weight", Doubled()), "0.0"),
    ],
    ids=[
        "layer",
        "ancestor",
        "inner-container-entry",
        "weight",
        "resized",
        "deleted",
        "shadow",
        "weight-shadow",
        "weight-parametrized",
    ],
)
def test_every_change_to_a_layer_is_refused_with_its_name(
    change: Callable[[nn.Module], Any], name: str
) -> None:
    model = nested_model()
    pre = dkfac.KFACPreconditioner(model)
    stepped(model, pre)
    change(model)
    with pytest.raises(RuntimeError, match=CHANGED.format(name)):
        pre.step()


def test_a_container_replaced_by_one_with_the_same_layers_is_the_same_model() -> None:
    # Walking the paths finds the same layers: not a change. The new links are then watched.
    model = nested_model()
    pre = dkfac.KFACPreconditioner(model)
    stepped(model, pre)
    model[1] = nn.Sequential(model[1][0])
    stepped(model, pre)
    stepped(model, pre)
    model[1][0][0] = nn.Linear(5, 3)
    with pytest.raises(RuntimeError, match=CHANGED.format("1.0.0")):
        pre.step()


def test_a_model_that_is_itself_the_layer_is_watched() -> None:
    model = nn.Linear(4, 3)
    ((path, layer),) = discover_layers(model, dkfac.KFACConfig(), None)[0]
    watch = LayerWatch(model, [path], [layer])
    watch.check()
    model.weight = nn.Parameter(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="was replaced or resized"):
        watch.check()


def test_profiler_ranges_are_opened_only_while_a_profiler_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nested_model()
    pre = dkfac.KFACPreconditioner(model)
    opened: list[str] = []
    real = torch.profiler.record_function

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    stepped(model, pre)
    assert opened == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        stepped(model, pre)
    names = {event.name for event in profile.events()}
    assert {"dkfac/factor_compute", "dkfac/precondition"} <= names
    assert "dkfac/factor_compute" in opened
