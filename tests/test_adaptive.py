"""Adaptive K-FAC against float64 oracles: the quadratic model, Gauss-Newton products, the step.

The oracles are dense: the Gauss-Newton matrix ``C = Jᵀ H J`` from
``torch.autograd.functional.jacobian``/``hessian`` of the flattened parameters, K-FAC's
direction from the factors built from explicit per-example gradients (test_oracle_numerics),
and the quadratic model solved in closed form.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian, jacobian

import dkfac
from distributed_harness import run_workers
from dkfac.adaptive import levenberg_marquardt, minimise_quadratic_model, reduction_ratio
from dkfac.adaptive.gauss_newton import gauss_newton_products, model_batch
from test_oracle_numerics import eigen_direction, grad_matrix, oracle_layer_factors

DT = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)


def flat(model: nn.Module, names: list[str]) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([params[name].detach().reshape(-1) for name in names])


def dense_gauss_newton(
    model: nn.Module, names: list[str], x: torch.Tensor, t: torch.Tensor, loss=F.cross_entropy
) -> torch.Tensor:
    """``Jᵀ H J`` over the flattened ``names`` (float64, dense)."""
    params = dict(model.named_parameters())
    shapes = [params[name].shape for name in names]
    sizes = [params[name].numel() for name in names]
    buffers = {name: b.clone() for name, b in model.named_buffers()}

    def outputs(theta: torch.Tensor) -> torch.Tensor:
        parts = dict(zip(names, torch.split(theta, sizes), strict=True))
        state = {n: p.detach() for n, p in params.items()}
        state.update({n: parts[n].reshape(s) for n, s in zip(names, shapes, strict=True)})
        state.update({n: b.clone() for n, b in buffers.items()})
        return torch.func.functional_call(model, state, (x,))

    theta = flat(model, names)
    out = outputs(theta)
    j = jacobian(outputs, theta).reshape(out.numel(), theta.numel())
    h = hessian(lambda o: loss(o.reshape(out.shape), t), out.reshape(-1))
    return j.T @ h @ j


# -- the quadratic model (pure) ---------------------------------------------------------------
def test_the_quadratic_model_minimiser_solves_its_normal_equations() -> None:
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(5, 2, generator=gen, dtype=DT)
    c_full = torch.randn(5, 5, generator=gen, dtype=DT)
    c_full = c_full @ c_full.T
    g = torch.randn(5, generator=gen, dtype=DT)
    damping = 0.3
    step = minimise_quadratic_model(basis.T @ c_full @ basis, basis.T @ basis, basis.T @ g, damping)
    coefficients = torch.tensor(step.coefficients, dtype=DT)
    delta = basis @ coefficients
    # Stationary in the span: the model's gradient is orthogonal to both vectors.
    residual = basis.T @ (g + (c_full + damping * torch.eye(5, dtype=DT)) @ delta)
    torch.testing.assert_close(residual, torch.zeros(2, dtype=DT), atol=1e-12, rtol=0)
    # The reported change is the undamped model's (the reduction ratio's denominator).
    undamped = float(g @ delta + 0.5 * delta @ c_full @ delta)
    assert step.predicted_change == pytest.approx(undamped, rel=1e-12)
    assert step.predicted_change < 0


def test_a_collinear_or_zero_second_vector_is_dropped() -> None:
    k1 = torch.tensor([[2.0]], dtype=DT)
    one = minimise_quadratic_model(k1, torch.eye(1, dtype=DT), torch.tensor([-3.0], dtype=DT), 1.0)
    assert one.coefficients == pytest.approx((1.0,))  # -b / (K + λV) = 3 / 3
    assert one.predicted_change == pytest.approx(-2.0)  # b·c + ½·K·c² = -3 + 1
    # v2 = 2·v1: the 2x2 system is singular; the answer is the 1-D one.
    curvature = torch.tensor([[2.0, 4.0], [4.0, 8.0]], dtype=DT)
    inner = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=DT)
    two = minimise_quadratic_model(curvature, inner, torch.tensor([-3.0, -6.0], dtype=DT), 1.0)
    assert two.coefficients == pytest.approx((1.0, 0.0))
    # The first step has no previous update (a zero vector).
    zero = minimise_quadratic_model(
        torch.diag(torch.tensor([2.0, 0.0], dtype=DT)),
        torch.diag(torch.tensor([1.0, 0.0], dtype=DT)),
        torch.tensor([-3.0, 0.0], dtype=DT),
        1.0,
    )
    assert zero.coefficients == pytest.approx((1.0, 0.0))
    with pytest.raises(ValueError, match="non-finite"):
        minimise_quadratic_model(k1, k1, torch.tensor([math.nan], dtype=DT), 1.0)
    with pytest.raises(ValueError, match="must be"):
        minimise_quadratic_model(curvature, k1, torch.tensor([1.0], dtype=DT), 1.0)


@pytest.mark.parametrize(
    ("ratio", "expected"), [(0.9, 0.5), (0.5, 1.0), (0.1, 2.0), (-math.inf, 2.0)]
)
def test_levenberg_marquardt_rule(ratio: float, expected: float) -> None:
    assert levenberg_marquardt(1.0, ratio, 0.5, 1e-3, 10.0) == expected
    assert levenberg_marquardt(8.0, 0.0, 0.5, 1e-3, 10.0) == 10.0  # bounded above
    assert levenberg_marquardt(1e-3, 1.0, 0.5, 1e-3, 10.0) == 1e-3  # and below


def test_reduction_ratio() -> None:
    assert reduction_ratio(2.0, 1.5, -1.0) == 0.5
    assert reduction_ratio(2.0, 2.5, -1.0) == -0.5
    assert reduction_ratio(2.0, math.nan, -1.0) == -math.inf
    assert reduction_ratio(2.0, 2.0, 0.0) == 1.0
    assert reduction_ratio(2.0, 3.0, 0.0) == -math.inf


# -- Gauss-Newton products ----------------------------------------------------------------------
@pytest.mark.parametrize("batched", [True, False], ids=["one-pass", "pass-per-vector"])
def test_gauss_newton_products_equal_the_dense_matrix_and_leave_the_model_unchanged(
    batched: bool,
) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x, t = batch(1)
    moved = ["0.weight", "3.weight", "3.bias"]  # batch norm's own parameters stay fixed
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(2)
    vectors = [
        {name: torch.randn(params[name].shape, generator=gen, dtype=DT) for name in moved}
        for _ in range(2)
    ]
    before = copy.deepcopy(model.state_dict())
    loss, products, slopes = gauss_newton_products(
        model, {n: params[n] for n in moved}, vectors, (x,), t, F.cross_entropy, batched=batched
    )
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # running statistics untouched
    dense = dense_gauss_newton(model, moved, x, t)
    flats = torch.stack([torch.cat([v[n].reshape(-1) for n in moved]) for v in vectors])
    torch.testing.assert_close(products, flats @ dense @ flats.T, rtol=1e-10, atol=1e-12)
    # The slopes against reverse-mode autograd's gradient (a copy: the original's batch norm
    # must not move).
    other = copy.deepcopy(model)
    F.cross_entropy(other(x), t).backward()
    gradient = torch.cat([dict(other.named_parameters())[n].grad.reshape(-1) for n in moved])
    torch.testing.assert_close(slopes, flats @ gradient, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(F.cross_entropy(model(x), t)), rel=1e-12)


def test_a_model_returning_a_tuple_is_refused() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3).to(DT)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc(x), x

    model = Pair()
    x, t = batch(0)
    vector = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="returns one tensor"):
        gauss_newton_products(
            model, dict(model.named_parameters()), [vector], (x,), t, F.cross_entropy
        )


# -- the adaptive step against the dense oracle --------------------------------------------------
def oracle_step(
    model: nn.Sequential,
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    t: torch.Tensor,
    damping: float,
    previous: torch.Tensor | None,
    curvature_examples: int | None = None,
) -> tuple[torch.Tensor, tuple[float, ...], float]:
    """The update ``δ`` (flattened), its coefficients and the undamped model's change.

    ``curvature_examples``: the quadratic model (``C`` and ``∇h``) of the batch's first
    examples only; the K-FAC direction is the whole batch's.
    """
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    kept = slice(curvature_examples)
    model.zero_grad()
    F.cross_entropy(model(x[kept]), t[kept]).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad()
    F.cross_entropy(model(x), t).backward()
    direction = []
    for i in (0, 2):
        a, gg = factors[i]
        v = eigen_direction(a, gg, grad_matrix(model[i]), damping)
        direction += [v[:, :-1].reshape(-1), v[:, -1]]
    vectors = [-torch.cat(direction)]
    if previous is not None:
        vectors.append(previous)
    basis = torch.stack(vectors, dim=1)
    c = dense_gauss_newton(model, names, x[kept], t[kept])
    damped = c + damping * torch.eye(basis.shape[0], dtype=DT)
    system, rhs = basis.T @ damped @ basis, basis.T @ g
    coefficients = torch.linalg.solve(system, -rhs)
    delta = basis @ coefficients
    return delta, tuple(coefficients.tolist()), float(g @ delta + 0.5 * delta @ c @ delta)


@pytest.mark.parametrize("trusted_decrease", [None, 0.25, 0.7])
@pytest.mark.parametrize(
    ("model_fraction", "min_model_targets", "kept"),
    [(1.0, 1, 8), (0.3, 32, 8), (0.3, 1, 3), (0.3, 5, 5)],
)
def test_two_adaptive_steps_equal_the_dense_quadratic_model_and_lm_rule(
    model_fraction: float, min_model_targets: int, kept: int, trusted_decrease: float | None
) -> None:
    # With a fraction, the quadratic model (C, ∇h, the damping check's losses) is that of
    # the first ⌈0.3·8⌉ = 3 examples, or of the first 5 when it must hold 5 targets (one per
    # example here), or of the whole batch when it must hold more than 8 (then its slopes
    # are the gradient's, as at fraction 1); the direction stays the whole batch's. Step 1
    # falls between adaptations: checked only if its model promises more than
    # trusted_decrease.
    model = mlp()
    oracle = copy.deepcopy(model)
    damping, decay = 0.05, 0.95
    pre = dkfac.KFACPreconditioner(
        model,
        damping=damping,
        factor_dtype=DT,
        inv_dtype=DT,
        adaptive=dkfac.AdaptiveOptions(
            loss_fn=F.cross_entropy,
            damping_interval=2,
            damping_decay=decay,
            model_fraction=model_fraction,
            trusted_decrease=trusted_decrease,
            min_model_targets=min_model_targets,
        ),
    )
    checked_steps = []
    running: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    previous = None
    omega = decay**2
    for step in range(2):
        x, t = batch(10 + step)
        batch_factors = {i: oracle_layer_factors(oracle, i, x, t) for i in (0, 2)}
        running = {
            i: (a, g)
            if not running
            else (decay * running[i][0] + (1 - decay) * a, decay * running[i][1] + (1 - decay) * g)
            for i, (a, g) in batch_factors.items()
        }
        delta, coefficients, predicted = oracle_step(oracle, running, x, t, damping, previous, kept)
        loss_before = float(F.cross_entropy(oracle(x[:kept]), t[:kept]))
        start = flat(oracle, [n for n, _ in oracle.named_parameters()])
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(start + delta, oracle.parameters())
            loss_after = float(F.cross_entropy(oracle(x[:kept]), t[:kept]))
        previous = delta

        model.zero_grad()
        F.cross_entropy(model(x), t).backward()
        pre.step(x, t)
        assert all(p.grad is None for p in model.parameters())  # moved here, not by an optimizer
        got = flat(model, [n for n, _ in model.named_parameters()])
        torch.testing.assert_close(got, start + delta, rtol=1e-9, atol=1e-12)
        report = pre.adaptive_report
        assert report is not None and report.moved
        want = (*coefficients, 0.0)[:2]
        assert (report.learning_rate, report.momentum) == pytest.approx(want, rel=1e-8)
        assert report.predicted_change == pytest.approx(predicted, rel=1e-8)
        assert report.loss == pytest.approx(loss_before, rel=1e-12)
        promised = trusted_decrease is not None and -predicted > trusted_decrease * loss_before
        if step == 0 or promised:
            # Step 0 adapts the damping (every 2 steps from the first) from the loss actually
            # reached on its batch; step 1 preconditions and models with the new damping.
            checked_steps.append(step)
            ratio = (loss_after - loss_before) / predicted
            # Taken (refusals: the test below), and the damping falls: step 1 checks that
            # the new damping reaches both its direction and its model.
            assert ratio > 0.75
            assert report.ratio == pytest.approx(ratio, rel=1e-8)
            if ratio > 0.75:
                damping *= omega
            elif ratio < 0.25:
                damping /= omega
            assert report.damping == pytest.approx(damping, rel=1e-12)
        else:
            assert report.ratio is None and report.damping == pytest.approx(damping, rel=1e-12)
    assert pre.state_dict()["adaptive"]["damping"] == report.damping
    # This small model's second step promises 0.54 (0.65 on the part) of its loss.
    assert checked_steps == ([0, 1] if trusted_decrease == 0.25 else [0])


def test_a_step_that_raises_the_loss_is_refused_and_the_damping_grows_until_one_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nielsen's rule: the n-th refusal in a row multiplies the damping by 2^(n-1) / ω."""
    import dkfac.adaptive.controller as controller

    model = mlp()
    # ω = 0.0625; only the interval and the refusals decide which steps are checked.
    options = adaptive(damping_interval=4, damping_decay=0.5, trusted_decrease=None)
    pre = dkfac.KFACPreconditioner(model, damping=1e-4, adaptive=options)
    real_loss_at = controller.loss_at
    rises = iter([True, True, True, False, False])
    checked: list[int] = []

    def loss_at(*args: Any) -> float:
        checked.append(pre.steps)
        after = real_loss_at(*args)
        return after + 10.0 if next(rises) else after

    monkeypatch.setattr(controller, "loss_at", loss_at)
    damping = 1e-4
    for step in range(6):
        before = [p.detach().clone() for p in model.parameters()]
        run_adaptive(model, pre, range(step, step + 1))
        report = pre.adaptive_report
        assert report is not None
        if step < 3:  # refused: nothing moved, the damping grew by 16, 32, 64
            damping = damping / 0.0625 * 2.0**step
            assert not report.moved and report.ratio is not None and report.ratio < 0
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        else:
            assert report.moved
            assert (report.ratio is None) == (step == 5)  # 5: neither refused nor on the interval
        if step in (3, 4):  # taken and checked; the ratio decides by the usual rule
            assert report.ratio is not None and report.ratio >= 0
            if report.ratio > 0.75:
                damping *= 0.0625
            elif report.ratio < 0.25:
                damping /= 0.0625
        assert report.damping == pytest.approx(damping, rel=1e-12)
    # Checked at step 0 (the interval), at 1-3 (after refusals), then at 4 (the interval).
    assert checked == [0, 1, 2, 3, 4]
    assert pre.state_dict()["adaptive"]["rejected_steps"] == 3


