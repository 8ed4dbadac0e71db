"""Behaviour of the public object: validation, state, hooks, recovery, integration."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac.curvature.inverse import EigenInverse


def small_model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).to(dtype)


def batch(
    seed: int, n: int = 8, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 5, 5, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def train_step(
    model: nn.Module, pre: dkfac.KFACPreconditioner, opt: torch.optim.Optimizer, seed: int
) -> None:
    x, y = batch(seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    opt.step()


F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"damping": -1.0}, r"damping=-1\.0 .*> 0"),
        ({"damping": 0.0}, r"damping=0\.0"),
        ({"damping": "big"}, r"damping='big'"),
        ({"factor_decay": 1.0}, r"factor_decay=1\.0 .*\[0, 1\)"),
        ({"factor_decay": -0.1}, r"factor_decay=-0\.1"),
        ({"kl_clip": 0.0}, r"kl_clip=0\.0"),
        ({"lr": -0.1}, r"lr=-0\.1"),
        ({"factor_update_steps": 0}, r"factor_update_steps=0 .*integer >= 1"),
        ({"inv_update_steps": 2.5}, r"inv_update_steps=2\.5"),
        ({"accumulation_steps": 0}, r"accumulation_steps=0"),
        ({"factor_update_steps": 10, "inv_update_steps": 15}, r"inv_update_steps=15 .*multiple"),
        ({"strategy": "magic"}, r"strategy='magic' .*'local'"),
        ({"inverse_method": "svd"}, r"inverse_method='svd' .*'eigen', 'inverse'"),
        ({"loss_reduction": "max"}, r"loss_reduction='max'"),
        ({"factor_dtype": torch.int32}, r"factor_dtype=torch\.int32"),
        ({"inv_dtype": torch.float16}, r"inv_dtype=torch\.float16"),
        ({"skip_layers": "fc"}, r"skip_layers='fc' .*sequence"),
        ({"skip_layers": ["("]}, r"skip_layers entry '\('"),
        ({"grad_scaler": object()}, r"grad_scaler=.*GradScaler"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        dkfac.KFACPreconditioner(small_model(), **kwargs)


def test_model_without_supported_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no layer K-FAC can precondition.*BatchNorm1d"):
        dkfac.KFACPreconditioner(nn.Sequential(nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match="model=int"):
        dkfac.KFACPreconditioner(3)  # type: ignore[arg-type]


def test_grouped_convolution_is_refused_with_its_name() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\).*groups=2.*skip_layers"):
        dkfac.KFACPreconditioner(model)
    pre = dkfac.KFACPreconditioner(model, skip_layers=["^0$"])
    assert [layer.name for layer in pre.layers] == ["2"]


def test_callable_hyperparameter_is_validated_when_used() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, damping=lambda step: -1.0, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"damping=-1\.0"):
        train_step(model, pre, opt, 0)


def test_step_before_backward_and_changed_model_raise_runtime_error() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model)
    with pytest.raises(RuntimeError, match=r"loss\.backward\(\) before"):
        pre.step()
    model[4] = nn.Linear(100, 6).double()
    with pytest.raises(RuntimeError, match=r"model changed.*'4'"):
        pre.step()


# -- discovery and repr --------------------------------------------------------------------------
def test_repr_lists_every_layer_and_why_modules_are_skipped() -> None:
    pre = dkfac.KFACPreconditioner(small_model(), skip_layers=[r"^6$"])
    text = repr(pre)
    assert re.search(r"0\s+Conv2d\s+19x19\s+4x4\s+preconditioned", text)  # 2·3·3 + bias
    assert re.search(r"4\s+Linear\s+101x101\s+6x6\s+preconditioned", text)
    assert re.search(r"1\s+BatchNorm2d.*skipped: unsupported type", text)
    assert re.search(r"6\s+Linear.*skipped: matches skip_layers", text)


def test_skip_layers_matches_class_names_and_frozen_layers_are_skipped() -> None:
    model = small_model()
    model[6].weight.requires_grad_(False)
    pre = dkfac.KFACPreconditioner(model, skip_layers=["Conv"])
    assert [layer.name for layer in pre.layers] == ["4"]
    reasons = {s.name: s.reason for s in pre.skipped}
    assert reasons["0"] == "matches skip_layers"
    assert reasons["6"] == "parameters do not require grad"


def test_ddp_wrapped_model_uses_names_without_module_prefix(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = dkfac.KFACPreconditioner(ddp, **F64)
        reference_model = copy.deepcopy(model)
        reference = dkfac.KFACPreconditioner(reference_model, **F64)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
        for seed in range(2):
            train_step(ddp, pre, opt, seed)
            train_step(reference_model, reference, ref_opt, seed)
        assert set(pre.factors()) == {"0", "4", "6"}
        for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


# -- hooks -------------------------------------------------------------------------------------
def test_remove_detaches_every_hook() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model)
    pre.remove()
    assert all(not m._forward_hooks for m in model.modules())
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    assert all(not layer.has_statistics for layer in pre.layers)
    with pytest.raises(RuntimeError, match="remove"):
        pre.step()


def test_eval_and_no_grad_forwards_are_not_captured() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model)
    x, _ = batch(0)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert all(not layer.has_statistics for layer in pre.layers)


def test_unused_layer_keeps_its_gradient_none_and_others_are_preconditioned() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(torch.tanh(self.body(x)))

    model = TwoHeads().double()
    pre = dkfac.KFACPreconditioner(model, **F64)
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).square().mean().backward()
    before = model.used.weight.grad.clone()
    pre.step()
    assert model.unused.weight.grad is None
    assert not torch.equal(before, model.used.weight.grad)
    assert set(pre.factors()) == {"body", "used"}


# -- state -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_continues_bitwise(method: str) -> None:
    kwargs = dict(inverse_method=method, factor_update_steps=2, inv_update_steps=4, **F64)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = dkfac.KFACPreconditioner(model, **kwargs)
    for seed in range(5):
        train_step(model, pre, opt, seed)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), pre.state_dict()))

    resumed = small_model()
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed_pre = dkfac.KFACPreconditioner(resumed, **kwargs)
    resumed_pre.load_state_dict(saved[2])
    assert resumed_pre.steps == 5
    for seed in range(5, 11):
        train_step(model, pre, opt, seed)
        train_step(resumed, resumed_pre, resumed_opt, seed)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    for name, (a, g) in pre.factors().items():
        assert torch.equal(a, resumed_pre.factors()[name][0])
        assert torch.equal(g, resumed_pre.factors()[name][1])


def test_load_state_dict_rejects_a_different_model() -> None:
    pre = dkfac.KFACPreconditioner(small_model())
    other = dkfac.KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="layers do not match"):
        pre.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="not a dkfac"):
        pre.load_state_dict({"steps": 1})


# -- numerical trouble ---------------------------------------------------------------------------
def test_nan_batch_is_dropped_and_reported_once() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step(model, pre, opt, 0)
    good = {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}
    good_inverse = pre.layers[0].inverse

    x, y = batch(1)
    x[0, 0, 0, 0] = float("nan")
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for p in model.parameters():  # the user's gradient is not ours to judge: make it finite
        p.grad = torch.nan_to_num(p.grad)
    with pytest.warns(RuntimeWarning) as record:
        pre.step()
    # The NaN pixel reaches every layer's statistics: each layer is named once.
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 3
    for name, message in zip(["0", "4", "6"], messages, strict=True):
        assert re.search(rf"layer '{name}'.*NaN/Inf", message)
    assert torch.equal(pre.factors()["0"][0], good["0"][0])
    # Recomputed from the unchanged running factors: the same decomposition.
    for key, tensor in good_inverse.tensors().items():
        assert torch.equal(pre.layers[0].inverse.tensors()[key], tensor)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # The same trouble again is not reported again; training goes on.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = torch.nan_to_num(p.grad)
        pre.step()
        train_step(model, pre, opt, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_before_first_decomposition_passes_gradient_unchanged() -> None:
    model = nn.Sequential(nn.Linear(3, 2)).double()
    pre = dkfac.KFACPreconditioner(model, kl_clip=None, **F64)
    x = torch.randn(4, 3, dtype=torch.float64)
    x[1, 1] = float("inf")
    model(x).sum().backward()
    model[0].weight.grad = torch.nan_to_num(model[0].weight.grad, posinf=0.0, neginf=0.0)
    expected = model[0].weight.grad.clone()
    with pytest.warns(RuntimeWarning) as record:
        pre.step()
    assert any("not finite" in str(w.message) for w in record)
    assert all("layer '0'" in str(w.message) for w in record)
    assert torch.equal(model[0].weight.grad, expected)


def test_failed_decomposition_is_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    model = small_model(torch.float32)
    pre = dkfac.KFACPreconditioner(model)
    real_eigh = torch.linalg.eigh

    def flaky_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", flaky_eigh)
    x, y = batch(0, dtype=torch.float32)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match="recomputed in float64"):
        pre.step()
    for layer in pre.layers:
        assert isinstance(layer.inverse, EigenInverse)
        assert layer.inverse.qa.dtype == torch.float64


def test_decomposition_failing_everywhere_keeps_the_last_good_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step(model, pre, opt, 0)
    kept = [layer.inverse for layer in pre.layers]

    def broken(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("boom")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.warns(RuntimeWarning, match="keeping the last good decomposition"):
        train_step(model, pre, opt, 1)
    assert [layer.inverse for layer in pre.layers] == kept
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cholesky_failure_is_detected_without_exceptions() -> None:
    a = torch.eye(3, dtype=torch.float64)
    g = -torch.eye(2, dtype=torch.float64) * 10  # damped G stays indefinite
    _, ok = dkfac.curvature.decompose(a, g, 0.01, "inverse", torch.float64)
    assert not bool(ok)


# -- precision and AMP -------------------------------------------------------------------------
def test_bf16_model_accumulates_factors_in_factor_dtype() -> None:
    model = small_model(torch.bfloat16)
    pre = dkfac.KFACPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch(0, dtype=torch.bfloat16)
    opt.zero_grad()
    F.cross_entropy(model(x).float(), y).backward()
    pre.step()
    opt.step()
    for a, g in pre.factors().values():
        assert a.dtype == torch.float32 and g.dtype == torch.float32
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_grad_scaler_output_gradients_are_unscaled() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plain_model = small_model()
    scaled_model = copy.deepcopy(plain_model)
    plain = dkfac.KFACPreconditioner(plain_model, **F64)
    scaled = dkfac.KFACPreconditioner(scaled_model, grad_scaler=scaler, **F64)
    opt = torch.optim.SGD(scaled_model.parameters(), lr=0.1)
    x, y = batch(0)
    F.cross_entropy(plain_model(x), y).backward()
    plain.step()
    scaler.scale(F.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(opt)
    scaled.step()
    for name, (a, g) in plain.factors().items():
        torch.testing.assert_close(scaled.factors()[name][0], a, rtol=1e-12, atol=0)
        torch.testing.assert_close(scaled.factors()[name][1], g, rtol=1e-12, atol=0)
    for p, q in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-14)


def test_accumulation_mismatch_is_reported() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=2, **F64)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"1 backward pass\(es\).*accumulation_steps=2"):
        pre.step()


# -- convergence on real data ------------------------------------------------------------------
def test_kfac_reaches_95_percent_on_digits_in_fewer_epochs_than_sgd() -> None:
    pytest.importorskip("sklearn")
    from dkfac.demo import first_epoch_reaching, train_digits

    torch.set_num_threads(min(2, torch.get_num_threads()))
    sgd = train_digits(use_kfac=False, epochs=6, lr=0.05, batch_size=64, seed=0)
    kfac = train_digits(use_kfac=True, epochs=6, lr=0.05, batch_size=64, seed=0)
    kfac_epoch = first_epoch_reaching(kfac, 0.95)
    sgd_epoch = first_epoch_reaching(sgd, 0.95)
    assert kfac_epoch is not None, f"K-FAC never reached 95%: {kfac}"
    assert sgd_epoch is None or kfac_epoch < sgd_epoch, (sgd, kfac)
    assert math.isfinite(kfac[-1])
