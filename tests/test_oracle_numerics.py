"""Independent float64 oracle tests of the K-FAC numerics of ``dkfac.KFACPreconditioner``.

Every expected value here is computed from dense formulas written in this file:

* input patches of Conv2d are extracted with explicit Python loops over output positions on a
  zero-padded copy of the input (no ``F.unfold``, no dkfac helper); the extraction itself is
  sanity-checked by rebuilding the convolution output from the patches;
* per-example output gradients ``g̃_n = dl_n/dy_n`` come from ``torch.func.vmap(torch.func.grad)``
  over the per-example loss ``l_n`` of the part of the network after the layer, computed on an
  independent deep copy of the model (so the preconditioner's hooks never see these passes).
  For a mean-reduced loss ``L = (1/N) Σ l_n`` this is ``N·dL/dy_n``; for a summed loss it is
  ``dL/dy_n``;
* preconditioned gradients come from ``torch.linalg.solve`` on ``torch.kron(A, G) + gammaI``
  (eigen) or on the π-damped factors (inverse);
* running averages, update intervals and KL clipping are recomputed by hand.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature import kl_clip
from dkfac.curvature.factor_decomposition import INVERSE_METHODS

DT = torch.float64
RTOL = 1e-10


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, what: str = ""
) -> None:
    """Relative (to the size of ``expected``) float64 comparison."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == DT, (what, actual.dtype)
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * max(scale, 1e-300), (
        f"{what}: max abs error {err:.3e} vs scale {scale:.3e} (rel {err / max(scale, 1e-300):.3e})"
    )


def assert_factors(
    pre: dkfac.KFACPreconditioner, expected: dict[str, Any], label: str = ""
) -> None:
    """``pre``'s factors are the oracle's ``{layer name: (A, G)}``, every one of them."""
    held = pre.factors()
    assert set(held) == set(expected)
    for name, (a, g) in expected.items():
        assert_close(held[name][0], a, what=f"{label}A of {name}")
        assert_close(held[name][1], g, what=f"{label}G of {name}")


def vec(m: torch.Tensor) -> torch.Tensor:
    """Column-major vec."""
    return m.t().reshape(-1)


def unvec(v: torch.Tensor, d_g: int, d_a: int) -> torch.Tensor:
    return v.reshape(d_a, d_g).t()


def grad_matrix(layer: nn.Module) -> torch.Tensor:
    """(d_G, d_A) gradient matrix, bias gradient as last column."""
    w = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    if layer.bias is None:
        return w.clone()
    return torch.cat([w, layer.bias.grad.reshape(-1, 1)], dim=1).clone()


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def conv_patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Explicit patch extraction: (N, Ho, Wo, c_in*kh*kw) in (c_in, i, j) order."""
    n, c, h, w = x.shape
    kh, kw = conv.kernel_size
    sh, sw = _pair(conv.stride)
    dh, dw = _pair(conv.dilation)
    if conv.padding == "same":
        tot_h, tot_w = dh * (kh - 1), dw * (kw - 1)
        ph = (tot_h // 2, tot_h - tot_h // 2)
        pw = (tot_w // 2, tot_w - tot_w // 2)
    elif conv.padding == "valid":
        ph, pw = (0, 0), (0, 0)
    else:
        p_h, p_w = _pair(conv.padding)
        ph, pw = (p_h, p_h), (p_w, p_w)
    mode = conv.padding_mode

    def src(q: int, lo: int, size: int) -> int | None:
        """Index into the unpadded input of padded coordinate ``q`` (None: a zero)."""
        i = q - lo
        if 0 <= i < size:
            return i
        if mode == "zeros":
            return None
        if mode == "circular":
            return i % size
        if mode == "replicate":
            return min(max(i, 0), size - 1)
        assert mode == "reflect"
        return -i if i < 0 else 2 * (size - 1) - i

    hp, wp = h + ph[0] + ph[1], w + pw[0] + pw[1]
    xp = torch.zeros(n, c, hp, wp, dtype=x.dtype)
    for qh in range(hp):
        for qw in range(wp):
            ih, iw = src(qh, ph[0], h), src(qw, pw[0], w)
            if ih is not None and iw is not None:
                xp[:, :, qh, qw] = x[:, :, ih, iw]
    ho = (h + ph[0] + ph[1] - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pw[0] + pw[1] - dw * (kw - 1) - 1) // sw + 1
    out = torch.empty(n, ho, wo, c * kh * kw, dtype=x.dtype)
    for b in range(n):
        for oh in range(ho):
            for ow in range(wo):
                patch = torch.empty(c, kh, kw, dtype=x.dtype)
                for ci in range(c):
                    for i in range(kh):
                        for j in range(kw):
                            patch[ci, i, j] = xp[b, ci, oh * sh + i * dh, ow * sw + j * dw]
                out[b, oh, ow] = patch.reshape(-1)
    return out


def per_example_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """l for one example; ``out``/``t`` carry a leading batch dim of size 1."""
    if t.dtype == torch.long:
        return F.cross_entropy(out, t, reduction="sum")
    return 0.5 * ((out - t) ** 2).sum() + 0.1 * (out**3).sum()


def batch_loss(out: torch.Tensor, t: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """L = (1/N) Σ l_n (mean) or Σ l_n (sum), written through per_example_loss's formula."""
    n = out.shape[0]
    total = sum(per_example_loss(out[i : i + 1], t[i : i + 1]) for i in range(n))
    return total / n if reduction == "mean" else total