def test_a_step_that_promises_too_much_is_checked_between_adaptations_and_can_be_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dkfac.adaptive.controller as controller

    model = mlp()
    options = adaptive(damping_interval=10, damping_decay=0.5, trusted_decrease=1e-6)
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=options)
    real_loss_at = controller.loss_at
    checked: list[int] = []

    def loss_at(*args: Any) -> float:
        checked.append(pre.steps)
        after = real_loss_at(*args)
        return after + 10.0 if pre.steps == 1 else after  # step 1 raises the loss

    monkeypatch.setattr(controller, "loss_at", loss_at)
    run_adaptive(model, pre, range(1))
    before = [p.detach().clone() for p in model.parameters()]
    run_adaptive(model, pre, range(1, 2))
    report = pre.adaptive_report
    assert report is not None and not report.moved and report.ratio is not None
    assert report.ratio < 0  # checked though the interval is 10, and refused
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    run_adaptive(model, pre, range(2, 3))
    assert checked == [0, 1, 2]  # 0: the interval, 1: its promise, 2: the refusal (and promise)
    assert pre.state_dict()["adaptive"]["before"] == {}  # checked: nothing to put back


# -- errors, state, workers ------------------------------------------------------------------
def adaptive(**kw: Any) -> dkfac.AdaptiveOptions:
    return dkfac.AdaptiveOptions(loss_fn=F.cross_entropy, **kw)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"damping_interval": 0}, "damping_interval=0"),
        ({"trusted_decrease": 0.0}, "trusted_decrease=0.0 is not allowed: expected a finite"),
        ({"trusted_decrease": math.inf}, "trusted_decrease=inf"),
        ({"damping_decay": 1.0}, "damping_decay=1.0"),
        ({"min_damping": 0.0}, "min_damping=0.0"),
        ({"min_damping": 1.0, "max_damping": 0.5}, "max_damping=0.5"),
        ({"momentum": 1}, "momentum=1"),
        ({"model_fraction": 0.0}, r"model_fraction=0.0 .* \(0, 1\]"),
        ({"model_fraction": 1.5}, "model_fraction=1.5"),
        ({"model_fraction": math.nan}, "model_fraction=nan"),
        ({"min_model_targets": 0}, "min_model_targets=0 is not allowed: expected an integer"),
        ({"min_model_targets": 2.5}, "min_model_targets=2.5"),
    ],
)
def test_bad_adaptive_options_are_refused(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        adaptive(**kwargs)
    with pytest.raises(ValueError, match="loss_fn"):
        dkfac.AdaptiveOptions(loss_fn="cross_entropy")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"damping": lambda step: 0.1}, "damping=callable .* with adaptive"),
        ({"accumulation_steps": 2}, "accumulation_steps=2 .* with adaptive"),
        ({"grad_scaler": torch.amp.GradScaler("cpu")}, "grad_scaler .* with adaptive"),
        ({"adaptive": F.cross_entropy}, "adaptive=.* expected None or dkfac.AdaptiveOptions"),
    ],
)
def test_what_adaptive_cannot_do_is_refused(kwargs: dict[str, Any], pattern: str) -> None:
    kwargs.setdefault("adaptive", adaptive())
    with pytest.raises(ValueError, match=pattern):
        dkfac.KFACPreconditioner(mlp(), **kwargs)


