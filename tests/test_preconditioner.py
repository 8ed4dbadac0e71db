"""Behaviour of the public object: validation, state, hooks, recovery, integration."""

from __future__ import annotations

import copy
import logging
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import dkfac
from dkfac import deferred_statistics
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.inverse import EigenInverse
from dynamo_trouble import dynamo_trouble
from host_reads import HostReadSpy


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
POSITIVE = r"is not allowed: expected a finite number > 0 or a callable of the step"
NON_NEGATIVE = r"is not allowed: expected a finite number >= 0 or a callable of the step"
KL_CLIP = r"is not allowed: expected a finite number > 0, a callable of the step, or None"
DECAY = r"is not allowed: expected a number in \[0, 1\) or a callable of the step"
AT_LEAST_ONE = r"is not allowed: expected an integer >= 1"
FLOAT_DTYPE = r"is not allowed: expected a floating dtype \(torch\.float16, .*torch\.float64\)"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"damping": -1.0}, rf"damping=-1\.0 {POSITIVE}"),
        ({"damping": 0.0}, rf"damping=0\.0 {POSITIVE}"),
        ({"damping": math.inf}, rf"damping=inf {POSITIVE}"),
        ({"damping": math.nan}, rf"damping=nan {POSITIVE}"),
        ({"damping": "big"}, rf"damping='big' {POSITIVE}"),
        ({"factor_decay": 1.0}, rf"factor_decay=1\.0 {DECAY}"),
        ({"factor_decay": -0.1}, rf"factor_decay=-0\.1 {DECAY}"),
        ({"kl_clip": 0.0}, rf"kl_clip=0\.0 {KL_CLIP}"),
        ({"kl_clip": -0.5}, rf"kl_clip=-0\.5 {KL_CLIP}"),
        ({"kl_clip": math.inf}, rf"kl_clip=inf {KL_CLIP}"),
        ({"lr": -0.1}, rf"lr=-0\.1 {NON_NEGATIVE}"),
        ({"lr": math.inf}, rf"lr=inf {NON_NEGATIVE}"),
        ({"factor_update_steps": 0}, rf"factor_update_steps=0 {AT_LEAST_ONE}"),
        ({"inv_update_steps": 0}, rf"inv_update_steps=0 {AT_LEAST_ONE}"),
        ({"inv_update_steps": 2.5}, rf"inv_update_steps=2\.5 {AT_LEAST_ONE}"),
        ({"accumulation_steps": 0}, rf"accumulation_steps=0 {AT_LEAST_ONE}"),
        (
            {"factor_update_steps": 10, "inv_update_steps": 15},
            r"inv_update_steps=15 is not allowed: expected a multiple of factor_update_steps=10 ",
        ),
        ({"strategy": "magic"}, r"strategy='magic' is not allowed: expected one of 'local'"),
        (
            {"inverse_method": "svd"},
            r"inverse_method='svd' is not allowed: expected one of 'eigen', 'inverse'",
        ),
        (
            {"loss_reduction": "max"},
            r"loss_reduction='max' is not allowed: expected one of 'mean', 'sum'",
        ),
        ({"factor_dtype": torch.int32}, rf"factor_dtype=torch\.int32 {FLOAT_DTYPE}"),
        (
            {"inv_dtype": torch.float16},
            r"inv_dtype=torch\.float16 is not allowed: decompositions need torch\.float32 or "
            r"torch\.float64",
        ),
        (
            {"skip_layers": "fc"},
            r"skip_layers='fc' is not allowed: expected a sequence of regular expressions",
        ),
        (
            {"skip_layers": ["("]},
            r"skip_layers entry '\(' is not allowed: expected a regular expression",
        ),
        (
            {"grad_scaler": object()},
            r"grad_scaler=.* is not allowed: expected a torch\.amp\.GradScaler or None",
        ),
        (
            {"strategy": "spd", "cost_model": "fast"},
            r"cost_model='fast' is not allowed: expected a dkfac\.comm\.ClusterCostModel, "
            r"a CostModelCache or None",
        ),
        (
            {"strategy": "kaisa", "grad_worker_fraction": 1.5},
            r"grad_worker_fraction=1\.5 is not allowed: expected a number in \(0, 1\]",
        ),
        (
            {"strategy": "pad", "profile_steps": -1},
            r"profile_steps=-1 is not allowed: expected an integer >= 0",
        ),
        (
            {"strategy": "pad", "share": "both"},
            r"share='both' is not allowed: expected one of 'decompositions', 'gradients', "
            r"'auto'",
        ),
        (
            {"strategy": dkfac.strategies.PADOptions(share="gradients"), "share": "auto"},
            r"share='auto' is not allowed with strategy='pad': set it in the options object "
            r"\(PADOptions\(share=...\)\)",
        ),
        # An option the chosen strategy does not read is refused, not ignored.
        (
            {"cost_model": "fast"},
            r"cost_model='fast' is not allowed with strategy='local': it is an option of "
            r"strategy 'spd' or 'pad'",
        ),
        (
            {"strategy": "spd", "share": "gradients"},
            r"share='gradients' is not allowed with strategy='spd': it is an option of "
            r"strategy 'pad'",
        ),
        (
            {"strategy": "spd", "grad_worker_fraction": 0.5},
            r"grad_worker_fraction=0\.5 is not allowed with strategy='spd': it is an option "
            r"of strategy 'kaisa'",
        ),
        (
            {"strategy": dkfac.strategies.KAISAOptions(0.5), "grad_worker_fraction": 0.25},
            r"grad_worker_fraction=0\.25 is not allowed with strategy='kaisa': set it in the "
            r"options object \(KAISAOptions\(grad_worker_fraction=...\)\)",
        ),
        (  # equal to the default, but given next to the object: which one is meant?
            {"strategy": dkfac.strategies.KAISAOptions(0.5), "grad_worker_fraction": 1.0},
            r"grad_worker_fraction=1\.0 is not allowed with strategy='kaisa': set it in the "
            r"options object",
        ),
        (  # True == 1.0, but it is not a fraction
            {"strategy": "dkfac", "grad_worker_fraction": True},
            r"grad_worker_fraction=True is not allowed with strategy='dkfac': it is an option "
            r"of strategy 'kaisa'",
        ),
        (
            {"strategy": dkfac.strategies.SPDOptions(), "profile_steps": 5},
            r"profile_steps=5 is not allowed with strategy='spd': set it in the options object",
        ),
        (
            {"strategy": dkfac.strategies.StrategyOptions()},
            r"strategy=StrategyOptions\(\) is not allowed: expected one of 'local'",
        ),
        (
            {"strategy": 3},
            r"strategy=3 is not allowed: expected one of 'local', 'dkfac', 'kaisa', 'spd', "
            r"'pad', 'dp' or an options object \(LocalOptions, ",
        ),
        (
            {"bucket_cap_mb": math.inf},
            r"bucket_cap_mb=inf is not allowed: expected None or a finite number of MiB >= 0",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        dkfac.KFACPreconditioner(small_model(), **kwargs)


def test_a_learning_rate_of_zero_is_accepted_where_a_schedule_ends() -> None:
    # A cosine schedule ends at 0; the constant is accepted like the callable, and KL
    # clipping then scales nothing (ν = 1): the gradients are those of no clipping at all.
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    grads = []
    for options in ({"lr": 0.0, "kl_clip": 0.001}, {"kl_clip": None}):
        model = small_model()
        pre = dkfac.KFACPreconditioner(model, **options)
        model(x).square().sum().backward()
        pre.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.isfinite(g).all() for g in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_model_without_supported_layers_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"model=Sequential is not allowed: it has no layer K-FAC can precondition "
        r"\(nn\.Linear, nn\.Conv2d, nn\.Conv1d, transformers' Conv1D\); found: BatchNorm1d",
    ):
        dkfac.KFACPreconditioner(nn.Sequential(nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match=r"model=int is not allowed: expected a torch\.nn\.Module"):
        dkfac.KFACPreconditioner(3)  # type: ignore[arg-type]


def test_grouped_convolution_is_refused_with_its_name() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(
        ValueError,
        match=r"layer '0' \(Conv2d\): grouped convolution \(groups=2\) is not supported; "
        r"add its name to skip_layers",
    ):
        dkfac.KFACPreconditioner(model)
    pre = dkfac.KFACPreconditioner(model, skip_layers=["^0$"])
    assert [layer.name for layer in pre.layers] == ["2"]


def test_callable_hyperparameter_is_validated_when_used() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, damping=lambda step: -1.0, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=rf"damping=-1\.0 \(returned by the callable at step 0\) {POSITIVE}"
    ):
        train_step(model, pre, opt, 0)


