"""Tests of the Transformer classifier, the causal Transformer LM and the model registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac.data.registry import load_dataset
from dkfac.models import MODEL_NAMES, TransformerClassifier, TransformerLM, build_model


def test_transformer_output_shapes_and_short_sequences() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=11, num_classes=3, d_model=16, heads=4, seq_len=8)
    tokens = torch.randint(0, 11, (5, 8))
    assert model(tokens).shape == (5, 3)
    assert model(tokens[:, :5]).shape == (5, 3)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="divide"):
        TransformerClassifier(10, 2, d_model=10, heads=4)
    with pytest.raises(ValueError, match="positive"):
        TransformerClassifier(10, 2, layers=0)


def test_transformer_is_permutation_aware_through_positions() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=7, num_classes=2, d_model=16, heads=2, seq_len=6)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert not torch.allclose(model(tokens), model(tokens.flip(1)))


def test_kfac_preconditions_every_linear_and_embedding_and_skips_the_rest() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=13, num_classes=4, d_model=16, heads=2, layers=2)
    pre = dkfac.KFACPreconditioner(model, lr=0.05, damping=0.01)
    linear_names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linear_names) == 2 * 6 + 1  # q, k, v, out, fc1, fc2 per block + head
    embeddings = {"token_embedding", "position_embedding"}
    assert {layer.name for layer in pre.layers} == linear_names | embeddings
    skipped = {s.name: s.kind for s in pre.skipped}
    assert skipped == {
        name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)
    }
    assert {"LayerNorm"} == set(skipped.values())
    # Positions looked up per sequence, not broadcast: both embeddings stay preconditioned.
    tokens = torch.randint(0, 13, (4, 8), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens), torch.arange(4) % 4).backward()
    pre.step()
    assert "broadcast" not in repr(pre)
    pre.remove()


def test_every_linear_of_the_transformer_gets_the_exact_kfac_direction() -> None:
    # The first step's direction of every Linear (queries, keys, values, attention output,
    # MLP, head) against dense float64 K-FAC written here: A over every token row, G from the
    # output gradients of the mean loss times N (examples = sequences), (A⊗G + γI)⁻¹ vec ∇.
    spec = load_dataset(
        "tokens", seed=0, vocab_size=16, seq_len=6, num_classes=4, train_size=8, test_size=4
    )
    torch.manual_seed(0)
    model = build_model("transformer", spec, d_model=8, heads=2, layers=1).double()
    tokens, labels = spec.train.tensors  # type: ignore[attr-defined]
    damping = 0.01
    seen: dict[str, list[torch.Tensor]] = {}

    def capture(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            seen[name] = [inputs[0].detach()]
            out.register_hook(lambda g: seen[name].append(g.detach()))

        return hook

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, module in linears.items():
        module.register_forward_hook(capture(name))
    pre = dkfac.KFACPreconditioner(
        model, damping=damping, kl_clip=None, factor_dtype=torch.float64, inv_dtype=torch.float64
    )
    nn.functional.cross_entropy(model(tokens), labels).backward()
    grads = {
        name: torch.cat([m.weight.grad, m.bias.grad[:, None]], dim=1).clone()
        for name, m in linears.items()
    }
    pre.step()
    n = tokens.shape[0]
    for name, module in linears.items():
        x, dy = seen[name]
        a_rows = torch.cat([x.reshape(-1, x.shape[-1]), x.new_ones(x[..., :1].numel(), 1)], 1)
        g_rows = dy.reshape(-1, dy.shape[-1])
        a = a_rows.t() @ a_rows / a_rows.shape[0]
        g = n * g_rows.t() @ g_rows
        grad = grads[name]
        vec = grad.t().reshape(-1)
        fisher = torch.kron(a, g) + damping * torch.eye(vec.numel(), dtype=torch.float64)
        want = torch.linalg.solve(fisher, vec).reshape(grad.shape[1], grad.shape[0]).t()
        got = torch.cat([module.weight.grad, module.bias.grad[:, None]], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * want.abs().max())
        assert not torch.allclose(got, grad, rtol=0.1)  # K-FAC changed it materially


def test_kfac_trains_the_transformer_faster_than_the_same_sgd() -> None:
    spec = load_dataset(
        "tokens", seed=0, vocab_size=16, seq_len=8, num_classes=4, train_size=128, test_size=16
    )
    tokens, labels = spec.train.tensors  # type: ignore[attr-defined]
    losses = {}
    for use_kfac in (False, True):
        torch.manual_seed(0)
        model = build_model("transformer", spec, d_model=32, heads=4, layers=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = dkfac.KFACPreconditioner(model, lr=0.05, damping=0.01) if use_kfac else None
        for _ in range(15):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            if pre is not None:
                pre.step()
            optimizer.step()
        with torch.no_grad():
            losses[use_kfac] = float(nn.functional.cross_entropy(model(tokens), labels))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    # Same data, seed, learning rate and steps: the K-FAC run ends well below plain SGD.
    assert losses[True] < 0.8 * losses[False], losses


def test_transformer_lm_gives_logits_per_position_and_checks_its_sizes() -> None:
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=11, d_model=16, heads=4, layers=2, seq_len=8, mlp_ratio=2)
    tokens = torch.randint(0, 11, (5, 8))
    assert model(tokens).shape == (5, 8, 11)
    assert model(tokens[:, :3]).shape == (5, 3, 11)
    fc1 = model.blocks[0].fc1
    assert (fc1.in_features, fc1.out_features) == (16, 32)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"TransformerLM sizes must be positive.*mlp_ratio"):
        TransformerLM(10, mlp_ratio=0)
    with pytest.raises(ValueError, match="divide"):
        TransformerLM(10, d_model=10, heads=4)
    with pytest.raises(ValueError, match="dropout"):
        TransformerLM(10, dropout=1.0)


def test_transformer_lm_is_causal_and_the_classifier_is_not() -> None:
    torch.manual_seed(0)
    lm = TransformerLM(vocab_size=13, d_model=16, heads=2, layers=2, seq_len=10)
    tokens = torch.randint(0, 13, (3, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 13
    with torch.no_grad():
        before, after = lm(tokens), lm(changed)
    # Positions before the changed token see nothing of it; from it on, they do.
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])
    classifier = TransformerClassifier(13, 2, d_model=16, heads=2, seq_len=10)
    block = classifier.blocks[0]
    assert block.attention.causal is False
    x = torch.randn(1, 10, 16)
    y = x.clone()
    y[:, 6] += torch.randn(16)  # not a constant: LayerNorm would remove it
    with torch.no_grad():
        assert not torch.allclose(block(x)[:, :6], block(y)[:, :6])  # bidirectional


def test_kfac_preconditions_every_linear_and_embedding_of_the_lm() -> None:
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=9, d_model=8, heads=2, layers=2, seq_len=6)
    pre = dkfac.KFACPreconditioner(model, lr=0.05, damping=0.01)
    try:
        linear_names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert len(linear_names) == 2 * 6 + 1
        embeddings = {"token_embedding", "position_embedding"}
        assert {layer.name for layer in pre.layers} == linear_names | embeddings
        tokens = torch.randint(0, 9, (4, 7))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 9), tokens[:, 1:].reshape(-1))
        loss.backward()
        pre.step()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        pre.remove()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_model_for_every_name(name: str) -> None:
    torch.manual_seed(0)
    if name == "transformer":
        spec = load_dataset("tokens", vocab_size=10, seq_len=6, num_classes=3, train_size=4)
    elif name == "mlp":
        spec = load_dataset("synthetic", shape=(5,), num_classes=3, train_size=4, test_size=2)
    elif name == "lm":  # a logit per character at every position
        spec = load_dataset("pysource", seq_len=6, max_chars=4 * 6 + 1)
        model = build_model(name, spec, d_model=8, heads=2, layers=1)
        assert model(spec.train.tensors[0]).shape == (4, 6, 128)  # type: ignore[attr-defined]
        return
    else:
        spec = load_dataset("synthetic", shape=(3, 8, 8), num_classes=3, train_size=4)
    model = build_model(name, spec)
    x, _ = spec.train.tensors  # type: ignore[attr-defined]
    assert model(x).shape == (4, 3)


def test_build_model_keywords_and_grayscale_images() -> None:
    digits = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, kind="image", width=4)
    assert digits(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    resnet = build_model("resnet20", input_shape=(1, 8, 8), num_classes=10)
    assert resnet(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    mlp = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16,))
    assert mlp(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    tiny = build_model("transformer", input_shape=(4,), num_classes=2, kind="tokens", vocab_size=5)
    assert tiny(torch.randint(0, 5, (3, 4))).shape == (3, 2)


def test_build_model_errors() -> None:
    with pytest.raises(ValueError, match="expected one of mlp, cnn, resnet20"):
        build_model("vgg", input_shape=(3, 32, 32), num_classes=10)
    with pytest.raises(ValueError, match="'resnet20' does not fit dataset kind 'tokens'"):
        build_model("resnet20", input_shape=(8,), num_classes=2, kind="tokens", vocab_size=4)
    with pytest.raises(ValueError, match="'transformer' does not fit dataset kind 'image'"):
        build_model("transformer", input_shape=(3, 8, 8), num_classes=2)
    with pytest.raises(ValueError, match="'mlp' does not fit dataset kind 'tokens'"):
        build_model("mlp", input_shape=(8,), num_classes=2, kind="tokens")
    with pytest.raises(ValueError, match="'cnn' does not fit"):
        build_model("cnn", input_shape=(3, 8, 6), num_classes=2)
    with pytest.raises(ValueError, match="even"):
        build_model("cnn", input_shape=(3, 7, 7), num_classes=2)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("transformer", input_shape=(8,), num_classes=2, kind="tokens")
    with pytest.raises(ValueError, match=r"depth.*accepted: none"):
        build_model("resnet32", input_shape=(3, 8, 8), num_classes=2, depth=5)
    with pytest.raises(ValueError, match="needs input_shape"):
        build_model("mlp")