@pytest.mark.parametrize(
    ("target_shape", "fraction", "min_targets", "kept"),
    [
        ((32,), 0.125, 32, 32),  # a class per image: 4 images hold 4 targets, all 32 kept
        ((32,), 0.125, 1, 4),
        ((64,), 0.125, 32, 32),  # 8 would hold 8 targets: 32 kept
        ((256,), 0.125, 32, 32),  # 1/8 already holds 32
        ((8,), 0.125, 32, 8),  # fewer than 32 in the batch: all of it
        ((32, 64), 0.125, 32, 4),  # 64 tokens a sequence: 4 sequences hold 256
        ((32, 8), 0.125, 100, 13),  # ⌈100 / 8⌉ sequences
        ((32, 0), 0.125, 32, 32),  # no target elements to count: the whole batch
    ],
)
def test_the_models_part_holds_at_least_min_model_targets_target_elements(
    target_shape: tuple[int, ...], fraction: float, min_targets: int, kept: int
) -> None:
    n = target_shape[0]
    x = torch.arange(float(n)).reshape(n, 1).expand(n, 3)
    targets = torch.zeros(target_shape)
    part = model_batch((x, 7), targets, fraction, min_targets)
    assert part.targets.shape[0] == kept and part.inputs[0].shape[0] == kept
    assert torch.equal(part.inputs[0], x[:kept]) and part.inputs[1] == 7
    assert part.part == (kept < n)


