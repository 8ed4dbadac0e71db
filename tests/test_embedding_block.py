"""``nn.Embedding`` blocks against their definition: a linear layer on one-hot tokens.

Oracles: the float64 Gram of the one-hot rows (``A = diag(counts)/R``), and a whole K-FAC step
of a model whose embedding is replaced by ``one_hot(x) @ Linear(V, d, bias=False)`` with the
same weight, which the suite checks against float64 formulas; the embedding's preconditioned
gradient must equal that linear layer's, transposed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from distributed_harness import run_workers
from dkfac.curvature.block_types import make_block
from dkfac.curvature.embedding import EmbeddingBlock
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.factor_side import DiagonalSide
from dkfac.strategies.accounting import DryRunSettings, account_strategy
from dkfac.strategies.layer_shapes import layer_shapes_of

DT = torch.float64
VOCAB, DIM, CLASSES = 7, 4, 3
#: Embeddings are preconditioned on request.
BLOCKS = {nn.Embedding: EmbeddingBlock}
EXACT: dict[str, Any] = {"factor_dtype": DT, "inv_dtype": DT, "kl_clip": None, "lr": 0.1}


def tokens(seed: int, shape: tuple[int, ...] = (5, 6)) -> torch.Tensor:
    """Token ids with some ids absent (never seen: ``A``'s entry 0)."""
    return torch.randint(0, VOCAB - 2, shape, generator=torch.Generator().manual_seed(seed))


def test_the_input_statistic_is_the_gram_of_the_one_hot_rows() -> None:
    assert isinstance(make_block(nn.Embedding(VOCAB, DIM)), EmbeddingBlock)  # by default
    block = make_block(nn.Embedding(VOCAB, DIM), BLOCKS)
    assert isinstance(block, EmbeddingBlock) and (block.a_dim, block.g_dim) == (VOCAB, DIM)
    assert isinstance(block.a_dim, DiagonalSide)  # A is held as its diagonal
    for x in (tokens(0), tokens(1, (9,)), torch.tensor(3)):
        statistic = block.a_statistic(x, DT)
        rows = F.one_hot(x.reshape(-1), VOCAB).to(DT)
        assert statistic.total.shape == (VOCAB,)
        assert torch.equal(torch.diag(statistic.total), rows.t() @ rows)
        assert statistic.rows == x.numel()
        assert statistic.examples == (x.shape[0] if x.dim() else 1)
    dy = torch.randn(5, 6, DIM, dtype=DT)
    g = block.g_statistic(dy, DT)
    torch.testing.assert_close(g.total, dy.reshape(-1, DIM).t() @ dy.reshape(-1, DIM))
    assert g.examples == 5


class Tagger(nn.Module):
    """Per-token classes from an embedding (or its one-hot linear twin) and a linear head."""

    def __init__(self, one_hot: bool, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx).to(DT)
        self.head = nn.Linear(DIM, CLASSES).to(DT)  # before the twin's layer draws numbers
        self.one_hot = one_hot
        if one_hot:  # the same map: onehot(x) @ W with W the embedding's weight
            self.lookup = nn.Linear(VOCAB, DIM, bias=False).to(DT)
            with torch.no_grad():
                self.lookup.weight.copy_(self.embedding.weight.t())
            del self.embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_hot:
            return self.head(self.lookup(F.one_hot(x, VOCAB).to(DT)))
        return self.head(self.embedding(x))

    def lookup_grad(self) -> torch.Tensor:
        """The embedding's gradient as ``(VOCAB, DIM)`` in both twins."""
        if self.one_hot:
            return self.lookup.weight.grad.t()
        return self.embedding.weight.grad


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_an_embedding_is_preconditioned_as_a_linear_layer_on_one_hot_tokens(method: str) -> None:
    grads = {}
    for one_hot in (False, True):
        model = Tagger(one_hot)
        pre = dkfac.KFACPreconditioner(model, inverse_method=method, blocks=BLOCKS, **EXACT)
        assert len(pre.layers) == 2  # the embedding is preconditioned, not skipped
        for seed in range(3):  # the running averages too
            model.zero_grad()
            x, y = tokens(seed), tokens(seed + 10) % CLASSES
            F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
            raw = model.lookup_grad().clone()
            pre.step()
        grads[one_hot] = (raw, model.lookup_grad().clone(), model.head.weight.grad.clone())
    (raw, embedded, head), (raw_twin, linear, head_twin) = grads[False], grads[True]
    torch.testing.assert_close(raw, raw_twin, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(embedded, raw)  # preconditioning did something
    torch.testing.assert_close(embedded, linear, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(head, head_twin, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_padding_and_unseen_tokens_keep_a_zero_gradient_row(
    method: str, dtype: torch.dtype, device: str
) -> None:
    # Tokens 0 (padding), 1 and 2 ten times each, 3-6 never: A's eigenvalues tie, the case
    # where an eigensolver could return a basis that mixes the tokens' rows. Several steps
    # (running averages) with KL clipping.
    model = Tagger(one_hot=False, padding_idx=0).to(device, dtype)
    exact = {**EXACT, "factor_dtype": dtype, "inv_dtype": dtype, "kl_clip": 0.01}
    pre = dkfac.KFACPreconditioner(model, inverse_method=method, blocks=BLOCKS, **exact)
    x = torch.tensor([0, 1, 2] * 10, device=device).reshape(5, 6)
    y = torch.arange(30, device=device).reshape(5, 6) % CLASSES
    for _ in range(3):
        model.zero_grad()
        F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
        pre.step()
        grad = model.embedding.weight.grad
        for row in (0, 3, 4, 5, 6):
            assert torch.equal(grad[row], torch.zeros_like(grad[row])), row
        assert bool((grad[1:3] != 0).all())


class LearnedPositions(nn.Embedding):
    """An embedding that derives the positions it looks up from its input (BART's kind)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(ids.shape[-1]).expand_as(ids))


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (nn.Embedding(VOCAB, DIM, sparse=True), r"an embedding with sparse=True is not supported"),
        (nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True), r"an embedding with scale_grad_by_fr"),
        (LearnedPositions(VOCAB, DIM), r"LearnedPositions computes its own lookup"),
    ],
)
def test_embeddings_kfac_cannot_precondition_exactly_are_refused(
    module: nn.Embedding, message: str
) -> None:
    model = nn.Sequential(module, nn.Linear(DIM, 2))
    with pytest.raises(ValueError, match=rf"layer '0' \({type(module).__name__}\): {message}"):
        dkfac.KFACPreconditioner(model, blocks=BLOCKS)
    if isinstance(module, LearnedPositions):  # not asked for: another layer type, skipped
        pre = dkfac.KFACPreconditioner(model)
        assert {s.name: s.reason for s in pre.skipped} == {"0": "unsupported type"}
    else:  # not asked for: kept to its plain gradient, with the reason
        pre = dkfac.KFACPreconditioner(model)
        (entry,) = pre.skipped
        assert entry.name == "0" and re.search(f"not preconditioned: {message}", entry.reason)


def test_a_vocabulary_above_max_factor_dim_is_kept_a_wide_embedding_and_a_tied_one_skipped() -> (
    None
):
    # A is a vector of the vocabulary's size: max_factor_dim bounds only G.
    pre = dkfac.KFACPreconditioner(
        nn.Sequential(nn.Embedding(50, DIM), nn.Linear(DIM, 3)), max_factor_dim=40, blocks=BLOCKS
    )
    assert [layer.name for layer in pre.layers] == ["0", "1"]
    assert pre.layers[0].factors["a"].zeros(torch.device("cpu")).shape == (50,)
    assert "diag(50)" in repr(pre)
    pre = dkfac.KFACPreconditioner(
        nn.Sequential(nn.Embedding(5, 50), nn.Linear(50, 3), nn.Linear(3, 2)),
        max_factor_dim=40,
        blocks=BLOCKS,
    )
    assert [layer.name for layer in pre.layers] == ["2"]
    assert "factor side 50 > max_factor_dim=40" in repr(pre)
    tied = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB), nn.Linear(VOCAB, 2))
    tied[1].weight = tied[0].weight  # GPT-2's LM head and token embedding share one weight
    pre = dkfac.KFACPreconditioner(tied, blocks=BLOCKS)
    assert [layer.name for layer in pre.layers] == ["2"]
    assert "parameter shared with '1'" in repr(pre)


def test_a_frozen_layer_kfac_could_not_precondition_is_skipped_not_refused() -> None:
    frozen = nn.Embedding(VOCAB, DIM, sparse=True).requires_grad_(False)
    grouped = nn.Conv1d(DIM, DIM, 1, groups=2).requires_grad_(False)
    model = nn.Sequential(frozen, nn.Linear(DIM, DIM), grouped)
    pre = dkfac.KFACPreconditioner(model, blocks=BLOCKS)
    assert [layer.name for layer in pre.layers] == ["1"]
    assert {s.name: s.reason for s in pre.skipped} == {
        "0": "parameters do not require grad",
        "2": "parameters do not require grad",
    }


def embedding_run(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict]:
    """One (1,1) step of each config on this rank's tokens; its communication and factors."""
    out = []
    for config in configs:
        model = Tagger(one_hot=False).float()
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = dkfac.KFACPreconditioner(ddp, blocks=BLOCKS, lr=0.1, **config)
        x, y = tokens(rank), tokens(rank + 10) % CLASSES
        F.cross_entropy(ddp(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
        pre.step()
        out.append({"comm": pre.comm_stats(), "factors": pre.factors()})
        pre.remove()
    return out


def test_real_runs_send_the_bytes_the_dry_run_counts_for_a_diagonal_factor() -> None:
    # The communicator and the dry run agree on a vector factor (sent whole, no eigenvectors).
    configs: list[dict[str, Any]] = [
        {"strategy": "dkfac", "inverse_method": "eigen"},
        {"strategy": "dkfac", "inverse_method": "inverse"},
        {"strategy": "kaisa", "grad_worker_fraction": 0.5},
        {"strategy": "dp"},
    ]
    results = run_workers(embedding_run, 2, args=(configs,), timeout=120)
    shapes = layer_shapes_of(Tagger(one_hot=False), BLOCKS)
    assert shapes[0].a_dim == VOCAB and isinstance(shapes[0].a_dim, DiagonalSide)
    for index, config in enumerate(configs):
        method = config.get("inverse_method", "eigen")
        settings = DryRunSettings(2, inverse_method=method)
        fraction = config.get("grad_worker_fraction", 1.0)
        accounts = account_strategy(
            config["strategy"], shapes, settings, grad_worker_fraction=fraction
        )
        for rank in range(2):
            # Less the first step's one-off check of which layers ran (not K-FAC's traffic).
            comm = results[rank][index]["comm"]
            kfac = {key: value for key, value in comm.items() if not key.startswith("layer_usage")}
            assert kfac == accounts[rank].comm, (config, rank)
        if config["strategy"] != "dp":  # an embedding's A arrives as its averaged counts
            a, _ = results[0][index]["factors"]["embedding"]
            counts = sum(torch.bincount(tokens(r).reshape(-1), minlength=VOCAB) for r in range(2))
            torch.testing.assert_close(a, counts.float() / counts.sum(), rtol=1e-6, atol=0)


def test_a_state_saved_without_embeddings_says_how_to_load_it() -> None:
    # A state from before embeddings were preconditioned by default has no entry for them.
    old = dkfac.KFACPreconditioner(Tagger(one_hot=False), skip_layers=("Embedding",), **EXACT)
    state = old.state_dict()
    with pytest.raises(ValueError, match=r"missing \['embedding'\].*skip_layers=\('Embedding',\)"):
        dkfac.KFACPreconditioner(Tagger(one_hot=False), **EXACT).load_state_dict(state)
    again = dkfac.KFACPreconditioner(Tagger(one_hot=False), skip_layers=("Embedding",), **EXACT)
    again.load_state_dict(state)