def oracle_layer_factors(
    model: nn.Sequential, index: int, x: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of ``model[index]`` from explicit patches and torch.func per-example grads."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        xi = model[:index](x)
        layer = model[index]
        y = layer(xi)
    head = model[index + 1 :]

    def ell(yn, tn):
        return per_example_loss(head(yn.unsqueeze(0)), tn.unsqueeze(0))

    g = vmap(grad(ell))(y, t)  # per-example output gradients, same shape as y
    n = x.shape[0]
    if isinstance(layer, nn.Conv2d):
        p = conv_patches(xi, layer)  # (N, Ho, Wo, K)
        # sanity check of the patch extraction: rebuild the conv output from it
        w = layer.weight.reshape(layer.weight.shape[0], -1)
        rebuilt = torch.einsum("nhwk,ok->nohw", p, w)
        if layer.bias is not None:
            rebuilt = rebuilt + layer.bias.reshape(1, -1, 1, 1)
        assert_close(rebuilt, y, what="patch extraction rebuilds conv output")
        a_rows = p.reshape(-1, p.shape[-1])
        g_rows = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    else:
        a_rows = xi.reshape(-1, xi.shape[-1])
        g_rows = g.reshape(-1, g.shape[-1])
    if layer.bias is not None:
        a_rows = torch.cat([a_rows, torch.ones(a_rows.shape[0], 1, dtype=DT)], dim=1)
    a = sum(torch.outer(r, r) for r in a_rows) / a_rows.shape[0]
    gg = sum(torch.outer(r, r) for r in g_rows) / n
    return a, gg


def kfac_layers(model: nn.Sequential) -> list[int]:
    return [i for i, m in enumerate(model) if isinstance(m, (nn.Linear, nn.Conv2d))]


def make_pre(model: nn.Module, **kw) -> dkfac.KFACPreconditioner:
    kw.setdefault("kl_clip", None)
    # The shifted products, which these tests' small images would not take by default on a
    # CPU (im2col up to 7x7 outputs): the path with the most index work gets the oracles.
    kw.setdefault("conv_patches", "shifted")
    return dkfac.KFACPreconditioner(model, factor_dtype=DT, inv_dtype=DT, **kw)


def eigen_direction(a, g, grad_m, damping):
    d_g, d_a = grad_m.shape
    m = torch.kron(a, g) + damping * torch.eye(d_a * d_g, dtype=DT)
    return unvec(torch.linalg.solve(m, vec(grad_m)), d_g, d_a)


def inverse_direction(a, g, grad_m, damping):
    d_g, d_a = grad_m.shape
    pi = math.sqrt((torch.trace(a).item() / d_a) / (torch.trace(g).item() / d_g))
    g_d = g + (math.sqrt(damping) / pi) * torch.eye(d_g, dtype=DT)
    a_d = a + (math.sqrt(damping) * pi) * torch.eye(d_a, dtype=DT)
    left = torch.linalg.solve(g_d, grad_m)  # G_d^{-1} ∇
    return torch.linalg.solve(a_d, left.t()).t()  # (G_d^{-1} ∇) A_d^{-1}  (A_d symmetric)


def sgd_(model: nn.Module, lr: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def small_conv_model(bias: bool = True) -> nn.Sequential:
    # Conv2d(2,3,3): d_A = 19 (bias), d_G = 3 -> kron 57; Linear(27,4): 28*4 = 112
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, bias=bias), nn.Tanh(), nn.Flatten(), nn.Linear(27, 4)
    ).to(DT)


def conv_batch(n: int, gen: torch.Generator):
    x = torch.randn(n, 2, 5, 5, dtype=DT, generator=gen)
    t = torch.randint(0, 4, (n,), generator=gen)
    return x, t