def test_a_part_of_a_batch_without_its_examples_along_dim_0_is_refused() -> None:
    # Cutting along another dimension (sequence-first data, targets that are not one
    # tensor, tensors inside a container) would model the curvature of something else:
    # refused before anything moves, factors and decompositions included.
    x, t = batch(0)

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3).to(DT)

        def forward(self, x: torch.Tensor, other: Any) -> torch.Tensor:
            return self.fc(x)

    for arguments, targets, pattern in (
        ((x, None), t.reshape(2, 4), r"targets \(2, 4\) do not all have 8"),
        ((x, None), [t], "targets as one tensor, not list"),
        ((x, x[:4]), t, r"tensor inputs \[\(8, 4\), \(4, 4\)\] .* do not all have 8"),
        ((x, [x]), t, "cannot cut the tensors inside a model argument of type list"),
    ):
        model = TwoInputs()
        pre = dkfac.KFACPreconditioner(model, adaptive=adaptive(model_fraction=0.5))
        F.cross_entropy(model(x, None), t).backward()
        before = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(pre.state_dict())
        with pytest.raises(ValueError, match=pattern):
            pre.step(arguments, targets)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        # Nothing was folded or decomposed (no step counted, no factor, no decomposition):
        # the same backward's statistics serve the step taken with a good batch.
        assert str(pre.state_dict()) == str(state)
        pre.step((x, torch.tensor(2.0)), t)  # a scalar tensor argument is not cut
        report = pre.adaptive_report
        assert report is not None and report.step == 0
        assert str(pre.state_dict()) != str(state)  # the comparison above can fail


