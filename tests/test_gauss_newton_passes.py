"""Adaptive K-FAC's forward-mode passes: one for every vector, or one each when vmap cannot.

The oracle is the dense Gauss-Newton matrix of test_adaptive (``jacobian``/``hessian`` of the
flattened parameters, float64).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac.adaptive.gauss_newton import (
    BatchedPasses,
    gauss_newton_products,
    replayed_randomness,
)
from test_adaptive import DT, batch, dense_gauss_newton

MOVED = ["fc1.weight", "fc2.weight", "fc2.bias"]


class CubeFunction(torch.autograd.Function):
    """``x³`` with backward and forward-mode rules but no vmap rule."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x**3

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * tangent


class Net(nn.Module):
    def __init__(self, activation: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if self.activation == "cube":
            hidden = CubeFunction.apply(hidden)
        else:
            hidden = self.drop(torch.tanh(hidden))
        return self.fc2(hidden)  # type: ignore[no-any-return]


def vectors(model: nn.Module, count: int) -> list[dict[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(5)
    return [
        {name: torch.randn(params[name].shape, generator=gen, dtype=DT) for name in MOVED}
        for _ in range(count)
    ]


def oracle(model: nn.Module, given: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    x, t = batch(1)
    dense = dense_gauss_newton(model, MOVED, x, t)
    flats = torch.stack([torch.cat([v[n].reshape(-1) for n in MOVED]) for v in given])
    return flats @ dense @ flats.T


def test_a_model_vmap_cannot_batch_gets_a_pass_per_vector_with_the_oracle_products(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = Net("cube").to(DT)
    params = dict(model.named_parameters())
    given = vectors(model, 2)
    x, t = batch(1)
    with pytest.raises(RuntimeError, match="vmap"):  # what the fallback is for
        gauss_newton_products(model, {n: params[n] for n in MOVED}, given, (x,), t, F.cross_entropy)

    def products(batched: bool) -> Any:
        moved = {n: params[n] for n in MOVED}
        return gauss_newton_products(model, moved, given, (x,), t, F.cross_entropy, batched=batched)

    passes = BatchedPasses()
    with caplog.at_level(logging.INFO, logger="dkfac.adaptive.gauss_newton"):
        first = passes(products, len(given))
    assert not passes.batched
    assert "one forward-mode pass per vector from now on" in caplog.text
    torch.testing.assert_close(first.products, oracle(model, given), rtol=1e-10, atol=1e-12)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dkfac.adaptive.gauss_newton"):
        again = passes(products, len(given))
    assert caplog.text == ""  # not retried
    assert torch.equal(again.products, first.products)


def test_a_model_vmap_batches_keeps_one_pass_with_the_oracle_products() -> None:
    torch.manual_seed(0)
    model = Net("tanh").eval().to(DT)  # no dropout: the dense oracle sees the same function
    params = {n: p for n, p in model.named_parameters() if n in MOVED}
    given = vectors(model, 2)
    x, t = batch(1)
    passes = BatchedPasses()
    result = passes(
        lambda batched: gauss_newton_products(
            model, params, given, (x,), t, F.cross_entropy, batched=batched
        ),
        len(given),
    )
    assert passes.batched
    torch.testing.assert_close(result.products, oracle(model, given), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("count", [2, 3])
def test_one_pass_sees_the_dropout_masks_of_a_pass_per_vector(count: int) -> None:
    torch.manual_seed(0)
    model = Net("tanh").to(DT)  # training mode: dropout at p = 0.5
    params = {n: p for n, p in model.named_parameters() if n in MOVED}
    given = vectors(model, count)
    x, t = batch(2)
    results = []
    for batched in (True, False):
        with replayed_randomness(x.device) as replay:
            results.append(
                gauss_newton_products(
                    model, params, given, (x,), t, F.cross_entropy, replay, batched=batched
                )
            )
    one, each = results
    assert float(one.loss) == float(each.loss)  # the same masks: the same outputs
    torch.testing.assert_close(one.products, each.products, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(one.slopes, each.slopes, rtol=1e-12, atol=1e-14)


def test_the_adaptive_step_takes_the_batched_pass_on_a_model_vmap_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dkfac
    import dkfac.adaptive.controller as controller

    passes: list[bool] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        passes.append(args[-1] if len(args) > 7 else kwargs["batched"])
        return gauss_newton_products(*args, **kwargs)

    monkeypatch.setattr(controller, "gauss_newton_products", recorded)
    torch.manual_seed(0)
    model = Net("tanh").to(DT)  # dropout: "same" randomness under vmap
    pre = dkfac.KFACPreconditioner(
        model, damping=0.05, adaptive=dkfac.AdaptiveOptions(loss_fn=F.cross_entropy)
    )
    for seed in range(3):  # two vectors from the first step on (momentum: δ₀ = 0 at first)
        x, t = batch(seed)
        model.zero_grad()
        F.cross_entropy(model(x), t).backward()
        pre.step(x, t)
    assert passes == [True, True, True]  # batched, never retried one pass per vector