# ---------------------------------------------------------------------------------------------
# 1. single example through a Linear layer: A ⊗ G == vec∇ vec∇ᵀ
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_single_example_linear_kron_equals_grad_outer(bias: bool, reduction: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3, bias=bias)).to(DT)
    pre = make_pre(model, loss_reduction=reduction)
    x = torch.randn(1, 5, dtype=DT)
    t = torch.randn(1, 3, dtype=DT)
    batch_loss(model(x), t, reduction).backward()
    gm = grad_matrix(model[0])
    v = vec(gm)
    pre.step()
    a, g = pre.factors()["0"]
    assert a.shape == (5 + bias, 5 + bias) and g.shape == (3, 3)
    assert_close(torch.kron(a, g), torch.outer(v, v), what="kron(A,G) vs vec∇vec∇ᵀ")


@pytest.mark.parametrize("bias", [True, False])
def test_single_example_linear_matches_torch_func_per_example_fisher(bias: bool) -> None:
    """A⊗G equals the outer product of the per-example gradient from torch.func."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3, bias=bias)).to(DT)
    ref = copy.deepcopy(model)
    pre = make_pre(model)
    x = torch.randn(1, 4, dtype=DT)
    t = torch.randint(0, 3, (1,))
    batch_loss(model(x), t).backward()
    pre.step()

    params = dict(ref.named_parameters())

    def ell(p, xn, tn):
        out = torch.func.functional_call(ref, p, (xn.unsqueeze(0),))
        return per_example_loss(out, tn.unsqueeze(0))

    per_ex = vmap(grad(ell), in_dims=(None, 0, 0))(params, x, t)
    facs = pre.factors()
    for idx in (0, 2):
        w = per_ex[f"{idx}.weight"][0]
        m = w.reshape(w.shape[0], -1)
        if f"{idx}.bias" in per_ex:
            m = torch.cat([m, per_ex[f"{idx}.bias"][0].reshape(-1, 1)], dim=1)
        a, g = facs[str(idx)]
        assert_close(torch.kron(a, g), torch.outer(vec(m), vec(m)), what=f"layer {idx}")


# ---------------------------------------------------------------------------------------------
# 2. batch factors against the explicit formulas
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_linear_2d_batch_factors(bias: bool) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 4)).to(DT)
    x = torch.randn(6, 5, dtype=DT)
    t = torch.randint(0, 4, (6,))
    expected = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    pre = make_pre(model, factor_decay=0.5)
    batch_loss(model(x), t).backward()
    pre.step()
    assert_factors(pre, expected)


def test_linear_2d_g_equals_per_example_bias_gradients() -> None:
    """For 2-D input, g̃_n is the per-example bias gradient (torch.func): G = (1/N)Σ g̃ g̃ᵀ."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).to(DT)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 5, dtype=DT)
    t = torch.randint(0, 4, (5,))
    pre = make_pre(model)
    batch_loss(model(x), t).backward()
    pre.step()
    params = dict(ref.named_parameters())

    def ell(p, xn, tn):
        out = torch.func.functional_call(ref, p, (xn.unsqueeze(0),))
        return per_example_loss(out, tn.unsqueeze(0))

    per_ex = vmap(grad(ell), in_dims=(None, 0, 0))(params, x, t)
    for idx in (0, 2):
        gb = per_ex[f"{idx}.bias"]  # (N, out)
        g_exp = gb.t() @ gb / x.shape[0]
        assert_close(pre.factors()[str(idx)][1], g_exp, what=f"G of {idx}")


@pytest.mark.parametrize("bias", [True, False])
def test_linear_3d_input_factors(bias: bool) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias)).to(DT)
    x = torch.randn(3, 7, 4, dtype=DT)  # N=3 examples, T=7 rows each
    t = torch.randn(3, 7, 3, dtype=DT)
    expected = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    pre = make_pre(model)
    batch_loss(model(x), t).backward()
    pre.step()
    facs = pre.factors()
    for name, (a, g) in expected.items():
        assert_close(facs[name][0], a, what=f"A of {name}")
        assert_close(facs[name][1], g, what=f"G of {name}")