def test_the_batch_is_required_with_adaptive_and_refused_without() -> None:
    x, t = batch(0)
    for options, call in ((adaptive(), ()), (None, (x, t)), (adaptive(), (x,))):
        model = mlp()
        pre = dkfac.KFACPreconditioner(model, adaptive=options)
        F.cross_entropy(model(x), t).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"step\(inputs, targets\) needs both"):
            pre.step(*call)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def run_adaptive(model: nn.Module, pre: dkfac.KFACPreconditioner, steps: range) -> None:
    for step in steps:
        x, t = batch(20 + step)
        model.zero_grad()
        F.cross_entropy(model(x), t).backward()
        pre.step(x, t)


def test_a_resumed_adaptive_run_continues_bit_for_bit() -> None:
    def build() -> tuple[nn.Module, dkfac.KFACPreconditioner]:
        model = mlp()
        options = adaptive(damping_interval=2, damping_decay=0.95)
        return model, dkfac.KFACPreconditioner(model, damping=0.05, adaptive=options)

    model, pre = build()
    run_adaptive(model, pre, range(6))
    first, pre_first = build()
    run_adaptive(first, pre_first, range(3))
    saved = copy.deepcopy((first.state_dict(), pre_first.state_dict()))
    resumed, pre_resumed = build()
    resumed.load_state_dict(saved[0])
    pre_resumed.load_state_dict(saved[1])
    run_adaptive(resumed, pre_resumed, range(3, 6))
    for got, want in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
    assert pre_resumed.adaptive_report == pre.adaptive_report
    plain = dkfac.KFACPreconditioner(mlp()).state_dict()
    with pytest.raises(ValueError, match="no adaptive K-FAC state"):
        build()[1].load_state_dict(plain)


