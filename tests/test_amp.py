"""Mixed precision: statistics in factor_dtype under autocast; GradScaler through its public API.

* Under bfloat16 autocast (and float16 on a GPU) the factors are computed in float32 from the
  tensors the layers really saw: the first layer's ``A`` (its input is float32 in both runs)
  equals the float32 run's bit for bit, and every factor equals a float64 formula over the
  captured inputs and output gradients (a bfloat16 Gram would be off by ~1e-3).
* A step whose gradients are not finite (the GradScaler skips it) changes no factor and no
  decomposition; the next finite step makes the postponed decomposition.
* ``step()`` called inside an autocast region computes exactly what it computes outside one
  (K-FAC's own products stay in their dtypes), on every kind of step.
* Only public GradScaler methods are used.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 10, generator=g), torch.randint(0, 3, (32,), generator=g)


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        ("cpu", torch.bfloat16),
        on_cuda(CUDA_TEST_DEVICE.type, torch.bfloat16),
        on_cuda(CUDA_TEST_DEVICE.type, torch.float16),
    ],
)
def test_autocast_statistics_are_float32_from_what_the_layers_saw(
    device: str, dtype: torch.dtype
) -> None:
    model = mlp().to(device)
    reference = copy.deepcopy(model)
    x, y = (t.to(device) for t in data())
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def capture(index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            seen[index] = {"x": inputs[0].detach()}
            output.register_hook(lambda g: seen[index].__setitem__("dy", g.detach()))

        return hook

    for index in (0, 2, 4):
        model[index].register_forward_hook(capture(index))
    pre = dkfac.KFACPreconditioner(model)
    with torch.autocast(device, dtype=dtype):
        out = model(x)
        assert out.dtype == dtype  # the layers really ran in 16 bits
        loss = F.cross_entropy(out, y)
    loss.backward()
    pre.step()
    plain = dkfac.KFACPreconditioner(reference)
    F.cross_entropy(reference(x), y).backward()
    plain.step()
    factors = pre.factors()
    assert all(a.dtype == g.dtype == torch.float32 for a, g in factors.values())
    assert torch.equal(factors["0"][0], plain.factors()["0"][0])
    n = x.shape[0]
    for index in (0, 2, 4):
        rows = seen[index]["x"].double()
        rows = torch.cat([rows, torch.ones(n, 1, dtype=torch.float64, device=device)], dim=1)
        dy = seen[index]["dy"].double()
        want_a, want_g = rows.t() @ rows / n, n * dy.t() @ dy
        got_a, got_g = factors[str(index)]
        torch.testing.assert_close(
            got_a.double(), want_a, rtol=1e-6, atol=1e-7 * want_a.abs().max()
        )
        torch.testing.assert_close(
            got_g.double(), want_g, rtol=1e-6, atol=1e-7 * want_g.abs().max()
        )


class PublicScaler:
    """A GradScaler seen through its public methods only; records every attribute asked for."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self._inner = scaler
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.__dict__.setdefault("asked", []).append(name)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__dict__["_inner"], name)


def scaled_step(
    model: nn.Module,
    pre: dkfac.KFACPreconditioner,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    seed: int,
    overflow: bool = False,
) -> None:
    x, y = data(seed)
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x.double()), y)).backward()
    if overflow:  # what an fp16 overflow leaves in one gradient
        model[2].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    pre.step()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.bfloat16), on_cuda(CUDA_TEST_DEVICE.type, torch.float16)],
)
def test_step_inside_autocast_computes_what_it_computes_outside(
    device: str, dtype: torch.dtype
) -> None:
    """Factor, decomposition and plain steps alike: every gradient equal bit for bit."""
    outside, inside = mlp().to(device), mlp().to(device)
    options = {"factor_update_steps": 2, "inv_update_steps": 2}
    pre_outside = dkfac.KFACPreconditioner(outside, **options)
    pre_inside = dkfac.KFACPreconditioner(inside, **options)
    for step in range(4):  # steps 0 and 2 update and decompose, 1 and 3 are plain steps
        x, y = (t.to(device) for t in data(step))
        for model in (outside, inside):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        pre_outside.step()
        with torch.autocast(device, dtype=dtype):
            pre_inside.step()
        for a, b in zip(outside.parameters(), inside.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert a.grad.dtype == b.grad.dtype == torch.float32
            assert torch.equal(a.grad, b.grad), f"step {step}"


def test_a_step_the_grad_scaler_skips_changes_no_factor_and_no_decomposition() -> None:
    model = mlp().double()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    public = PublicScaler(scaler)
    pre = dkfac.KFACPreconditioner(model, grad_scaler=public, inv_update_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaled_step(model, pre, opt, scaler, 0)  # step 0: factors and decompositions
    before = {
        layer.name: (layer.a.clone(), layer.g.clone(), layer.inverse.tensors()["qa"].clone())
        for layer in pre.layers
    }
    params = [p.detach().clone() for p in model.parameters()]
    scaled_step(model, pre, opt, scaler, 1)  # step 1: factors only
    scaled_step(model, pre, opt, scaler, 2, overflow=True)  # step 2 (decomposition): skipped
    assert scaler.get_scale() == 128.0  # the scaler did skip it
    stepped = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(p, q) for p, q in zip(params, stepped, strict=True))
    after_skip = {
        layer.name: (layer.a.clone(), layer.inverse.tensors()["qa"]) for layer in pre.layers
    }
    for name, (a, qa) in after_skip.items():
        assert not torch.equal(a, before[name][0])  # step 1 folded
        assert torch.equal(qa, before[name][2])  # step 2 made no decomposition
    # Step 3 (factors only by the schedule) makes the postponed decomposition.
    factors_before_3 = {layer.name: layer.a.clone() for layer in pre.layers}
    scaled_step(model, pre, opt, scaler, 3)
    for layer in pre.layers:
        assert not torch.equal(layer.a, factors_before_3[layer.name])
        assert not torch.equal(layer.inverse.tensors()["qa"], after_skip[layer.name][1])
    assert all(not name.startswith("_") for name in public.asked), public.asked
    assert "get_scale" in public.asked


def test_a_skipped_step_folds_nothing_compared_with_a_run_without_it() -> None:
    # The factors after (good, skipped, good) equal those after (good, good) with the same
    # batches: the skipped window left no trace.
    runs = []
    for with_skip in (True, False):
        model = mlp().double()
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        pre = dkfac.KFACPreconditioner(model, grad_scaler=scaler, lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put
        scaled_step(model, pre, opt, scaler, 0)
        if with_skip:
            scaled_step(model, pre, opt, scaler, 1, overflow=True)
        scaled_step(model, pre, opt, scaler, 2)
        runs.append(pre.factors())
    for name, (a, g) in runs[1].items():
        assert torch.equal(runs[0][name][0], a) and torch.equal(runs[0][name][1], g)
