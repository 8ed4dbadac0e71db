"""Blocks for ``nn.Conv1d`` and transformers' ``Conv1D`` (weight stored ``(in, out)``).

Oracles: explicit 1-D patches built with Python loops and ``torch.func`` per-example output
gradients (the same construction as ``test_oracle_numerics`` for Conv2d), dense float64
eigen directions, and for ``Conv1D`` the ``nn.Linear`` holding the transposed weight (whose
numerics the oracle tests check).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import dkfac
from dkfac.curvature import make_block
from dkfac.curvature.blocks import LinearBlock, set_gradients
from test_oracle_numerics import DT, eigen_direction, per_example_loss


def conv1d_patches(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``(N, L_out, C·K)`` patches in ``(c_in, k)`` order, by loops over output positions."""
    (k,), (s,), (d,) = conv.kernel_size, conv.stride, conv.dilation
    if isinstance(conv.padding, str):
        total = d * (k - 1) if conv.padding == "same" else 0
        left, right = total // 2, total - total // 2
    else:
        left = right = conv.padding[0]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, (left, right), mode=mode)
    length = (padded.shape[-1] - d * (k - 1) - 1) // s + 1
    rows = []
    for t in range(length):
        taps = [padded[:, :, t * s + d * j] for j in range(k)]  # each (N, C)
        rows.append(torch.stack(taps, dim=-1).reshape(x.shape[0], -1))  # (N, C·K)
    return torch.stack(rows, dim=1)