CONV_CONFIGS = [
    # (conv kwargs, input shape)
    (dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1), (3, 2, 7, 7)),
    (
        dict(in_channels=2, out_channels=3, kernel_size=3, padding="same", dilation=2, bias=False),
        (2, 2, 7, 5),
    ),
    (dict(in_channels=2, out_channels=2, kernel_size=3, padding="same", dilation=2), (2, 2, 6, 7)),
    (dict(in_channels=3, out_channels=2, kernel_size=(3, 2), padding=0), (2, 3, 6, 5)),
    (
        dict(in_channels=2, out_channels=2, kernel_size=3, padding="valid", stride=(2, 1)),
        (2, 2, 9, 7),
    ),
    (
        dict(
            in_channels=2,
            out_channels=3,
            kernel_size=(3, 2),
            padding=(1, 2),
            stride=(1, 2),
            dilation=(2, 1),
            bias=False,
        ),
        (2, 2, 7, 9),
    ),
    (dict(in_channels=1, out_channels=2, kernel_size=(3, 2), padding="same"), (2, 1, 5, 5)),
    (
        dict(in_channels=2, out_channels=2, kernel_size=(1, 3), padding=(0, 2), dilation=(1, 3)),
        (2, 2, 3, 8),
    ),
    (dict(in_channels=3, out_channels=2, kernel_size=1), (2, 3, 4, 3)),
    (dict(in_channels=1, out_channels=2, kernel_size=5, padding=2), (1, 1, 3, 4)),
    (
        dict(in_channels=2, out_channels=3, kernel_size=3, padding="same", dilation=3, bias=False),
        (2, 2, 4, 5),
    ),
    (
        dict(in_channels=2, out_channels=2, kernel_size=(2, 3), stride=(1, 3), padding=(1, 0)),
        (3, 2, 5, 10),
    ),
    # non-zero padding modes: the patch is the one the convolution really sees
    (
        dict(in_channels=2, out_channels=2, kernel_size=3, padding=1, padding_mode="circular"),
        (2, 2, 5, 6),
    ),
    (
        dict(
            in_channels=2,
            out_channels=2,
            kernel_size=3,
            padding=(2, 1),
            stride=2,
            padding_mode="reflect",
        ),
        (2, 2, 7, 5),
    ),
    (
        dict(
            in_channels=2,
            out_channels=3,
            kernel_size=(2, 3),
            padding="same",
            dilation=2,
            padding_mode="replicate",
            bias=False,
        ),
        (2, 2, 5, 7),
    ),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize(
    ("conv_kw", "shape"), CONV_CONFIGS, ids=[f"conv{i}" for i in range(len(CONV_CONFIGS))]
)
@pytest.mark.parametrize("patches", ["shifted", "im2col"])
def test_conv2d_batch_factors(conv_kw, shape, patches: str) -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(**conv_kw).to(DT)
    x = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        flat = conv(x)[0].numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(flat, 3)).to(DT)
    t = torch.randint(0, 3, (shape[0],))
    expected = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    pre = make_pre(model, conv_patches=patches)
    batch_loss(model(x), t).backward()
    pre.step()
    assert_factors(pre, expected)


# ---------------------------------------------------------------------------------------------
# 3. preconditioned gradients: eigen and inverse
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", INVERSE_METHODS)
@pytest.mark.parametrize("bias", [True, False])
def test_preconditioned_gradient_one_step(method: str, bias: bool) -> None:
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    model = small_conv_model(bias)
    x, t = conv_batch(4, gen)
    expected_f = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    damping = 0.02
    pre = make_pre(model, inverse_method=method, damping=damping)
    batch_loss(model(x), t).backward()
    grads = {str(i): grad_matrix(model[i]) for i in kfac_layers(model)}
    pre.step()
    direction = eigen_direction if method == "eigen" else inverse_direction
    for name, (a, g) in expected_f.items():
        v = direction(a, g, grads[name], damping)
        assert_close(grad_matrix(model[int(name)]), v, rtol=1e-9, what=f"{method} V of {name}")