def adaptive_workers(rank: int, world_size: int, strategies: list[str]) -> list[list[torch.Tensor]]:
    out = []
    with pytest.raises(ValueError, match="adaptive is not allowed with strategy='local' on 2"):
        dkfac.KFACPreconditioner(mlp(), strategy="local", adaptive=adaptive())
    for strategy in strategies:
        model = mlp()
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = dkfac.KFACPreconditioner(
            ddp,
            strategy=strategy,
            damping=0.05,
            factor_dtype=DT,
            inv_dtype=DT,
            adaptive=adaptive(damping_interval=2, damping_decay=0.95),
        )
        for step in range(4):
            x, t = batch(30 + step, n=4 * world_size)
            mine = slice(4 * rank, 4 * (rank + 1))
            ddp.zero_grad()
            F.cross_entropy(ddp(x[mine]), t[mine]).backward()
            pre.step(x[mine], t[mine])
        out.append([p.detach().clone() for p in model.parameters()])
        pre.remove()
    return out


def test_adaptive_workers_equal_one_process_on_the_global_batch() -> None:
    """Every strategy agrees across replicas bit for bit; those computing factors from the
    global batch equal one process on it (float64). DP-KFAC builds each layer's factors from
    its owner's shard (by design; test_dp has its oracle), so only its replicas are compared."""
    strategies = ["dkfac", "kaisa", "spd", "pad", "dp"]
    results = run_workers(adaptive_workers, 2, (strategies,))
    model = mlp()
    pre = dkfac.KFACPreconditioner(
        model,
        damping=0.05,
        factor_dtype=DT,
        inv_dtype=DT,
        adaptive=adaptive(damping_interval=2, damping_decay=0.95),
    )
    for step in range(4):
        x, t = batch(30 + step, n=8)
        model.zero_grad()
        F.cross_entropy(model(x), t).backward()
        pre.step(x, t)
    start = list(mlp().parameters())
    for index, strategy in enumerate(strategies):
        for got, first in zip(results[1][index], results[0][index], strict=True):
            assert torch.equal(got, first), strategy  # replicas agree to the last bit
        if strategy == "dp":
            continue
        for got, want, first in zip(results[0][index], model.parameters(), start, strict=True):
            moved = float((want - first).abs().max())
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-9 * moved, msg=strategy)


def nan_step(model: nn.Module, pre: dkfac.KFACPreconditioner) -> None:
    x, t = batch(99)
    x[0, 0] = math.nan  # this batch's loss and gradients are NaN
    model.zero_grad()
    F.cross_entropy(model(x), t).backward()
    pre.step(x, t)