def conv1d_oracle(
    model: nn.Sequential, x: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of ``model[0]`` (a Conv1d) from loop patches and per-example gradients."""
    model = copy.deepcopy(model)
    conv, head = model[0], model[1:]
    with torch.no_grad():
        y = conv(x)
    patches = conv1d_patches(x, conv)
    weight = conv.weight.reshape(conv.weight.shape[0], -1)
    rebuilt = torch.einsum("nlk,ok->nol", patches, weight)
    if conv.bias is not None:
        rebuilt = rebuilt + conv.bias.reshape(1, -1, 1)
    torch.testing.assert_close(rebuilt, y, rtol=1e-12, atol=1e-12)  # the patches are right

    def ell(yn: torch.Tensor, tn: torch.Tensor) -> torch.Tensor:
        return per_example_loss(head(yn.unsqueeze(0)), tn.unsqueeze(0))

    g = vmap(grad(ell))(y, t)  # (N, C_out, L_out): N·dL/dy for the mean loss
    a_rows = patches.reshape(-1, patches.shape[-1])
    if conv.bias is not None:
        a_rows = torch.cat([a_rows, torch.ones(a_rows.shape[0], 1, dtype=DT)], dim=1)
    g_rows = g.permute(0, 2, 1).reshape(-1, g.shape[1])
    return a_rows.t() @ a_rows / a_rows.shape[0], g_rows.t() @ g_rows / x.shape[0]


@pytest.mark.parametrize(
    "conv",
    [
        {"padding": 1, "stride": 2},
        {"padding": "same", "dilation": 2, "bias": False},
        {"padding": 2, "padding_mode": "circular"},
    ],
)
def test_conv1d_factors_and_step_equal_the_float64_oracle(conv: dict[str, object]) -> None:
    torch.manual_seed(0)
    layer = nn.Conv1d(2, 3, 3, **conv)  # type: ignore[arg-type]
    length = layer(torch.zeros(1, 2, 9)).shape[-1]  # output length, for the head
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(3 * length, 4)).to(DT)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 9, dtype=DT, generator=generator)
    t = torch.randint(0, 4, (5,), generator=generator)
    want_a, want_g = conv1d_oracle(model, x, t)
    damping = 0.05
    pre = dkfac.KFACPreconditioner(
        model, damping=damping, kl_clip=None, factor_dtype=DT, inv_dtype=DT
    )
    F.cross_entropy(model(x), t).backward()
    weight_grad = layer.weight.grad.reshape(3, -1).clone()  # step() writes .grad in place
    grad_m = (
        weight_grad if layer.bias is None else torch.cat([weight_grad, layer.bias.grad[:, None]], 1)
    )
    pre.step()
    got_a, got_g = pre.factors()["0"]
    torch.testing.assert_close(got_a, want_a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    direction = eigen_direction(want_a, want_g, grad_m, damping)
    got = layer.weight.grad.reshape(3, -1)
    if layer.bias is not None:
        got = torch.cat([got, layer.bias.grad[:, None]], 1)
    torch.testing.assert_close(got, direction, rtol=1e-9, atol=1e-12)


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` as it is written there: ``y = x W + b``, ``W`` of ``(nx, nf)``
    (a stand-in, so the test needs no transformers; the real one is tested below)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.reshape(*x.shape[:-1], self.nf)


def transposed_and_linear() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(2)
    transposed = nn.Sequential(Conv1D(6, 4), nn.Tanh(), Conv1D(3, 6)).to(DT)
    linear = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    with torch.no_grad():
        for conv, lin in ((transposed[0], linear[0]), (transposed[2], linear[2])):
            lin.weight.copy_(conv.weight.t())
            lin.bias.copy_(conv.bias)
    return transposed, linear


def test_transformers_conv1d_is_preconditioned_as_the_linear_layer_it_transposes() -> None:
    transposed, linear = transposed_and_linear()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 4, dtype=DT, generator=generator)  # (batch, time, features)
    t = torch.randint(0, 3, (5, 7), generator=generator)
    pres = []
    for model in (transposed, linear):
        pre = dkfac.KFACPreconditioner(model, kl_clip=None, factor_dtype=DT, inv_dtype=DT)
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), t.flatten()).backward()
            pre.step()
        pres.append(pre)
    assert [layer.name for layer in pres[0].layers] == ["0", "2"]
    assert "transposed weight" in repr(pres[0])
    for name in ("0", "2"):
        for mine, theirs in zip(pres[0].factors()[name], pres[1].factors()[name], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    for conv, lin in ((transposed[0], linear[0]), (transposed[2], linear[2])):
        torch.testing.assert_close(conv.weight.grad, lin.weight.grad.t(), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(conv.bias.grad, lin.bias.grad, rtol=1e-10, atol=1e-14)


def test_a_gpt2_from_its_config_gets_its_conv1d_projections_preconditioned() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    pre = dkfac.KFACPreconditioner(model)
    names = {layer.name for layer in pre.layers}
    for block in range(2):
        for projection in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert f"transformer.h.{block}.{projection}" in names
    ids = torch.randint(0, 50, (4, 16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(input_ids=ids, labels=ids).loss.backward()
    raw = model.transformer.h[0].mlp.c_fc.weight.grad.clone()
    pre.step()
    after = model.transformer.h[0].mlp.c_fc.weight.grad
    assert torch.isfinite(after).all() and not torch.allclose(after, raw)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # grads only


class Projection(nn.Module):
    """A user's own linear layer (its parameters, ``F.linear``): no built-in block knows it."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, features) * 0.3)
        self.bias = nn.Parameter(torch.zeros(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GatedProjection(Projection):
    """A subclass: found through the class hierarchy of the ``blocks`` lookup."""


def equals_linear_bit_for_bit(**options: object) -> None:
    """The user's layers, given ``LinearBlock`` by ``options``, precondition as ``nn.Linear``."""
    torch.manual_seed(4)
    mine = nn.Sequential(Projection(4, 6), nn.Tanh(), GatedProjection(6, 3)).to(DT)
    linear = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    with torch.no_grad():
        for a, b in ((mine[0], linear[0]), (mine[2], linear[2])):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
    generator = torch.Generator().manual_seed(5)
    x, t = (
        torch.randn(8, 4, dtype=DT, generator=generator),
        torch.randint(0, 3, (8,), generator=generator),
    )
    common = {"kl_clip": None, "factor_dtype": DT, "inv_dtype": DT}
    pres = [
        dkfac.KFACPreconditioner(mine, **options, **common),  # type: ignore[arg-type]
        dkfac.KFACPreconditioner(linear, **common),  # type: ignore[arg-type]
    ]
    assert [layer.name for layer in pres[0].layers] == ["0", "2"]
    for model, pre in zip((mine, linear), pres, strict=True):
        F.cross_entropy(model(x), t).backward()
        pre.step()
    for a, b in zip(mine.parameters(), linear.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def layer_names(model: nn.Module, **options: object) -> list[str]:
    return [layer.name for layer in dkfac.KFACPreconditioner(model, **options).layers]  # type: ignore[arg-type]


def test_blocks_add_a_users_layer_type_as_the_worked_example_in_the_readme() -> None:
    from dkfac.curvature import LinearBlock

    # Without blocks= the user's layer is skipped as an unsupported type.
    assert layer_names(nn.Sequential(Projection(4, 2), nn.Linear(2, 2))) == ["1"]
    equals_linear_bit_for_bit(blocks={Projection: LinearBlock})


def test_register_block_adds_a_layer_type_for_every_preconditioner_until_removed() -> None:
    from dkfac.curvature import LinearBlock

    model = nn.Sequential(Projection(4, 2), nn.Linear(2, 2))
    registration = dkfac.register_block(Projection, LinearBlock)
    try:
        assert layer_names(model) == ["0", "1"]
        equals_linear_bit_for_bit()  # GatedProjection too: through the class hierarchy
    finally:
        registration.remove()
    assert layer_names(model) == ["1"]
    registration.remove()  # a second remove() does nothing
    newer = dkfac.register_block(Projection, LinearBlock)  # the same factory again
    registration.remove()  # the old handle leaves the newer registration alone
    assert layer_names(model) == ["0", "1"]
    newer.remove()
    with dkfac.register_block(Projection, LinearBlock):
        assert layer_names(model) == ["0", "1"]
    assert layer_names(model) == ["1"]
    assert "__dkfac_block_factory__" not in vars(Projection)


def test_blocks_come_before_registered_types_and_the_nearest_registration_wins() -> None:
    from dkfac.curvature import LinearBlock

    made: list[str] = []

    def factory(tag: str) -> Callable[[nn.Module], LinearBlock]:
        def make(module: nn.Module) -> LinearBlock:
            made.append(tag)
            return LinearBlock(module)  # type: ignore[arg-type]  # Projection has Linear's fields

        return make

    model = nn.Sequential(Projection(4, 3), GatedProjection(3, 2))
    with (
        dkfac.register_block(Projection, factory("registered base")),
        dkfac.register_block(GatedProjection, factory("registered subclass")),
    ):
        layer_names(model)
        assert made == ["registered base", "registered subclass"]
        made.clear()
        layer_names(model, blocks={Projection: factory("blocks=")})
        assert made == ["blocks=", "blocks="]  # blocks= first, even for the subclass
        made.clear()
        with dkfac.register_block(nn.Linear, factory("over the built-in")):
            layer_names(nn.Sequential(nn.Linear(2, 2)))
        assert made == ["over the built-in"]
    assert layer_names(nn.Sequential(nn.Linear(2, 2))) == ["0"]  # the built-in block again


def test_a_registered_embedding_type_is_refused_when_it_cannot_be_handled() -> None:
    from dkfac.curvature import EmbeddingBlock

    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    assert layer_names(model) == ["1"]  # by default: skipped with its reason
    with (
        dkfac.register_block(nn.Embedding, EmbeddingBlock),
        pytest.raises(ValueError, match="layer '0' \\(Embedding\\)"),
    ):
        layer_names(model)  # asked for: refused, not skipped


def test_bad_registrations_are_refused() -> None:
    from dkfac.curvature import LinearBlock

    with pytest.raises(ValueError, match=r"expected a subclass of torch\.nn\.Module"):
        dkfac.register_block(int, LinearBlock)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a callable factory"):
        dkfac.register_block(Projection, "LinearBlock")  # type: ignore[arg-type]
    with (
        dkfac.register_block(Projection, LinearBlock),
        pytest.raises(ValueError, match="Projection already has the block factory"),
    ):
        dkfac.register_block(Projection, LinearBlock)
    with (
        dkfac.register_block(Projection, lambda m: m),  # type: ignore[arg-type, return-value]
        pytest.raises(TypeError, match="returned Projection, not a dkfac"),
    ):
        layer_names(nn.Sequential(Projection(4, 2)))


def test_bad_blocks_are_refused() -> None:
    model = nn.Sequential(Projection(4, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="blocks entry"):
        dkfac.KFACPreconditioner(model, blocks={"Projection": lambda m: m})  # type: ignore[dict-item]
    with pytest.raises(
        TypeError, match=r"returned Projection, not a dkfac\.curvature\.KroneckerBlock"
    ):
        dkfac.KFACPreconditioner(model, blocks={Projection: lambda m: m})  # type: ignore[dict-item, return-value]


def test_gradients_written_back_together_are_rounded_once_each() -> None:
    """``set_gradients`` of a bf16 weight beside a float32 bias (its matrix is float32):
    the weight takes ``(matrix · ν)`` rounded once to bf16, as ``set_grad(matrix * ν)``
    wrote it, not ``matrix`` rounded, then scaled and rounded again; the float32 layer's
    entries are ``matrix · ν`` exactly."""
    torch.manual_seed(0)
    mixed, plain = nn.Linear(5, 3), nn.Linear(4, 2)
    mixed.weight = nn.Parameter(mixed.weight.detach().to(torch.bfloat16))
    blocks = [LinearBlock(mixed), LinearBlock(plain)]
    for block in blocks:
        for parameter in block.parameters():
            parameter.grad = torch.zeros_like(parameter)
    matrices = [torch.randn(3, 6), torch.randn(2, 5)]
    scale = torch.tensor(0.3721)
    set_gradients(blocks, matrices, scale)
    want = matrices[0] * scale
    assert mixed.weight.grad is not None and mixed.bias.grad is not None
    assert torch.equal(mixed.weight.grad, want[:, :5].to(torch.bfloat16))
    assert torch.equal(mixed.bias.grad, want[:, 5])
    assert plain.weight.grad is not None and plain.bias.grad is not None
    assert torch.equal(plain.weight.grad, (matrices[1] * scale)[:, :4])
    assert torch.equal(plain.bias.grad, (matrices[1] * scale)[:, 4])
    with pytest.raises(ValueError, match="belongs to two blocks"):
        set_gradients([blocks[1], blocks[1]], [matrices[1], matrices[1]])


def cuda_copy_launches(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> int:
    """The launches CUDA's ``_foreach_copy_(dsts, srcs)`` takes (ATen's fast route, written out
    from foreach_tensor_copy_list_kernel_cuda_): one, if every tensor is dense, each list has
    one dtype and each pair the same sizes and strides (a size-1 dim's stride aside); else one
    per pair."""

    def dense(t: torch.Tensor) -> bool:
        return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)

    def alike(d: torch.Tensor, s: torch.Tensor) -> bool:
        return d.shape == s.shape and all(
            d.stride(i) == s.stride(i) for i in range(d.dim()) if d.shape[i] != 1
        )

    fast = (
        len({t.dtype for t in dsts}) == 1
        and len({t.dtype for t in srcs}) == 1
        and all(dense(t) for t in [*dsts, *srcs])
        and all(alike(d, s) for d, s in zip(dsts, srcs, strict=True))
    )
    return 1 if fast else len(dsts)


def test_gradients_are_written_back_in_the_fewest_cuda_copy_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight convolutions without a bias (their matrices copied through views of their
    gradients, laid out alike) share one fused copy; a Linear layer's and a ``Conv1D``'s
    weight and bias (a column of the matrix, a transposed weight) go in one more call: 1 + 4
    launches on CUDA, not 12 (one pair laid out otherwise makes CUDA copy every pair alone).
    The values: each parameter's part of its matrix, times the scale."""
    torch.manual_seed(0)
    modules: list[nn.Module] = [nn.Conv2d(2, 3, 3, bias=False) for _ in range(8)]
    modules += [nn.Linear(4, 3), Conv1D(3, 4)]
    blocks = [make_block(module) for module in modules]
    assert all(block is not None for block in blocks)
    for block in blocks:
        for parameter in block.parameters():
            parameter.grad = torch.randn_like(parameter)
    grad_matrices = [block.grad_matrix() for block in blocks]
    matrices = [torch.randn(block.g_dim, block.a_dim) for block in blocks]
    scale = torch.tensor(0.75)
    calls: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    copy = torch._foreach_copy_

    def recorded(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append((list(dsts), list(srcs)))
        copy(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", recorded)
    set_gradients(blocks, matrices, scale, grad_matrices)
    assert sum(len(dsts) for dsts, _ in calls) == 8 + 4
    assert sum(cuda_copy_launches(*call) for call in calls) == 1 + 4
    for block, matrix in zip(blocks, matrices, strict=True):
        for parameter, part in zip(block.parameters(), block.split_matrix(matrix), strict=True):
            assert torch.equal(parameter.grad, part * scale)
    # Gradients of two dtypes: one fused call per dtype (one list mixing them is not fused).
    for block in blocks[:4]:
        block.weight.data = block.weight.data.to(torch.bfloat16)
        block.weight.grad = torch.randn_like(block.weight)
    calls.clear()
    mixed = [torch.randn(b.g_dim, b.a_dim, dtype=b.weight.dtype) for b in blocks[:8]]
    set_gradients(blocks[:8], mixed, None, [block.grad_matrix() for block in blocks[:8]])
    assert sum(cuda_copy_launches(*call) for call in calls) == 2
    for block, matrix in zip(blocks[:8], mixed, strict=True):
        assert torch.equal(block.weight.grad, matrix.reshape(block.weight.shape))


def test_gradients_all_cast_while_scaled_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 layer's float32 matrix with a scale: written as ``(matrix · ν)`` rounded once,
    with no fused call left to make (an empty list is not passed on)."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    layer.weight.grad = torch.zeros_like(layer.weight)
    matrix, scale = torch.randn(3, 4), torch.tensor(0.37)
    set_gradients([LinearBlock(layer)], [matrix], scale)
    assert torch.equal(layer.weight.grad, (matrix * scale).to(torch.bfloat16))


def test_gradients_written_through_their_matrix_views_are_the_parameter_shaped_products() -> None:
    """With this step's gradient matrices at hand, a block without bias whose matrix is a
    view of its weight gradient takes the new matrix through that view (a Linear layer's,
    a convolution's); one whose matrix was a copy (an embedding's contiguous transpose, a
    channels-last convolution's), one with a bias, and a bf16 weight with a float32 matrix
    (rounded once) take it shaped like their parameters. Oracle: ``matrix · ν`` reshaped as
    the parameter."""
    torch.manual_seed(0)
    from dkfac.curvature.block_types import make_block

    channels_last = nn.Conv2d(3, 4, 3, bias=False).to(memory_format=torch.channels_last)
    bf16 = nn.Linear(5, 3, bias=False)
    bf16.weight = nn.Parameter(bf16.weight.detach().to(torch.bfloat16))
    modules = [
        nn.Linear(5, 3, bias=False),
        nn.Conv2d(2, 4, 3, bias=False),
        nn.Embedding(7, 3),
        channels_last,
        nn.Linear(4, 2),
        bf16,
    ]
    blocks = [make_block(module) for module in modules]
    for block in blocks:
        for parameter in block.parameters():
            parameter.grad = torch.randn_like(parameter)
    views = [block.grad_matrix() for block in blocks]
    shared = [
        view.data_ptr() == block.weight.grad.data_ptr()  # type: ignore[union-attr]
        for view, block in zip(views, blocks, strict=True)
    ]
    assert shared == [True, True, False, False, False, True]
    matrices = [torch.randn(view.shape) for view in views]
    scale = torch.tensor(0.3721)
    set_gradients(blocks, matrices, scale, views)
    for block, matrix in zip(blocks, matrices, strict=True):
        want = block.split_matrix(matrix * scale)
        for parameter, part in zip(block.parameters(), want, strict=True):
            assert torch.equal(parameter.grad, part.to(parameter.dtype))
    with pytest.raises(ValueError, match="belongs to two blocks"):
        set_gradients(blocks[:1] * 2, matrices[:1] * 2, None, views[:1] * 2)


def test_a_block_that_splits_matrices_its_own_way_is_asked_to() -> None:
    """Only dkfac's own ``split_matrix`` is known to invert the gradient's matrix view: a
    block overriding it splits the new matrix itself (oracle: what its split gives)."""

    class Rolled(LinearBlock):
        """A (contrived) layer whose gradient matrix is its weight's columns rolled by one."""

        def grad_matrix(self) -> torch.Tensor:
            assert self.weight.grad is not None
            return self.weight.grad.view(self.g_dim, -1)  # a view; split_matrix disagrees

        def split_matrix(self, matrix: torch.Tensor) -> list[torch.Tensor]:
            return [matrix.roll(1, dims=1)]

    layer = nn.Linear(4, 3, bias=False)
    block = Rolled(layer)
    layer.weight.grad = torch.zeros_like(layer.weight)
    matrix = torch.randn(3, 4)
    set_gradients([block], [matrix], None, [block.grad_matrix()])
    assert torch.equal(layer.weight.grad, matrix.roll(1, dims=1))


def _with_bias(matrix: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``matrix`` with the bias gradient appended as its last column (if there is a bias)."""
    bias = getattr(module, "bias", None)
    return matrix if bias is None else torch.cat([matrix, bias.grad[:, None]], 1)


#: Each layer type's gradient matrix ``(d_G, d_A)`` from its parameters' gradients, written
#: out here from docs/math.md's conventions (the oracle of ``matrix_of``).
GRADIENT_MATRICES: list[tuple[str, nn.Module, Callable[[nn.Module], torch.Tensor]]] = [
    ("linear", nn.Linear(4, 3), lambda m: _with_bias(m.weight.grad, m)),
    ("linear-no-bias", nn.Linear(4, 3, bias=False), lambda m: m.weight.grad),
    ("conv2d", nn.Conv2d(2, 3, 3), lambda m: _with_bias(m.weight.grad.reshape(3, -1), m)),
    ("conv2d-no-bias", nn.Conv2d(2, 3, 3, bias=False), lambda m: m.weight.grad.reshape(3, -1)),
    ("conv1d", nn.Conv1d(2, 3, 2), lambda m: _with_bias(m.weight.grad.reshape(3, -1), m)),
    ("embedding", nn.Embedding(5, 3), lambda m: m.weight.grad.t()),  # one-hot inputs: Wᵀ
    ("Conv1D", Conv1D(3, 4), lambda m: _with_bias(m.weight.grad.t(), m)),  # y = x W + b
]


@pytest.mark.parametrize(
    ("module", "oracle"),
    [(module, oracle) for _, module, oracle in GRADIENT_MATRICES],
    ids=[name for name, _, _ in GRADIENT_MATRICES],
)
def test_matrix_of_makes_the_gradient_matrix_and_inverts_split_matrix(
    module: nn.Module, oracle: Callable[[nn.Module], torch.Tensor]
) -> None:
    """``matrix_of`` (what a captured plain step makes the matrices with, from the gradients)
    against the matrix written out from the layer's definition, and ``split_matrix`` back."""
    block = make_block(module)
    assert block is not None
    torch.manual_seed(0)
    for parameter in block.parameters():
        parameter.grad = torch.randn_like(parameter)
    grads = [parameter.grad for parameter in block.parameters()]
    expected = oracle(module)
    assert expected.shape == (block.g_dim, block.a_dim)
    assert torch.equal(block.matrix_of(grads), expected)
    assert torch.equal(block.grad_matrix(), expected)
    matrix = torch.randn(block.g_dim, block.a_dim)
    parts = block.split_matrix(matrix)
    assert [part.shape for part in parts] == [p.shape for p in block.parameters()]
    assert torch.equal(block.matrix_of(parts), matrix)