def test_inverse_method_is_not_eigen() -> None:
    """Guard: the π-damped factored inverse differs from the exact eigen solve."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = small_conv_model()
    x, t = conv_batch(4, gen)
    a, g = oracle_layer_factors(model, 3, x, t)
    batch_loss(model(x), t).backward()
    gm = grad_matrix(model[3])
    diff = (eigen_direction(a, g, gm, 0.02) - inverse_direction(a, g, gm, 0.02)).abs().max()
    assert diff > 1e-6


# ---------------------------------------------------------------------------------------------
# 4. KL clipping, running average + intervals, callables, accumulation, sum reduction
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["clipped", "unclipped", "zero lr"])
def test_kl_clipping_scale(case: str) -> None:
    # "zero lr": a schedule's last step (a cosine ends at 0) moves nothing whatever ν, and
    # KL clipping must then scale nothing (ν = min(1, √(κ/0)) = 1), not fail or make NaN.
    torch.manual_seed(8)
    gen = torch.Generator().manual_seed(8)
    model = small_conv_model()
    x, t = conv_batch(4, gen)
    expected_f = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    damping = 0.05
    lr = 0.0 if case == "zero lr" else 0.3
    kl = 1e6 if case == "unclipped" else 1e-6
    pre = make_pre(model, damping=damping, lr=lambda step: lr, kl_clip=kl)
    batch_loss(model(x), t).backward()
    grads = {str(i): grad_matrix(model[i]) for i in kfac_layers(model)}
    pre.step()
    vs = {n: eigen_direction(a, g, grads[n], damping) for n, (a, g) in expected_f.items()}
    vg = sum((vs[n] * grads[n]).sum().item() for n in vs)
    nu = 1.0 if lr == 0 else min(1.0, math.sqrt(kl / (lr * lr * vg)))
    if case == "clipped":
        assert nu < 0.5
    else:
        assert nu == 1.0
    for n, v in vs.items():
        assert_close(grad_matrix(model[int(n)]), nu * v, rtol=1e-9, what=f"nu*V of {n}")


@pytest.mark.parametrize("shared", [None, True, False])
@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
def test_kl_clipping_scale_of_many_layers_in_chunks(
    device: str, shared: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ν over 30 layers, summed per layer or in chunks of shared launches (by default on a
    GPU; here chunks of at most 100 entries, so most layers are cut apart): the float64
    formula."""
    monkeypatch.setattr(kl_clip, "_CHUNK", 100)
    gen = torch.Generator().manual_seed(3)
    shapes = [(1 + i % 7, 3 + i % 11) for i in range(30)]
    gs = [torch.randn(shape, generator=gen) for shape in shapes]
    vs = [g * (0.5 + torch.rand(g.shape, generator=gen)) for g in gs]  # ⟨V, ∇⟩ > 0
    chunks = kl_clip._chunks(list(zip(vs, gs, strict=True)))
    assert [pair for chunk in chunks for pair in chunk] == list(zip(vs, gs, strict=True))
    assert all(sum(v.numel() for v, _ in chunk) <= 100 for chunk in chunks if len(chunk) > 1)
    assert 5 < len(chunks) < 30
    vg = sum(float((v.double() * g.double()).sum()) for v, g in zip(vs, gs, strict=True))
    lr, kl = 0.2, 1e-3
    want = min(1.0, math.sqrt(kl / (lr * lr * vg)))
    assert want < 1.0
    on = [v.to(device) for v in vs], [g.to(device) for g in gs]
    nu = kl_clip.kl_clip_scale(*on, lr, kl, shared_launches=shared)
    assert nu.device.type == torch.device(device).type
    assert abs(float(nu) - want) <= 1e-6 * want  # float32 products, float64 sums


def test_kl_clipping_with_callable_lr_and_damping() -> None:
    torch.manual_seed(9)
    gen = torch.Generator().manual_seed(9)
    model = small_conv_model()
    lr_fn = lambda k: 0.1 * (k + 1)  # noqa: E731
    damp_fn = lambda k: 0.01 * (k + 2)  # noqa: E731
    kl = 1e-5
    pre = make_pre(model, damping=damp_fn, lr=lr_fn, kl_clip=kl, factor_decay=0.6)
    run_a: dict[str, torch.Tensor] = {}
    run_g: dict[str, torch.Tensor] = {}
    nus = []
    for k in range(3):
        x, t = conv_batch(4, gen)
        batch_f = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
        for n, (a, g) in batch_f.items():
            run_a[n] = a if k == 0 else 0.6 * run_a[n] + 0.4 * a
            run_g[n] = g if k == 0 else 0.6 * run_g[n] + 0.4 * g
        batch_loss(model(x), t).backward()
        grads = {str(i): grad_matrix(model[i]) for i in kfac_layers(model)}
        pre.step()
        vs = {n: eigen_direction(run_a[n], run_g[n], grads[n], damp_fn(k)) for n in grads}
        vg = sum((vs[n] * grads[n]).sum().item() for n in vs)
        nu = min(1.0, math.sqrt(kl / (lr_fn(k) ** 2 * vg)))
        nus.append(nu)
        for n, v in vs.items():
            assert_close(grad_matrix(model[int(n)]), nu * v, rtol=1e-9, what=f"step {k} {n}")
        sgd_(model)
    assert all(nu < 1.0 for nu in nus)


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_running_average_and_update_intervals(method: str) -> None:
    """factor_update_steps=2, inv_update_steps=4, decay 0.7 over 6 steps."""
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(10)
    model = small_conv_model()
    decay = 0.7
    damp_fn = lambda k: 0.01 * (1 + k)  # noqa: E731
    damping = damp_fn if method == "eigen" else 0.03
    damp_at = damp_fn if method == "eigen" else (lambda k: 0.03)
    pre = make_pre(
        model,
        inverse_method=method,
        damping=damping,
        factor_decay=decay,
        factor_update_steps=2,
        inv_update_steps=4,
    )
    names = [str(i) for i in kfac_layers(model)]
    run: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    decomposed: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for k in range(6):
        x, t = conv_batch(3, gen)
        if k % 2 == 0:
            batch_f = {n: oracle_layer_factors(model, int(n), x, t) for n in names}
            for n, (a, g) in batch_f.items():
                if n not in run:
                    run[n] = (a, g)
                else:
                    run[n] = (
                        decay * run[n][0] + (1 - decay) * a,
                        decay * run[n][1] + (1 - decay) * g,
                    )
        if k % 4 == 0:
            decomposed = {n: (run[n][0], run[n][1], damp_at(k)) for n in names}
        batch_loss(model(x), t).backward()
        grads = {n: grad_matrix(model[int(n)]) for n in names}
        pre.step()
        assert pre.steps == k + 1
        for n in names:
            a, g, gamma_decomp = decomposed[n]
            if method == "eigen":
                v = eigen_direction(a, g, grads[n], damp_at(k))  # current damping
            else:
                v = inverse_direction(a, g, grads[n], gamma_decomp)
            assert_close(grad_matrix(model[int(n)]), v, rtol=1e-9, what=f"step {k} V of {n}")
        sgd_(model)
    facs = pre.factors()
    for n in names:
        assert_close(facs[n][0], run[n][0], what=f"final A of {n}")
        assert_close(facs[n][1], run[n][1], what=f"final G of {n}")