def test_callable_kl_clip_returning_inf_is_refused_at_its_step() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, kl_clip=lambda k: 1e-3 if k < 1 else math.inf, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, pre, opt, 0)
    with pytest.raises(
        ValueError, match=rf"kl_clip=inf \(returned by the callable at step 1\) {KL_CLIP}"
    ):
        train_step(model, pre, opt, 1)


@pytest.mark.parametrize(
    ("intervals", "bad_step", "pattern"),
    [
        (
            {"factor_update_steps": lambda k: 2, "inv_update_steps": lambda k: 4 if k < 4 else 3},
            4,
            r"inv_update_steps=3 \(at step 4\) is not allowed: expected a multiple of "
            r"factor_update_steps=2 at that step",
        ),
        (
            {"factor_update_steps": lambda k: 1 if k < 2 else 3, "inv_update_steps": 2},
            2,
            r"inv_update_steps=2 \(at step 2\) is not allowed: expected a multiple of "
            r"factor_update_steps=3 at that step",
        ),
        (
            # step k also decides whether step k + 1 captures statistics: checked before
            # anything changes
            {"factor_update_steps": lambda k: 1 if k < 3 else 0},
            2,
            rf"factor_update_steps=0 \(returned by the callable at step 3\) {AT_LEAST_ONE}",
        ),
        (
            {"inv_update_steps": lambda k: 1 if k < 1 else -2},
            1,
            rf"inv_update_steps=-2 \(returned by the callable at step 1\) {AT_LEAST_ONE}",
        ),
    ],
    ids=["not-multiple", "not-multiple-constant-inv", "zero", "negative"],
)
def test_callable_intervals_are_validated_at_each_step_before_anything_changes(
    intervals: dict, bad_step: int, pattern: str
) -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **intervals, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(bad_step):
        train_step(model, pre, opt, seed)
    x, y = batch(bad_step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    factors = {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}
    with pytest.raises(ValueError, match=pattern):
        pre.step()
    assert pre.steps == bad_step
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    for name, (a, g) in pre.factors().items():
        assert torch.equal(a, factors[name][0]) and torch.equal(g, factors[name][1])


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


class TiedLanguageModel(nn.Module):
    """GPT-2's weight tying: the LM head's weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.hidden(self.embed(tokens))))


def test_a_layer_whose_parameter_is_tied_to_another_module_is_skipped_with_the_reason() -> None:
    model = TiedLanguageModel().double()
    pre = dkfac.KFACPreconditioner(model, **F64)
    assert [layer.name for layer in pre.layers] == ["hidden"]
    reasons = {s.name: s.reason for s in pre.skipped}
    assert reasons == {
        "embed": "parameter shared with 'lm_head'",
        "lm_head": "parameter shared with 'embed'",
    }
    assert re.search(r"lm_head\s+Linear.*skipped: parameter shared with 'embed'", repr(pre))
    tokens = torch.randint(0, 11, (5, 3), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    tied = model.lm_head.weight.grad.clone()  # both uses' gradients, summed by autograd
    pre.step()
    assert torch.equal(model.lm_head.weight.grad, tied)  # not preconditioned as lm_head's own


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


@pytest.mark.parametrize("user_hook_first", [True, False])
def test_g_is_the_gradient_of_a_layers_own_output_whatever_a_users_hook_returns(
    user_hook_first: bool,
) -> None:
    """A user's forward hook replaces a layer's output by ``3·y + 1`` (registered before or
    after the preconditioner): ``G`` is still ``Σ dy dyᵀ / N`` of the layer's own output ``y``
    (dkfac's hook runs first), and ``A`` its input's. Oracle: the same float64 model without
    dkfac, ``y.retain_grad()`` through the same replacement (the replacement's own gradient
    is 3 times smaller: a hook that saw it would give ``G`` 9 times smaller)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(6, 4, dtype=torch.float64)

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return 3 * output + 1

    if user_hook_first:
        model[0].register_forward_hook(hook)
    pre = dkfac.KFACPreconditioner(model, factor_dtype=torch.float64, loss_reduction="sum")
    if not user_hook_first:
        model[0].register_forward_hook(hook)
    (model(x) ** 2).sum().backward()
    pre.step()
    y = x @ model[0].weight.detach().t() + model[0].bias.detach()
    y.requires_grad_(True)
    z = torch.tanh(3 * y + 1) @ model[2].weight.detach().t() + model[2].bias.detach()
    (z**2).sum().backward()
    assert y.grad is not None
    layer = pre.layers[0]
    torch.testing.assert_close(layer.factor("g"), y.grad.t() @ y.grad / 6, rtol=1e-12, atol=0)
    rows = torch.cat([x, torch.ones(6, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(layer.factor("a"), rows.t() @ rows / 6, rtol=1e-12, atol=0)


def test_eval_and_no_grad_forwards_are_not_captured() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model)
    x, _ = batch(0)
    with torch.no_grad():
        model(x)
    model.eval()
    y = model(x)
    assert all(not layer.has_statistics for layer in pre.layers)
    # A step after them says why nothing was updated (the gradient from the eval forward).
    y.sum().backward()
    with pytest.warns(RuntimeWarning, match=r"no factor statistics before this step: .*eval"):
        pre.step()
    assert all(layer.a is None and layer.g is None for layer in pre.layers)


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


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` applies ``out_proj`` through ``F.linear``, not its forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.head(y.mean(dim=1))


SUGGESTED = r"^attn\.out_proj$"


def attention_step(model: nn.Module, pre: dkfac.KFACPreconditioner, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    pre.step()


def test_layer_used_outside_its_forward_is_reported_once_and_passed_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = SelfAttention().double()
    kwargs = dict(kl_clip=1e-9, **F64)
    pre = dkfac.KFACPreconditioner(model, **kwargs)
    assert [layer.name for layer in pre.layers] == ["attn.out_proj", "head"]
    # References: out_proj skipped on purpose; and the same without KL clipping.
    skipped_model, unclipped_model = copy.deepcopy(model), copy.deepcopy(model)
    skipped = dkfac.KFACPreconditioner(skipped_model, skip_layers=[SUGGESTED], **kwargs)
    unclipped = dkfac.KFACPreconditioner(
        unclipped_model, skip_layers=[SUGGESTED], kl_clip=None, **F64
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    F.cross_entropy(model(x), y).backward()
    raw = {name: p.grad.clone() for name, p in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="dkfac"), pytest.warns(RuntimeWarning) as record:
        pre.step()
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert re.search(
        r"K-FAC layer 'attn\.out_proj' \(NonDynamicallyQuantizableLinear\) has a gradient but "
        r"captured no factor statistics: .*outside its forward",
        messages[0],
    )
    # What to do, with the skip_layers entry the references above use.
    assert "passes through unpreconditioned and unclipped; add it to skip_layers" in messages[0]
    assert f"skip_layers=[{SUGGESTED!r}]" in messages[0]
    assert [r.getMessage() for r in caplog.records if "attn.out_proj" in r.getMessage()] == messages
    # Its gradient is exactly the one backward produced; nothing else is touched.
    assert torch.equal(model.attn.out_proj.weight.grad, raw["attn.out_proj.weight"])
    assert torch.equal(model.attn.out_proj.bias.grad, raw["attn.out_proj.bias"])
    assert torch.equal(model.attn.in_proj_weight.grad, raw["attn.in_proj_weight"])
    # The other layer is preconditioned and clipped as if out_proj were in skip_layers: the
    # pass-through gradient does not enter ν.
    for reference in (skipped_model, unclipped_model):
        F.cross_entropy(reference(x), y).backward()
    skipped.step()
    unclipped.step()
    assert torch.equal(model.head.weight.grad, skipped_model.head.weight.grad)
    assert not torch.equal(model.head.weight.grad, raw["head.weight"])
    assert not torch.allclose(model.head.weight.grad, unclipped_model.head.weight.grad)
    assert set(pre.factors()) == {"head"}
    assert re.search(
        r"attn\.out_proj\s+NonDynamicallyQuantizableLinear\s+9x9\s+8x8\s+"
        r"passed through: used outside its forward",
        repr(pre),
    )
    assert re.search(r"head\s+Linear\s+9x9\s+3x3\s+preconditioned", repr(pre))
    # Reported once; later steps (factor updates or not) keep passing it through.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            attention_step(model, pre, seed)
            attention_step(skipped_model, skipped, seed)
            assert torch.equal(model.head.weight.grad, skipped_model.head.weight.grad)
            for name, p in model.attn.named_parameters():
                assert torch.equal(p.grad, dict(skipped_model.attn.named_parameters())[name].grad)


def test_layer_forwarded_in_eval_mode_is_not_reported_as_used_outside_its_forward() -> None:
    model = small_model()
    model[6].eval()  # its forward runs, but K-FAC does not capture eval-mode forwards
    pre = dkfac.KFACPreconditioner(model, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, pre, opt, 0)
    assert set(pre.factors()) == {"0", "4"}
    assert re.search(r"6\s+Linear\s+7x7\s+3x3\s+preconditioned", repr(pre))


# -- state -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", INVERSE_METHODS)
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


def test_load_state_dict_rejects_decompositions_of_another_method_or_shape() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, inverse_method="inverse", **F64)
    train_step(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    saved = pre.state_dict()
    eigen = dkfac.KFACPreconditioner(small_model(), inverse_method="eigen", **F64)
    with pytest.raises(ValueError, match="inverse_method='inverse', this preconditioner's is"):
        eigen.load_state_dict(saved)
    assert eigen.steps == 0 and all(layer.inverse is None for layer in eigen.layers)
    first = pre.layers[0].name
    tensors = saved["layers"][first]["inverse"]["tensors"]
    tensors["a_inv"] = tensors["a_inv"][:-1, :-1]
    with pytest.raises(ValueError, match=f"decomposition of layer '{first}' has tensors"):
        dkfac.KFACPreconditioner(small_model(), inverse_method="inverse", **F64).load_state_dict(
            saved
        )


# -- numerical trouble ---------------------------------------------------------------------------
def test_nan_batch_is_dropped_counted_and_reported_while_it_persists() -> None:
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
    # Both factors of each layer were dropped: counted per factor.
    assert {name: h.nonfinite_batches for name, h in pre.health().layers.items()} == {
        "0": 2,
        "4": 2,
        "6": 2,
    }
    # The same trouble again is reported again while it persists (at counts 1, 2, 4, 8, ...)
    # with its count; training goes on.
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        p.grad = torch.nan_to_num(p.grad)
    with pytest.warns(RuntimeWarning) as record:
        pre.step()
    messages = sorted(str(w.message) for w in record)
    for name, message in zip(["0", "4", "6"], messages, strict=True):
        assert re.search(rf"layer '{name}'.*NaN/Inf.*\(4 times so far\)", message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean step says nothing
        train_step(model, pre, opt, 2)
    assert pre.health().layers["0"].nonfinite_batches == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("interval", [3, 6])
@pytest.mark.parametrize("stacked", [False, True])
def test_batches_dropped_between_decompositions_are_all_counted(
    stacked: bool, interval: int
) -> None:
    """Factors folded every step, decomposed every third (or sixth): two NaN batches between
    two decompositions are counted twice per factor when the next decomposition reads them
    (each fold's flags tensor read once, for every factor folded in it), and a clean window
    adds nothing."""
    model = small_model()
    pre = dkfac.KFACPreconditioner(
        model, inv_update_steps=interval, batched_factor_updates=stacked, **F64
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(7):
        x, y = batch(step)
        if step in (1, 2):
            x[0, 0, 0, 0] = float("nan")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = torch.nan_to_num(p.grad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reported: tested above
            pre.step()
        if step == 2:  # read at the decompositions only (steps 0 and 6, and 3)
            assert all(h.nonfinite_batches == 0 for h in pre.health().layers.values())
    counts = {name: h.nonfinite_batches for name, h in pre.health().layers.items()}
    assert counts == {"0": 4, "4": 4, "6": 4}


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


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_one_factor_retried_in_float64_gives_a_float64_layer_inverse(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only A of the first layer fails in float32: the layer preconditions in float64."""
    model = small_model(torch.float32)
    reference = copy.deepcopy(model)
    pre = dkfac.KFACPreconditioner(model, inverse_method=method, kl_clip=None)
    exact = dkfac.KFACPreconditioner(
        reference, inverse_method=method, kl_clip=None, inv_dtype=torch.float64
    )
    first = 0  # A's size of the first layer, read from the reference below
    real_eigh, real_cholesky = torch.linalg.eigh, torch.linalg.cholesky_ex

    def fails_for_a_of_layer_0(matrix: torch.Tensor) -> bool:
        return matrix.dtype == torch.float32 and matrix.shape[0] == first

    def flaky_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fails_for_a_of_layer_0(matrix):
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(matrix)

    def flaky_cholesky(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor, info = real_cholesky(matrix)
        return factor, info + int(fails_for_a_of_layer_0(matrix))

    x, y = batch(0, dtype=torch.float32)
    F.cross_entropy(reference(x), y).backward()
    exact.step()
    F.cross_entropy(model(x), y).backward()
    first = next(iter(exact.factors().values()))[0].shape[0]
    monkeypatch.setattr(torch.linalg, "eigh", flaky_eigh)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", flaky_cholesky)
    with pytest.warns(RuntimeWarning, match="recomputed in float64"):
        pre.step()
    inverse = pre.layers[0].inverse
    assert inverse is not None
    assert {t.dtype for t in inverse.tensors().values()} == {torch.float64}
    assert {t.dtype for t in pre.layers[1].inverse.tensors().values()} == {torch.float32}
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.grad.dtype == torch.float32
        error = (mine.grad - theirs.grad).norm() / theirs.grad.norm()  # float32 round-off
        assert error < 1e-3, float(error)


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


def test_persistent_decomposition_failures_are_counted_and_reported_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step(model, pre, opt, 0)

    def broken(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    reported = []
    for step in range(1, 5):  # two failed factors per layer and step: counts 2, 4, 6, 8
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(model, pre, opt, step)
        reported.append([str(w.message) for w in caught if "layer '0'" in str(w.message)])
    assert [len(messages) for messages in reported] == [1, 1, 0, 1]
    assert reported[0][0].endswith("(2 times so far)") and "also in float64" in reported[0][0]
    assert reported[3][0].endswith("(8 times so far)")
    health = pre.health()
    assert health.skipped_steps == 0
    assert all(h.failed_decompositions == 8 for h in health.layers.values())
    assert all(h.retried_in_float64 == 0 for h in health.layers.values())


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("CUDA error: an illegal access")],
)
def test_errors_other_than_a_failed_decomposition_propagate(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **F64)

    def failing(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise error

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(type(error), match=str(error)):
        pre.step()


def test_cholesky_failure_is_detected_without_exceptions() -> None:
    a = torch.eye(3, dtype=torch.float64)
    g = -torch.eye(2, dtype=torch.float64) * 10  # damped G stays indefinite
    _, ok = dkfac.curvature.decompose(a, g, 0.01, "inverse", torch.float64)
    assert not bool(ok)


# -- host synchronisation -------------------------------------------------------------------------
def test_factor_steps_of_conv_layers_read_nothing_back_from_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hooks and step() make no per-layer host reads; a decomposition step makes one."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),  # stride 1: the shifted patch Gram, border groups
        nn.ReLU(),
        nn.Conv2d(4, 4, (3, 2), padding="same", dilation=2, bias=False),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, stride=2),  # im2col path
        nn.Flatten(),
        nn.Linear(3 * 2 * 2, 3),
    )
    # Shifted patch Grams asked for: a CPU forms these 5x5 outputs' by im2col by default.
    pre = dkfac.KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=3, conv_patches="shifted"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    spy = HostReadSpy(monkeypatch)

    def step(seed: int) -> list[tuple[str, str]]:
        x, y = batch(seed, dtype=torch.float32)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        return spy.take()

    # Step 0 plans each stride-1 layer's patch Gram once (on the CPU), which the spy sees:
    # it does see host reads made inside the hooks.
    first = step(0)
    assert any(module == "dkfac.curvature.shifted_gram_plan" for _, module in first), first
    # Factor-update steps without decompositions: the hooks and step() read nothing back
    # (KL clipping's ν stays on the device).
    assert step(1) == []
    assert step(2) == []
    # A decomposition step of four layers: one batched read of every flag together.
    assert step(3) == [("tolist", "dkfac.curvature.decomposition")]
    assert len(pre.layers) == 4


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
    from dkfac.cli.demo import TARGET_ACCURACY, first_epoch_reaching, train_digits

    assert TARGET_ACCURACY == 0.95
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sgd = train_digits(use_kfac=False, epochs=6, lr=0.05, batch_size=64, seed=0)
    sgd_epoch = first_epoch_reaching(sgd, 0.95)
    assert sgd_epoch is not None, f"SGD never reached 95% in 6 epochs: {sgd}"
    assert sgd_epoch > 1, f"SGD reached 95% after one epoch, leaving K-FAC no room: {sgd}"
    # K-FAC only needs to run the epochs that would make it strictly earlier than SGD.
    kfac = train_digits(use_kfac=True, epochs=sgd_epoch - 1, lr=0.05, batch_size=64, seed=0)
    kfac_epoch = first_epoch_reaching(kfac, 0.95)
    assert kfac_epoch is not None, f"K-FAC not at 95% by epoch {sgd_epoch - 1}: {kfac} vs {sgd}"
    assert kfac_epoch < sgd_epoch, (sgd, kfac)
    assert all(math.isfinite(accuracy) for accuracy in kfac)


def test_shorthands_become_the_strategys_options_and_unset_ones_keep_its_defaults() -> None:
    from dkfac.config import KFACConfig
    from dkfac.strategies import KAISAOptions, LocalOptions, PADOptions, SPDOptions

    assert KFACConfig(strategy="kaisa").options == KAISAOptions(grad_worker_fraction=1.0)
    assert KFACConfig(strategy="kaisa", grad_worker_fraction=0.5).options == KAISAOptions(0.5)
    assert KFACConfig(strategy="pad", profile_steps=0).options == PADOptions(profile_steps=0)
    assert KFACConfig(strategy="pad").options == PADOptions(share="auto")
    assert KFACConfig(strategy="pad", share="gradients").options == PADOptions(share="gradients")
    # share="auto" is PAD's default: said next to another strategy, it says nothing.
    assert KFACConfig(strategy="spd", share="auto").options == SPDOptions()
    assert KFACConfig(strategy="spd").options == SPDOptions(profile_steps=5, cost_model=None)
    # Equal to the default of an option the strategy does not have: says nothing, accepted.
    assert KFACConfig(strategy="local", grad_worker_fraction=1.0).options == LocalOptions()
    given = KAISAOptions(0.25)
    assert KFACConfig(strategy=given).options is given


def test_the_constructors_keywords_are_the_config_fields_with_their_defaults() -> None:
    # The constructor builds its KFACConfig from its own locals() named like a field: a field
    # missing from the signature could not be set, and a keyword added to the signature
    # without a field would be dropped silently.
    import dataclasses
    import inspect

    from dkfac.config import CONFIG_FIELDS, KFACConfig

    signature = inspect.signature(dkfac.KFACPreconditioner.__init__).parameters
    not_fields = {"self", "model", "optimizer", "grad_scaler", "blocks"}
    assert set(signature) == CONFIG_FIELDS | not_fields
    for field in dataclasses.fields(KFACConfig):
        if field.init and field.name != "lr":  # lr: None means the optimizer's, else 0.1
            assert signature[field.name].default == field.default, field.name
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, damping=0.0123, batched_statistics=True, **F64)
    assert (pre.config.damping, pre.config.batched_statistics) == (0.0123, True)
    assert pre.config.lr == 0.1
    pre.remove()


def test_deep_copying_what_holds_the_preconditioner_keeps_one_preconditioner() -> None:
    model = small_model()
    pre = dkfac.KFACPreconditioner(model, **F64)
    snapshot = copy.deepcopy({"model": model, "pre": pre})
    assert snapshot["pre"] is pre
    snapshot["pre"].remove()  # the same object: removing it removes the original's hooks
    with pytest.raises(RuntimeError, match=r"step\(\) after remove\(\)"):
        pre.step()


def test_each_phase_is_a_range_in_torch_profiler() -> None:
    model = small_model(torch.float32)
    pre = dkfac.KFACPreconditioner(model)
    x, y = batch(0, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        F.cross_entropy(model(x), y).backward()
        pre.step()
    names = {event.name for event in profiler.events()}
    for phase in ("factor_compute", "inverse_compute", "precondition"):
        assert f"dkfac/{phase}" in names, sorted(n for n in names if n.startswith("dkfac"))


def _fsdp2_refused(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with pytest.raises(ValueError) as error:
        dkfac.KFACPreconditioner(model)
    return str(error.value)


def test_an_fsdp2_model_is_refused_with_what_is_supported() -> None:
    from distributed_harness import run_workers

    (message,) = run_workers(_fsdp2_refused, world_size=1, timeout=60)
    assert "is sharded (FSDP)" in message and "DistributedDataParallel" in message


def test_a_layer_with_a_factor_above_max_factor_dim_is_skipped_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(
        nn.Linear(6, 9000), nn.Tanh(), nn.Linear(9000, 3), nn.Tanh(), nn.Linear(3, 2)
    )
    with caplog.at_level(logging.WARNING, logger="dkfac.layer_discovery"):
        pre = dkfac.KFACPreconditioner(model)  # default 8192: both wide layers skipped
    assert [layer.name for layer in pre.layers] == ["4"]
    assert sum("K-FAC skips layer" in r.getMessage() for r in caplog.records) == 2  # said
    text = repr(pre)
    assert "factor side 9000 > max_factor_dim=8192" in text and "0.3 GiB" in text
    assert [
        layer.name for layer in dkfac.KFACPreconditioner(model, max_factor_dim=None).layers
    ] == ["0", "2", "4"]
    pair = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # sides 5 (4 + bias) and 6
    assert [la.name for la in dkfac.KFACPreconditioner(pair, max_factor_dim=5).layers] == ["0"]
    assert [la.name for la in dkfac.KFACPreconditioner(pair, max_factor_dim=6).layers] == ["0", "1"]
    with pytest.raises(ValueError, match="max_factor_dim"):
        dkfac.KFACPreconditioner(model, max_factor_dim=0)


class SharedConvInPlace(nn.Module):
    """One convolution applied twice per pass, each output rectified in place: a layer called
    more than once (TorchDynamo 2.11 failed on a hook's buffer used twice in one graph) and an
    in-place operation on a captured layer's output (forbidden on a custom function's view)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.shared = nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.stem(x))
        h = self.relu(self.shared(h))
        return self.head(self.relu(self.shared(h)).flatten(1))


def compiled_and_eager_steps(
    conv: bool,
    compile_model: Callable[[nn.Module], nn.Module],
    steps: int = 3,
    build: Callable[[], nn.Module] | None = None,
    **options: Any,
) -> tuple[list[dkfac.KFACPreconditioner], nn.Module, nn.Module]:
    """``steps`` K-FAC steps of a compiled model and of its eager copy, side by side.

    Returns the two preconditioners (compiled first), the compiled model's parameters' module
    and the eager model. Each step runs ``accumulation_steps`` micro-batches. ``build``: the
    model, instead of :func:`small_model` (``conv``) or three Linear layers; in float64 with
    ``conv`` (compared to round-off), float32 otherwise (bit for bit). With ``conv`` the
    patch Grams come from shifted products (``conv_patches="shifted"``: a CPU forms these
    5x5 outputs' by im2col by default), whose index plan the compiled hooks must get from
    outside the graph.
    """
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    dtype = torch.float64 if conv else torch.float32
    if build is not None:
        eager = build().to(dtype)
    elif conv:
        eager = small_model(dtype)
    else:
        eager = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(eager)
    compiled = compile_model(model)
    shifted = {"conv_patches": "shifted"} if conv else {}
    options = {"factor_dtype": dtype, "inv_dtype": dtype, **shifted, **options}
    pres = [dkfac.KFACPreconditioner(net, **options) for net in (compiled, eager)]
    passes = options.get("accumulation_steps", 1)
    for step in range(steps):
        for net, pre in zip((compiled, eager), pres, strict=True):
            net.zero_grad()
            for micro in range(passes):
                x, y = batch(10 * step + micro, dtype=dtype)
                (F.cross_entropy(net(x), y) / passes).backward()
            pre.step()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
    for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        if conv:
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
        else:
            assert torch.equal(mine, theirs)
    return pres, model, eager


def aot_eager(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="aot_eager")  # type: ignore[return-value]


@pytest.mark.parametrize("conv", [False, True])
def test_a_compiled_model_has_eager_names_and_steps_as_eager_in_one_graph(conv: bool) -> None:
    """Compiled (aot_eager: no C++ toolchain) against eager. Linear layers: bit for bit.
    Convolutions: the first compiled window builds the patch Gram by im2col (making the
    stride-1 index plan needs data-dependent shapes), the later ones with the plan made at the
    first hand-over; equal to round-off, so that case runs in float64
    throughout (float32 factors' round-off, amplified by the damped inverse, reaches 1e-4).
    dkfac's hooks compile into the model's graph: no graph break, no frame run eagerly, and
    the graph of the first step serves every later one (no recompilation)."""
    pres, _, _ = compiled_and_eager_steps(conv, aot_eager)
    assert [layer.name for layer in pres[0].layers] == [layer.name for layer in pres[1].layers]
    assert dynamo_trouble() == {}
    # Convolutions: the first window traces the im2col product, the later ones the stride-1
    # index plan made outside the graph when the first window was handed over.
    assert counters["stats"]["unique_graphs"] == (2 if conv else 1)
    convs = [layer.block for layer in pres[0].layers if layer.block.kind == "Conv2d"]
    assert all(len(block.gram_plans) == 1 for block in convs)  # type: ignore[attr-defined]
    pres[1].load_state_dict(pres[0].state_dict())  # interchangeable with the eager model's


# The two ways compiled hooks watch an output's gradient, each tested on any torch: a hook
# on it (torch >= 2.13) and an identity function put in its place (before 2.13, where
# TorchDynamo fails on the hook of a layer called twice per pass).
@pytest.fixture
def output_function(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    chosen: bool = request.param
    if not chosen and not deferred_statistics.TENSOR_HOOKS_SHARE_BUFFERS:
        pytest.skip(f"torch {torch.__version__} < 2.13 compiles output hooks badly; unused there")
    monkeypatch.setattr(deferred_statistics, "TENSOR_HOOKS_SHARE_BUFFERS", not chosen)
    return chosen


@pytest.mark.parametrize("output_function", [False, True], indirect=True)
def test_a_compiled_shared_layer_with_in_place_outputs_steps_as_eager_in_one_graph(
    output_function: bool,
) -> None:
    """The compiled hooks of a layer called twice per pass, its outputs modified in place:
    the same parameters as the eager model (float64, to round-off as for any convolution),
    no graph break, no frame run eagerly."""
    compiled_and_eager_steps(True, aot_eager, build=SharedConvInPlace)
    assert dynamo_trouble() == {}


@pytest.mark.parametrize("output_function", [False, True], indirect=True)
def test_a_compiled_layers_output_kept_by_a_users_hook_feeds_g_as_eager(
    output_function: bool,
) -> None:
    """A forward hook keeps the first layer's output for a penalty term: its gradient is part
    of that layer's ``G`` in eager mode (the output's hook sees every use), and compiled too:
    with a hook on the output (registered before the preconditioner here), or with the
    identity function in the output's place if the user's hook is registered after dkfac's
    (it then keeps the replacement). Linear layers: bit for bit."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(eager)
    kept: dict[str, list[torch.Tensor]] = {"compiled": [], "eager": []}

    def keep_outputs() -> None:
        for net, key in ((model, "compiled"), (eager, "eager")):
            net[1].register_forward_hook(
                lambda module, inputs, output, key=key: kept[key].append(output)
            )

    if not output_function:
        keep_outputs()
    compiled = aot_eager(model)
    pres = [dkfac.KFACPreconditioner(net) for net in (compiled, eager)]
    if output_function:
        keep_outputs()
    for step in range(3):
        for net, key, pre in zip((compiled, eager), ("compiled", "eager"), pres, strict=True):
            net.zero_grad()
            x, y = batch(step, dtype=torch.float32)
            loss = F.cross_entropy(net(x), y) + kept[key].pop().square().mean()
            loss.backward()
            pre.step()
    assert dynamo_trouble() == {}
    for mine, theirs in zip(pres[0].layers, pres[1].layers, strict=True):
        for side in ("a", "g"):
            assert torch.equal(mine.factor(side), theirs.factor(side)), (mine.name, side)
    for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("output_function", [False, True], indirect=True)
def test_forward_hooks_before_a_compiled_preconditioner_are_named_where_they_miss_g(
    output_function: bool,
) -> None:
    """Before torch 2.13 an output kept by a forward hook registered before dkfac's is not
    the tensor whose gradient feeds ``G``: the preconditioner names those layers, pointing
    at the caller. Nothing is said with a hook on the output (torch >= 2.13: dkfac's hook
    runs first), nor for hooks registered afterwards or another preconditioner's."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model[2].register_forward_hook(lambda module, inputs, output: None)
    compiled = aot_eager(model)
    if output_function:
        with pytest.warns(RuntimeWarning, match=r"layers \['2'\] have forward hooks") as caught:
            first = dkfac.KFACPreconditioner(compiled)
        assert [w.filename for w in caught] == [__file__]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = dkfac.KFACPreconditioner(compiled)
    first.remove()
    quiet = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = dkfac.KFACPreconditioner(aot_eager(quiet))
        quiet[0].register_forward_hook(lambda module, inputs, output: None)
        dkfac.KFACPreconditioner(aot_eager(quiet), skip_layers=("0",))  # only '2': dkfac's
    pre.remove()


class CheckpointedMiddle(nn.Module):
    """Three Linear layers, the middle one under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(2 * 5 * 5, 8)
        self.middle = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.middle(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.flatten(1)))
        h = torch.utils.checkpoint.checkpoint(self.segment, h, use_reentrant=False)
        return self.head(h)  # type: ignore[arg-type]


def test_a_compiled_model_with_a_checkpointed_segment_steps_as_eager() -> None:
    """Activation checkpointing inside a compiled model: TorchDynamo does not put the hooks'
    side effects inside its checkpoint operator and breaks the graph there (the segment's
    hooks then run eagerly); the factors and parameters are the eager model's, bit for bit."""
    pres, _, _ = compiled_and_eager_steps(False, aot_eager, build=CheckpointedMiddle)
    for mine, theirs in zip(pres[0].layers, pres[1].layers, strict=True):
        for side in ("a", "g"):
            assert torch.equal(mine.factor(side), theirs.factor(side)), (mine.name, side)


@pytest.mark.slow
def test_inductor_compiles_the_hooks_into_the_graph_and_steps_as_eager() -> None:
    """The default backend (Inductor: generated C++ on CPU, about 10 s to compile here)."""
    compiled_and_eager_steps(
        True,
        lambda model: torch.compile(model),
        accumulation_steps=2,  # type: ignore[arg-type, return-value]
    )
    assert dynamo_trouble() == {}
    assert counters["stats"]["unique_graphs"] == 4  # two passes, without and with the plan


def test_compiled_intervals_and_accumulation_equal_eager_with_one_graph_per_kind_of_pass() -> None:
    """Factors every 2 steps, 2 micro-batches each: a capturing window's first and second
    pass (each traced again once the convolution's index plan exists) and a pass between
    windows are the graphs; none is traced again after the second window."""
    options = {"factor_update_steps": 2, "inv_update_steps": 4, "accumulation_steps": 2}
    compiled_and_eager_steps(True, aot_eager, steps=6, **options)
    assert dynamo_trouble() == {}
    assert counters["stats"]["unique_graphs"] == 5


class DetachedSecondUse(nn.Module):
    """``shared`` runs twice per pass; no gradient comes back through its second use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(50, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        return self.shared(flat) + 0.0 * self.shared(2 * flat).detach()


def test_compiled_grad_scaler_restored_state_and_removal_step_as_eager() -> None:
    """A GradScaler's scale divided out of compiled G; a state loaded in the middle of a
    compiled window drops that window's statistics, as eager does; after remove() the
    compiled model trains with its plain gradients and dkfac keeps nothing."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(eager)
    compiled = aot_eager(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    pres = [
        dkfac.KFACPreconditioner(net, grad_scaler=scaler)
        for net, scaler in zip((compiled, eager), scalers, strict=True)
    ]
    saved = [copy.deepcopy(pre.state_dict()) for pre in pres]
    for step in range(3):
        x, y = batch(step, dtype=torch.float32)
        for net, pre, scaler, state in zip((compiled, eager), pres, scalers, saved, strict=True):
            net.zero_grad()
            scaler.scale(F.cross_entropy(net(x), y)).backward()
            if step == 1:  # a restored state: this window's statistics are not the state's
                pre.load_state_dict(state)
                net.zero_grad()
                scaler.scale(F.cross_entropy(net(x), y)).backward()
            for p in net.parameters():
                p.grad /= scaler.get_scale()
            pre.step()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
    for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    for pre in pres:
        pre.remove()
    x, y = batch(9, dtype=torch.float32)
    for net in (compiled, eager):
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
    for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)
    assert pres[0]._capture._deferred._calls == [] and not pres[0]._capture._deferred._sums
    assert dynamo_trouble() == {}


def test_compiled_hooks_refuse_a_window_whose_gradient_missed_some_calls_then_recover() -> None:
    """Eager K-FAC takes the one call with a gradient; a compiled graph cannot tell which
    call it was, so the step is refused, and the next window starts clean."""
    torch._dynamo.reset()
    model = DetachedSecondUse()
    compiled = aot_eager(model)
    pre = dkfac.KFACPreconditioner(compiled)
    x, y = batch(0, dtype=torch.float32)
    F.cross_entropy(compiled(x), y).backward()
    with pytest.raises(RuntimeError, match=r"output gradient came for 1 of its 2 calls"):
        pre.step()
    assert not any(buffer.any() for buffer in pre._capture._deferred._sums.values())
    assert pre._capture._deferred._calls == []


def test_a_model_compiled_in_place_is_seen_and_one_compiled_later_still_steps_as_eager() -> None:
    def in_place(model: nn.Module) -> nn.Module:
        model.compile(backend="aot_eager")
        return model

    compiled_and_eager_steps(False, in_place)
    assert dynamo_trouble() == {}

    # Built for the eager model, then compiled: the compiled hooks cannot find their buffers,
    # TorchDynamo runs the hooks' frames eagerly, and the steps are still the eager ones.
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 3))
    eager = copy.deepcopy(model)
    pres = [dkfac.KFACPreconditioner(net) for net in (model, eager)]
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        x, y = batch(step, dtype=torch.float32)
        for net, pre in zip((compiled, eager), pres, strict=True):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            pre.step()
        for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
    assert "Observed exception" in str(dynamo_trouble().get("unimplemented"))