def test_a_step_without_a_finite_model_moves_nothing_and_raises_the_damping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(3)  # a layer K-FAC does not precondition: the optimizer moves it
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    options = adaptive(damping_interval=1, damping_decay=0.5)
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(steps: range) -> None:
        for step in steps:
            run_adaptive(model, pre, range(step, step + 1))
            optimizer.step()

    train(range(2))
    before = [p.detach().clone() for p in model.parameters()]
    damping = pre.state_dict()["adaptive"]["damping"]
    nan_step(model, pre)  # after a checked step: nothing to take back
    optimizer.step()
    report = pre.adaptive_report
    assert report is not None and not report.moved and report.ratio == -math.inf
    assert report.damping > damping  # raised (by the non-finite model, or a refused step)
    # Nothing moved, the normalisation layer (moved by the optimizer) included.
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert "did not move" in caplog.text and "took back" not in caplog.text
    train(range(2, 4))  # training goes on from the same parameters
    assert pre.adaptive_report is not None and pre.adaptive_report.moved
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_non_finite_model_after_an_unchecked_step_puts_back_the_parameters_before_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def build() -> tuple[nn.Module, dkfac.KFACPreconditioner]:
        model = mlp()
        # Step 0 checked, 1-9 not; Martens and Grosse's decay keeps the damping near 0.05.
        options = adaptive(damping_interval=10, damping_decay=0.95, trusted_decrease=None)
        return model, dkfac.KFACPreconditioner(model, damping=0.05, adaptive=options)

    model, pre = build()
    run_adaptive(model, pre, range(2))
    start = [p.detach().clone() for p in model.parameters()]
    run_adaptive(model, pre, range(2, 3))  # unchecked: moved
    assert pre.adaptive_report is not None and pre.adaptive_report.ratio is None
    assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    saved = copy.deepcopy((model.state_dict(), pre.state_dict()))
    nan_step(model, pre)
    report = pre.adaptive_report
    assert report is not None and not report.moved and report.ratio == -math.inf
    # Bit for bit the parameters step 2 started from, not a subtraction's rounding.
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    assert "took back the last step" in caplog.text
    run_adaptive(model, pre, range(4, 5))  # checked (after a refusal), and taken
    assert pre.adaptive_report is not None and pre.adaptive_report.moved
    assert pre.adaptive_report.ratio is not None
    # A run resumed between the unchecked step and the NaN one does the same.
    resumed, pre_resumed = build()
    resumed.load_state_dict(saved[0])
    pre_resumed.load_state_dict(saved[1])
    nan_step(resumed, pre_resumed)
    assert all(torch.equal(p, s) for p, s in zip(resumed.parameters(), start, strict=True))
    # States saved before "before" existed load; a "before" of other shapes is refused.
    old = copy.deepcopy(saved[1])
    del old["adaptive"]["before"]
    build()[1].load_state_dict(old)
    assert set(saved[1]["adaptive"]["before"]) == {n for n, _ in model.named_parameters()}
    bad = copy.deepcopy(saved[1])
    bad["adaptive"]["before"]["0.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"parameter '0\.weight' before its last step"):
        build()[1].load_state_dict(bad)
    bad["adaptive"]["before"] = [torch.zeros(1)]
    with pytest.raises(ValueError, match=r"'before'.* is not a dict"):
        build()[1].load_state_dict(bad)


def shard_step(
    ddp: nn.Module, pre: dkfac.KFACPreconditioner, rank: int, seed: int, poisoned: bool = False
) -> None:
    """One DDP step of two workers on their shards of a global batch of 8 (the second
    worker's first input NaN when ``poisoned``)."""
    x, t = batch(seed, n=8)
    mine = slice(4 * rank, 4 * (rank + 1))
    if poisoned and rank == 1:
        x[4, 0] = math.nan
    ddp.zero_grad()
    F.cross_entropy(ddp(x[mine]), t[mine]).backward()
    pre.step(x[mine], t[mine])


def put_back_outcome(rank: int, strategy: str) -> list[bool]:
    """After an unchecked step, one worker's shard turns NaN: on every rank the parameters
    must go back, bit for bit, to those that step started from."""
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    options = adaptive(damping_interval=10, damping_decay=0.95, trusted_decrease=None)
    pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, damping=0.05, adaptive=options)
    shard_step(ddp, pre, rank, 40)  # checked
    shard_step(ddp, pre, rank, 41)  # unchecked, taken
    start = [p.detach().clone() for p in model.parameters()]
    shard_step(ddp, pre, rank, 42)  # unchecked, taken: the step the NaN one takes back
    report = pre.adaptive_report
    moved = report is not None and report.moved and report.ratio is None
    changed = not all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    shard_step(ddp, pre, rank, 43, poisoned=True)
    report = pre.adaptive_report
    refused = report is not None and not report.moved and report.ratio == -math.inf
    back = all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    shard_step(ddp, pre, rank, 44)  # training goes on (checked after the refusal)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    pre.remove()
    return [moved, changed, refused, back, finite]


def put_back_workers(rank: int, world_size: int, strategies: list[str]) -> list[list[bool]]:
    assert world_size == 2
    return [put_back_outcome(rank, strategy) for strategy in strategies]


def test_workers_put_back_the_last_unchecked_step_when_one_shard_turns_non_finite() -> None:
    # The loss and model the rule reads are agreed over the workers, so a NaN on one worker's
    # shard takes the step back on both, to the same bits (oracle: the parameters each rank
    # saved before the step); strategies that reduce factors, broadcast decompositions, and
    # keep them local (DP-KFAC).
    strategies = ["dkfac", "kaisa", "dp"]
    results = run_workers(put_back_workers, 2, (strategies,))
    for rank, outcomes in enumerate(results):
        for strategy, outcome in zip(strategies, outcomes, strict=True):
            assert outcome == [True] * 5, (rank, strategy, outcome)


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_every_extra_pass_replays_the_random_state_and_training_randomness_is_untouched() -> None:
    torch.manual_seed(0)
    model = DropoutNet().to(DT)
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=adaptive(damping_interval=1))
    x, t = batch(7)
    F.cross_entropy(model(x), t).backward()
    before = copy.deepcopy(model)
    entry = torch.get_rng_state()
    pre.step(x, t)
    after_step = torch.rand(3)
    torch.set_rng_state(entry)
    assert torch.equal(after_step, torch.rand(3))  # the run's own random stream did not move
    report = pre.adaptive_report
    assert report is not None and report.ratio is not None
    # The loss before is the model's at the entry state's dropout masks...
    torch.set_rng_state(entry)
    with torch.no_grad():
        want_before = float(F.cross_entropy(before(x), t))
        # ... and so is the loss after the step, from which ρ came.
        torch.set_rng_state(entry)
        want_after = float(F.cross_entropy(model(x), t)) if report.moved else None
    assert report.loss == pytest.approx(want_before, rel=1e-12)
    if want_after is not None:
        assert report.ratio == pytest.approx(
            (want_after - want_before) / report.predicted_change, rel=1e-9
        )