def test_preconditioner_at_step5_is_from_step4_not_step5_factors() -> None:
    """Guard for the interval test: using the latest factors at step 5 would differ."""
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(11)
    model = small_conv_model()
    pre = make_pre(model, factor_decay=0.7, factor_update_steps=1, inv_update_steps=4, damping=0.01)
    names = [str(i) for i in kfac_layers(model)]
    run: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    at4: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for k in range(6):
        x, t = conv_batch(3, gen)
        for n in names:
            a, g = oracle_layer_factors(model, int(n), x, t)
            run[n] = (
                (a, g) if n not in run else (0.7 * run[n][0] + 0.3 * a, 0.7 * run[n][1] + 0.3 * g)
            )
        if k == 4:
            at4 = dict(run)
        batch_loss(model(x), t).backward()
        grads = {n: grad_matrix(model[int(n)]) for n in names}
        pre.step()
        if k == 5:
            for n in names:
                v4 = eigen_direction(*at4[n], grads[n], 0.01)
                v5 = eigen_direction(*run[n], grads[n], 0.01)
                assert (v4 - v5).abs().max() > 1e-8
                assert_close(grad_matrix(model[int(n)]), v4, rtol=1e-9, what=f"step 5 {n}")
                assert_close(pre.factors()[n][0], run[n][0], what=f"A {n}")
        sgd_(model)


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_accumulation_four_micro_batches_equals_one_big_batch(method: str) -> None:
    torch.manual_seed(12)
    gen = torch.Generator().manual_seed(12)
    model_big = small_conv_model()
    model_acc = copy.deepcopy(model_big)
    x, t = conv_batch(8, gen)
    expected_f = {str(i): oracle_layer_factors(model_big, i, x, t) for i in kfac_layers(model_big)}
    pre_big = make_pre(model_big, inverse_method=method, damping=0.02)
    pre_acc = make_pre(model_acc, inverse_method=method, damping=0.02, accumulation_steps=4)
    batch_loss(model_big(x), t).backward()
    grads = {n: grad_matrix(model_big[int(n)]) for n in expected_f}
    pre_big.step()
    for j in range(4):
        sl = slice(2 * j, 2 * j + 2)
        (batch_loss(model_acc(x[sl]), t[sl]) / 4).backward()
    grads_acc = {n: grad_matrix(model_acc[int(n)]) for n in expected_f}
    pre_acc.step()
    direction = eigen_direction if method == "eigen" else inverse_direction
    for n, (a, g) in expected_f.items():
        assert_close(grads_acc[n], grads[n], rtol=1e-12, what=f"accumulated ∇ {n}")
        fa, fb = pre_acc.factors()[n], pre_big.factors()[n]
        assert_close(fa[0], a, what=f"acc A {n}")
        assert_close(fa[1], g, what=f"acc G {n}")
        assert_close(fb[0], a, what=f"big A {n}")
        assert_close(fb[1], g, what=f"big G {n}")
        v = direction(a, g, grads[n], 0.02)
        assert_close(grad_matrix(model_acc[int(n)]), v, rtol=1e-9, what=f"acc V {n}")
        assert_close(grad_matrix(model_big[int(n)]), v, rtol=1e-9, what=f"big V {n}")


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_loss_reduction_sum(method: str) -> None:
    torch.manual_seed(13)
    gen = torch.Generator().manual_seed(13)
    model = small_conv_model()
    x, t = conv_batch(5, gen)
    # with l_n the per-example loss, g̃_n = dl_n/dy_n both for L = Σl_n ("sum") and for
    # L = (1/N)Σl_n scaled by N ("mean"): the oracle factors are the same
    expected_f = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    assert_one_step(model, x, t, expected_f, method=method, reduction="sum")


