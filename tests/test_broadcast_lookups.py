"""Embeddings looked up once and broadcast over the batch are found and passed through.

An embedding's factors are exact only when its ids hold one row per example along dim 0.
Hugging Face models look position embeddings up once, with ids ``(1, T)`` (or ``(T,)``), and
broadcast them over the batch: the layer's output gradient is then the examples' sum, from
which no exact factor exists. dkfac finds such a layer at the first factor update whose passes
can tell (its ids' dim 0 differs from the model input's) and passes its gradient through.

Oracles: the same run with the layer skipped by name (``skip_layers``), which must give the
same parameters, and the plain gradient (passed through) for the layer itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.broadcast_check import PER_EXAMPLE_WINDOWS, UNDECIDED_WINDOWS

DT = torch.float64
VOCAB, DIM, CLASSES, T = 9, 4, 3, 6
EXACT: dict[str, Any] = {"factor_dtype": DT, "inv_dtype": DT, "lr": 0.1, "kl_clip": 0.01}
BROADCAST = "passed through: looked up once and broadcast over the batch"


class PositionalTagger(nn.Module):
    """Token plus position embeddings and a head; positions looked up as ``mode`` says.

    ``"expanded"``: ids ``(N, T)`` (one row per token of every example, exact);
    ``"batch1"``: ids ``(1, T)`` broadcast; ``"flat"``: ids ``(T,)`` broadcast.
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(T, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.shape
        ids = torch.arange(t)
        if self.mode == "expanded":
            ids = ids.expand(n, t)
        elif self.mode == "batch1":
            ids = ids.unsqueeze(0)
        return self.head(torch.tanh(self.tokens(x) + self.positions(ids)))


def batch(seed: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(
        0, CLASSES, (n, T), generator=g
    )


def train(
    mode: str, sizes: list[int], **options: Any
) -> tuple[list[torch.Tensor], list[str], dkfac.KFACPreconditioner]:
    """Steps of SGD under K-FAC, one batch of each size: parameters, K-FAC's warnings."""
    model = PositionalTagger(mode).to(DT)
    pre = dkfac.KFACPreconditioner(model, **EXACT, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for seed, n in enumerate(sizes):
        opt.zero_grad()
        x, y = batch(seed, n)
        F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        messages += [str(w.message) for w in caught if "K-FAC" in str(w.message)]
        opt.step()
    return [p.detach().clone() for p in model.parameters()], messages, pre


@pytest.mark.parametrize("mode", ["batch1", "flat"])
def test_a_broadcast_lookup_passes_through_as_if_skipped(mode: str) -> None:
    params, messages, pre = train(mode, [5, 5, 5])
    assert "positions" in [layer.name for layer in pre.layers]  # built, then found out
    assert len(messages) == 1 and "'positions' (Embedding)" in messages[0]
    assert BROADCAST in repr(pre)
    skipped, _, _ = train(mode, [5, 5, 5], skip_layers=["^positions$"])
    for got, want in zip(params, skipped, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    # Its own gradient passes through from the first step on (the first window's factors,
    # captured before it could be told, are never used).
    model = PositionalTagger(mode).to(DT)
    pre = dkfac.KFACPreconditioner(model, **EXACT)
    x, y = batch(0)
    F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
    before = model.positions.weight.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    assert torch.equal(model.positions.weight.grad, before)


def test_positions_looked_up_per_example_are_preconditioned() -> None:
    params, messages, pre = train("expanded", [5, 5])
    assert messages == [] and BROADCAST not in repr(pre)
    skipped, _, _ = train("expanded", [5, 5], skip_layers=["^positions$"])
    assert not torch.allclose(params[1], skipped[1])  # the positions were preconditioned


class FlatHeadTagger(nn.Module):
    """Tokens embedded per example, the head on flattened ``(N·T, D)`` rows, sequence-first
    layers in between: the layers' dim 0 is not the batch's, the embedding's is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.tokens(x).transpose(0, 1)))  # (T, N, D)
        return self.head(h.transpose(0, 1).reshape(-1, DIM))


def test_layers_that_see_other_rows_do_not_make_an_embedding_look_broadcast() -> None:
    model = FlatHeadTagger().to(DT)
    pre = dkfac.KFACPreconditioner(model, **EXACT)
    x, y = batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no broadcast warning
        F.cross_entropy(model(x), y.reshape(-1)).backward()
        pre.step()
    assert BROADCAST not in repr(pre) and pre.layers[0].inverse is not None


def restored_step(options: dict[str, Any]) -> tuple[list[torch.Tensor], dkfac.KFACPreconditioner]:
    """Three (1,1) steps, then the state loaded with (2,2) and one more step at step 3.

    Step 3 is no factor update: nothing is decided there, so what was saved must hold.
    """
    _, _, pre = train("batch1", [5, 5, 5], **options)
    model = PositionalTagger("batch1").to(DT)
    restored = dkfac.KFACPreconditioner(
        model, **EXACT, **options, factor_update_steps=2, inv_update_steps=2
    )
    restored.load_state_dict(pre.state_dict())
    x, y = batch(7)
    F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
    restored.step()
    return [p.grad.clone() for p in model.parameters()], restored


def test_a_broadcast_layer_keeps_no_factors_and_its_decision_is_restored() -> None:
    _, _, pre = train("batch1", [5, 5])
    positions = next(layer for layer in pre.layers if layer.name == "positions")
    assert positions.factor("a") is None and positions.inverse is None
    assert pre.state_dict()["layer_usage"]["broadcast_check"]["broadcast"] == ["positions"]
    # Restored, it passes through at once: the KL clipping of the other layers is the
    # skipped layer's run's (its plain gradient would otherwise enter the clip's sum).
    grads, restored = restored_step({})
    skipped, _ = restored_step({"skip_layers": ["^positions$"]})
    assert BROADCAST in repr(restored)
    for got, want in zip(grads, skipped, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_the_check_decides_each_embedding_and_then_stops_asking() -> None:
    # Per-example lookups are trusted after PER_EXAMPLE_WINDOWS windows that could tell; a
    # broadcast one at the first window that shows it.
    _, _, pre = train("batch1", [5] * PER_EXAMPLE_WINDOWS)
    assert pre._usage.broadcast == {"positions"} and pre._usage.per_example == {"tokens"}
    _, _, pre = train("expanded", [5] * (PER_EXAMPLE_WINDOWS - 1))
    assert pre._usage.per_example == set()  # not yet
    _, _, pre = train("expanded", [5] * PER_EXAMPLE_WINDOWS)
    assert pre._usage.per_example == {"tokens", "positions"} and pre._usage.broadcast == set()


class DictTagger(PositionalTagger):
    """The batch arrives as a dict (as a Trainer passes it), positions broadcast."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["input_ids"])


def test_the_batch_is_found_inside_a_dict_and_silence_is_reported() -> None:
    model = DictTagger("batch1").to(DT)
    pre = dkfac.KFACPreconditioner(model, **EXACT)
    x, y = batch(0)
    F.cross_entropy(model({"input_ids": x}).reshape(-1, CLASSES), y.reshape(-1)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    assert BROADCAST in repr(pre)
    # One example in every pass tells nothing: after UNDECIDED_WINDOWS windows it says so.
    _, messages, _ = train("batch1", [1] * UNDECIDED_WINDOWS)
    assert [m for m in messages if "cannot tell whether layer 'positions'" in m]
    _, messages, _ = train("batch1", [1] * (UNDECIDED_WINDOWS - 1))
    assert messages == []


def test_one_example_everywhere_tells_nothing_until_a_larger_batch_does() -> None:
    # With one example a broadcast sums one gradient (exact): undecided, preconditioned.
    _, messages, pre = train("batch1", [1, 1])
    assert messages == [] and BROADCAST not in repr(pre)
    _, messages, pre = train("batch1", [1, 5, 5])
    assert len(messages) == 1 and BROADCAST in repr(pre)


def ranks_run(rank: int, world_size: int, strategy: str, method: str) -> dict[str, Any]:
    """Rank 0 sees one example (it cannot tell), rank 1 five: the ranks must agree."""
    model = PositionalTagger("batch1").to(DT)
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, inverse_method=method, **EXACT)
    x, y = batch(rank, 1 if rank == 0 else 5)
    before = model.positions.weight.detach().clone()
    F.cross_entropy(ddp(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    grad = model.positions.weight.grad.clone()
    out = {"before": before, "grad": grad, "repr": repr(pre)}
    pre.remove()
    return out


def plain_gradient(rank: int) -> torch.Tensor:
    """The positions' gradient of ``rank``'s loss alone, in one process."""
    model = PositionalTagger("batch1").to(DT)
    x, y = batch(rank, 1 if rank == 0 else 5)
    F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
    return model.positions.weight.grad.clone()


@pytest.mark.parametrize(
    ("strategy", "method"),
    [("dkfac", "eigen"), ("kaisa", "eigen"), ("spd", "eigen"), ("pad", "inverse"), ("dp", "eigen")],
)
def test_the_ranks_agree_when_only_one_can_tell(strategy: str, method: str) -> None:
    results = run_workers(ranks_run, 2, args=(strategy, method), timeout=120)
    averaged = (plain_gradient(0) + plain_gradient(1)) / 2  # what DDP hands K-FAC
    for out in results:
        assert BROADCAST in out["repr"]
        torch.testing.assert_close(out["grad"], averaged, rtol=1e-12, atol=1e-14)