def test_a_bfloat16_model_measures_its_losses_in_float32() -> None:
    model = mlp().to(torch.bfloat16)
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=adaptive())
    x, t = batch(8)
    x = x.to(torch.bfloat16)
    F.cross_entropy(model(x), t).backward()
    with torch.no_grad():
        want = float(F.cross_entropy(model(x).float(), t))
    pre.step(x, t)
    assert pre.adaptive_report is not None
    assert pre.adaptive_report.loss == pytest.approx(want, rel=1e-6)  # not bf16's 2^-8 steps


def test_a_model_torch_func_cannot_differentiate_is_refused_with_the_reason() -> None:
    from torch.utils.checkpoint import checkpoint

    class Reentrant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.body, x, use_reentrant=True)  # type: ignore[no-any-return]

    model = Reentrant()
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=adaptive())
    x, t = batch(9)
    F.cross_entropy(model(x.requires_grad_()), t).backward()
    capturing = pre._capture.capturing
    with pytest.raises(ValueError, match="reentrant activation checkpointing"):
        pre.step(x, t)
    assert pre._capture.capturing == capturing and pre.steps == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"loss_reduction": "sum"}, "loss_reduction='sum' is not allowed with adaptive"),
        ({"damping": 1e4}, r"damping=10000.0 is not allowed with adaptive: .*\[0.0001, 1000.0\]"),
    ],
)
def test_a_summed_loss_and_an_initial_damping_out_of_bounds_are_refused(
    kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        dkfac.KFACPreconditioner(mlp(), adaptive=adaptive(), **kwargs)


def test_a_saved_state_loads_onto_the_model_dtype_and_bad_damping_is_refused() -> None:
    model = mlp()
    options = adaptive(damping_interval=10, trusted_decrease=None)  # step 1 unchecked
    pre = dkfac.KFACPreconditioner(model, damping=0.05, adaptive=options)
    run_adaptive(model, pre, range(2))
    state = copy.deepcopy(pre.state_dict())
    assert state["adaptive"]["before"]  # the parameters before the unchecked step 1
    single = mlp().float()
    loaded = dkfac.KFACPreconditioner(single, damping=0.05, adaptive=options)
    loaded.load_state_dict(state)
    assert loaded._adaptive is not None
    assert all(p.dtype == torch.float32 for p in loaded._adaptive._previous.values())
    assert all(p.dtype == torch.float32 for p in loaded._adaptive._before.values())
    state["adaptive"]["damping"] = float("nan")
    with pytest.raises(ValueError, match="the saved adaptive damping=nan is not allowed"):
        dkfac.KFACPreconditioner(mlp(), adaptive=adaptive()).load_state_dict(state)
    # A damping below today's floor, saved under the floor before it: refused with the way
    # out, and loaded given the old floor.
    state["adaptive"]["damping"] = 3e-5
    with pytest.raises(ValueError, match=r"damping=3e-05 .* loads with min_damping <= 3e-05"):
        dkfac.KFACPreconditioner(mlp(), adaptive=adaptive()).load_state_dict(state)
    old_floor = dkfac.KFACPreconditioner(mlp(), adaptive=adaptive(min_damping=1e-5))
    old_floor.load_state_dict(state)
    assert old_floor._adaptive is not None and old_floor._adaptive.damping == 3e-5


@pytest.mark.skipif(
    os.environ.get("PYTORCH_JIT", "1") == "0" or not __debug__,
    reason="torch loads forward mode's decompositions only with TorchScript and __debug__",
)
def test_building_an_adaptive_preconditioner_loads_forward_mode_not_its_first_step() -> None:
    # A fresh process: in this one, an earlier test may have loaded the decompositions.
    script = textwrap.dedent(
        """
        import sys, torch, torch.nn.functional as F
        import dkfac
        name = "torch._decomp.decompositions_for_jvp"
        model = torch.nn.Linear(3, 2)
        before = name in sys.modules
        dkfac.KFACPreconditioner(model, adaptive=dkfac.AdaptiveOptions(loss_fn=F.cross_entropy))
        print(before, name in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["False", "True"]