def assert_one_step(
    model: nn.Sequential,
    x: torch.Tensor,
    t: torch.Tensor,
    expected: dict[str, Any],
    *,
    method: str = "eigen",
    reduction: str = "mean",
    damping: float = 0.02,
    **options: Any,
) -> None:
    """One K-FAC step on ``(x, t)``: the oracle's factors, and the damped solve of each layer's
    batch gradient with them as its direction."""
    pre = make_pre(
        model, inverse_method=method, damping=damping, loss_reduction=reduction, **options
    )
    batch_loss(model(x), t, reduction=reduction).backward()
    grads = {n: grad_matrix(model[int(n)]) for n in expected}
    pre.step()
    assert_factors(pre, expected)
    direction = eigen_direction if method == "eigen" else inverse_direction
    for n, (a, g) in expected.items():
        v = direction(a, g, grads[n], damping)
        assert_close(grad_matrix(model[int(n)]), v, rtol=1e-9, what=f"direction of {n}")


def test_sum_and_mean_reduction_give_same_factors() -> None:
    torch.manual_seed(14)
    gen = torch.Generator().manual_seed(14)
    m1 = small_conv_model()
    m2 = copy.deepcopy(m1)
    x, t = conv_batch(5, gen)
    p1 = make_pre(m1, loss_reduction="mean")
    p2 = make_pre(m2, loss_reduction="sum")
    batch_loss(m1(x), t, "mean").backward()
    batch_loss(m2(x), t, "sum").backward()
    p1.step()
    p2.step()
    for n in p1.factors():
        assert_close(p2.factors()[n][0], p1.factors()[n][0], what=f"A {n}")
        assert_close(p2.factors()[n][1], p1.factors()[n][1], what=f"G {n}")


# ---------------------------------------------------------------------------------------------
# 5. callable factor_decay, kl_clip and update intervals against a hand-written schedule
# ---------------------------------------------------------------------------------------------
def run_against_reference(
    model: nn.Sequential,
    pre: dkfac.KFACPreconditioner,
    gen: torch.Generator,
    *,
    steps: int,
    factor_steps: set[int],
    inverse_steps: set[int],
    decay_at,
    damping_at,
    lr_at=lambda k: 0.1,
    kl_at=None,
    method: str = "eigen",
) -> list[float]:
    """Train ``steps`` steps and compare every preconditioned gradient with a float64 reference.

    The reference keeps its own running averages (batch factors from
    :func:`oracle_layer_factors`, folded with ``decay_at(k)`` at the steps in ``factor_steps``,
    the first fold taking the batch as it is), decomposes them at the steps in
    ``inverse_steps`` (dense solves), and clips with ``kl_at(k)``. Returns ν of every step.
    """
    names = [str(i) for i in kfac_layers(model)]
    run: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    decomposed: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    nus = []
    for k in range(steps):
        x, t = conv_batch(3, gen)
        if k in factor_steps:
            for n in names:
                a, g = oracle_layer_factors(model, int(n), x, t)
                if n in run:
                    eps = decay_at(k)
                    a, g = eps * run[n][0] + (1 - eps) * a, eps * run[n][1] + (1 - eps) * g
                run[n] = (a, g)
        if k in inverse_steps:
            decomposed = {n: (*run[n], damping_at(k)) for n in names}
        batch_loss(model(x), t).backward()
        grads = {n: grad_matrix(model[int(n)]) for n in names}
        pre.step()
        vs = {}
        for n in names:
            a, g, gamma_decomposed = decomposed[n]
            if method == "eigen":  # damping applied when preconditioning
                vs[n] = eigen_direction(a, g, grads[n], damping_at(k))
            else:  # damping fixed when decomposed
                vs[n] = inverse_direction(a, g, grads[n], gamma_decomposed)
        nu = 1.0
        if kl_at is not None:
            vg = sum((vs[n] * grads[n]).sum().item() for n in names)
            nu = min(1.0, math.sqrt(kl_at(k) / (lr_at(k) ** 2 * vg)))
        nus.append(nu)
        for n in names:
            assert_close(grad_matrix(model[int(n)]), nu * vs[n], rtol=1e-9, what=f"step {k} {n}")
        sgd_(model)
    for n in names:
        assert_close(pre.factors()[n][0], run[n][0], what=f"final A of {n}")
        assert_close(pre.factors()[n][1], run[n][1], what=f"final G of {n}")
    return nus


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_callable_factor_decay_running_average(method: str) -> None:
    """ε is evaluated at the K-FAC step of each factor update (0, 2, 4), not per update."""
    torch.manual_seed(15)
    gen = torch.Generator().manual_seed(15)
    model = small_conv_model()
    calls: list[int] = []

    def decay(k: int) -> float:
        calls.append(k)
        return 0.9 - 0.1 * k

    pre = make_pre(
        model,
        inverse_method=method,
        damping=0.02,
        factor_decay=decay,
        factor_update_steps=2,
        inv_update_steps=2,
    )
    run_against_reference(
        model,
        pre,
        gen,
        steps=6,
        factor_steps={0, 2, 4},
        inverse_steps={0, 2, 4},
        decay_at=lambda k: 0.9 - 0.1 * k,
        damping_at=lambda k: 0.02,
        method=method,
    )
    assert calls == [0, 2, 4]


def test_callable_kl_clip_schedule() -> None:
    """κ(k) alternates between clipping hard and not clipping at all."""
    torch.manual_seed(16)
    gen = torch.Generator().manual_seed(16)
    model = small_conv_model()
    kl = lambda k: 1e-7 if k % 2 == 0 else 1e6  # noqa: E731
    lr = lambda k: 0.05 * (k + 1)  # noqa: E731
    pre = make_pre(model, damping=0.03, factor_decay=0.8, lr=lr, kl_clip=kl)
    nus = run_against_reference(
        model,
        pre,
        gen,
        steps=4,
        factor_steps={0, 1, 2, 3},
        inverse_steps={0, 1, 2, 3},
        decay_at=lambda k: 0.8,
        damping_at=lambda k: 0.03,
        lr_at=lr,
        kl_at=kl,
    )
    assert all(nu < 0.5 for nu in nus[0::2]), nus
    assert all(nu == 1.0 for nu in nus[1::2]), nus


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_callable_update_intervals(method: str) -> None:
    """Intervals (1, 2) for steps 0-2, then (2, 4): written out as the steps they select."""
    torch.manual_seed(17)
    gen = torch.Generator().manual_seed(17)
    model = small_conv_model()
    damping = lambda k: 0.01 * (k + 1)  # noqa: E731
    pre = make_pre(
        model,
        inverse_method=method,
        damping=damping,
        factor_decay=0.7,
        factor_update_steps=lambda k: 1 if k < 3 else 2,
        inv_update_steps=lambda k: 2 if k < 3 else 4,
    )
    # k % f(k) == 0: 0, 1, 2 (f = 1), then 4, 6 (f = 2); k % i(k) == 0: 0, 2 (i = 2), 4 (i = 4)
    run_against_reference(
        model,
        pre,
        gen,
        steps=8,
        factor_steps={0, 1, 2, 4, 6},
        inverse_steps={0, 2, 4},
        decay_at=lambda k: 0.7,
        damping_at=damping,
        method=method,
    )


# ---------------------------------------------------------------------------------------------
# 6. recovery: a failed Cholesky is recomputed in float64
# ---------------------------------------------------------------------------------------------
def test_failed_cholesky_is_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """inv_dtype=float32 Cholesky reports failure; the float64 retry gives the exact result."""
    torch.manual_seed(18)
    gen = torch.Generator().manual_seed(18)
    model = small_conv_model()
    pre = dkfac.KFACPreconditioner(
        model,
        inverse_method="inverse",
        damping=0.02,
        kl_clip=None,
        factor_dtype=DT,
        inv_dtype=torch.float32,
    )
    real_cholesky_ex = torch.linalg.cholesky_ex
    attempts: list[torch.dtype] = []

    def failing_in_float32(matrix: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        attempts.append(matrix.dtype)
        factor, info = real_cholesky_ex(matrix, **kwargs)
        if matrix.dtype == torch.float32:
            info = torch.ones_like(info)  # "the leading minor of order 1 is not positive"
        return factor, info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing_in_float32)
    x, t = conv_batch(4, gen)
    expected_f = {str(i): oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    batch_loss(model(x), t).backward()
    grads = {n: grad_matrix(model[int(n)]) for n in expected_f}
    with pytest.warns(RuntimeWarning) as record:
        pre.step()
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2, messages
    for name, message in zip(["0", "3"], messages, strict=True):
        # Both factors of the layer were retried: counted per factor, reported once per layer.
        assert message == (
            f"K-FAC layer '{name}': decomposition failed in torch.float32; recomputed in float64"
            " (2 times so far)"
        )
        assert pre.health().layers[name].retried_in_float64 == 2
    assert attempts == [torch.float32] * 4 + [torch.float64] * 4
    for n, (a, g) in expected_f.items():
        inverse = pre.layers[[layer.name for layer in pre.layers].index(n)].inverse
        assert all(t.dtype == DT for t in inverse.tensors().values())
        v = inverse_direction(a, g, grads[n], 0.02)
        assert_close(grad_matrix(model[int(n)]), v, rtol=1e-9, what=f"V of {n}")
