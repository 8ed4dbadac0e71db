"""Factors estimated from part of each batch (``statistics_fraction``) against float64 oracles.

The oracle is :func:`test_oracle_numerics.oracle_layer_factors` (explicit patches, per-example
output gradients from ``torch.func``) applied to the examples the fraction keeps: the first
``⌈f·N⌉`` of each call. The gradient itself stays the whole batch's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.curvature.blocks import FactorStatistic, LinearBlock
from dkfac.curvature.statistics import kept_examples, whole_call_estimate
from test_oracle_numerics import (
    DT,
    assert_close,
    assert_factors,
    assert_one_step,
    batch_loss,
    conv_batch,
    grad_matrix,
    kfac_layers,
    make_pre,
    oracle_layer_factors,
    sgd_,
    small_conv_model,
)


def test_kept_examples_and_the_estimate_of_the_whole_call() -> None:
    assert [kept_examples(n, 0.3) for n in (1, 8, 10, 30)] == [1, 3, 3, 9]
    assert kept_examples(30, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floating point
    assert kept_examples(7, 1.0) == 7 and kept_examples(7, 1e-9) == 1
    part = FactorStatistic(torch.ones(2, 2), rows=3 * 5, examples=3)  # 5 rows per example
    whole, weight = whole_call_estimate(part, examples=8, kept=3)
    assert (whole.rows, whole.examples, weight) == (8 * 5, 8, 8 / 3)
    assert whole_call_estimate(part, examples=3, kept=3) == (part, 1.0)
    with pytest.raises(RuntimeError, match="same rows per example"):
        whole_call_estimate(part._replace(rows=16), examples=8, kept=3)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_factors_come_from_the_kept_examples_and_precondition_the_whole_gradient(
    reduction: str,
) -> None:
    torch.manual_seed(21)
    gen = torch.Generator().manual_seed(21)
    model = small_conv_model()
    x, t = conv_batch(8, gen)  # fraction 0.3 keeps the first 3 examples of 8
    expected = {str(i): oracle_layer_factors(model, i, x[:3], t[:3]) for i in kfac_layers(model)}
    assert_one_step(model, x, t, expected, reduction=reduction, statistics_fraction=0.3)


@pytest.mark.parametrize(("sizes", "reduction"), [((8, 8), "mean"), ((8, 3), "sum")])
def test_accumulated_micro_batches_each_stand_for_their_whole_batch(
    sizes: tuple[int, int], reduction: str
) -> None:
    # At f = 0.3 a micro-batch of 8 keeps 3, one of 3 keeps 1. Each kept sum, weighted by
    # N_i/k_i, estimates its micro-batch's, so the factors are the N_i-weighted means of the
    # oracle's factors of the kept parts (rows per example alike). Equal micro-batches with a
    # mean loss: the oracle on all kept examples at once; uneven ones with a summed loss (a
    # mean over micro-batches of unequal size is not the mean over their examples).
    torch.manual_seed(22)
    gen = torch.Generator().manual_seed(22)
    model = small_conv_model()
    batches = [conv_batch(n, gen) for n in sizes]
    kept = [(x[: kept_examples(len(x), 0.3)], t[: kept_examples(len(x), 0.3)]) for x, t in batches]
    expected = {}
    for i in kfac_layers(model):
        factors = [oracle_layer_factors(model, i, x, t) for x, t in kept]
        a = sum(n * a for (a, _), n in zip(factors, sizes, strict=True)) / sum(sizes)
        g = sum(n * g for (_, g), n in zip(factors, sizes, strict=True)) / sum(sizes)
        expected[str(i)] = (a, g)
    pre = make_pre(model, accumulation_steps=2, loss_reduction=reduction, statistics_fraction=0.3)
    for x, t in batches:
        scale = 2 if reduction == "mean" else 1
        (batch_loss(model(x), t, reduction) / scale).backward()
    pre.step()
    assert_factors(pre, expected)


def test_an_embeddings_diagonal_a_counts_every_token() -> None:
    # A of an embedding is token counts: from part of a call, a token only in the other part
    # would count 0 while its row has a gradient. Its A comes from the whole call, G from part.
    torch.manual_seed(27)
    embedding = nn.Embedding(6, 3).to(DT)
    model = nn.Sequential(embedding, nn.Flatten(), nn.Linear(12, 2)).to(DT)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1], [2, 2, 3, 3], [5, 4, 3, 2]])
    t = torch.randn(4, 2, dtype=DT)
    pre = make_pre(model, statistics_fraction=0.5)
    batch_loss(model(ids), t).backward()
    pre.step()
    counts = torch.bincount(ids.flatten(), minlength=6).to(DT) / ids.numel()
    assert_close(pre.factors()["0"][0], counts, what="diagonal A of the embedding")


def test_a_transformer_shaped_input_keeps_whole_sequences() -> None:
    # (N, T, d): the first k examples with all their positions; the oracle's rows likewise.
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, t = torch.randn(6, 7, 5, dtype=DT), torch.randn(6, 7, 3, dtype=DT)
    expected = {str(i): oracle_layer_factors(model, i, x[:2], t[:2]) for i in (0, 2)}
    pre = make_pre(model, statistics_fraction=1 / 3)
    batch_loss(model(x), t).backward()
    pre.step()
    assert_factors(pre, expected)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), "half"])
def test_a_fraction_outside_zero_to_one_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="statistics_fraction"):
        dkfac.KFACPreconditioner(nn.Linear(3, 2), statistics_fraction=bad)  # type: ignore[arg-type]


def test_a_compiled_model_is_refused() -> None:
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 2)), backend="eager")
    with pytest.raises(ValueError, match="not allowed with a compiled model"):
        dkfac.KFACPreconditioner(compiled, statistics_fraction=0.5)


class Transposing(nn.Linear):
    """A user's layer whose output holds the examples along dim 1 (registered as a Linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).t()


def test_a_layer_whose_output_does_not_keep_the_examples_along_dim_0_is_refused() -> None:
    layer = Transposing(4, 3)
    pre = dkfac.KFACPreconditioner(
        layer, statistics_fraction=0.5, blocks={Transposing: LinearBlock}
    )
    with pytest.raises(RuntimeError, match="keep its examples along dim 0"):
        layer(torch.randn(5, 4))
    pre.remove()


def test_an_unbatched_call_is_one_example_and_kept_whole() -> None:
    # Linear(4, 4) on a vector: dim 0 holds features, not examples; nothing is cut.
    torch.manual_seed(28)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    twin = copy.deepcopy(model)
    x, t = torch.randn(4, dtype=DT), torch.randn(2, dtype=DT)
    part, whole = make_pre(model, statistics_fraction=0.5), make_pre(twin)
    for net, pre in ((model, part), (twin, whole)):
        (0.5 * (net(x) - t).pow(2).sum()).backward()
        pre.step()
    for name, (a, g) in whole.factors().items():
        assert torch.equal(part.factors()[name][0], a) and torch.equal(part.factors()[name][1], g)


def ranks_refuse(rank: int, world_size: int) -> bool:
    """DP-KFAC: one owner captures the layer, but every rank must refuse its forward."""
    layer = Transposing(4, 3)
    ddp = nn.parallel.DistributedDataParallel(layer)
    pre = dkfac.KFACPreconditioner(
        ddp, strategy="dp", statistics_fraction=0.5, blocks={Transposing: LinearBlock}
    )
    try:
        ddp(torch.randn(5, 4)).sum().backward()
    except RuntimeError as error:
        refused = "keep its examples along dim 0" in str(error)
    else:
        refused = False
    pre.remove()
    return refused


def test_every_rank_refuses_not_only_the_layers_owner() -> None:
    assert run_workers(ranks_refuse, 2, timeout=60) == [True, True]


class SequenceFirst(nn.Module):
    """Runs its Linear on ``(T, N, d)``, as ``batch_first=False`` Transformer layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.transpose(0, 1)).transpose(0, 1)


def test_a_sequence_first_layer_is_warned_about() -> None:
    model = SequenceFirst()
    pre = dkfac.KFACPreconditioner(model, statistics_fraction=0.5)
    with pytest.warns(UserWarning, match="sequence-first layer"):
        model(torch.randn(4, 6, 3)).sum().backward()
    pre.step()
    pre.remove()


STRATEGIES = [("dkfac", "eigen"), ("kaisa", "eigen"), ("spd", "eigen"), ("pad", "inverse")]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return conv_batch(16, torch.Generator().manual_seed(100 + step))


def _directions(model: nn.Sequential) -> list[torch.Tensor]:
    return [grad_matrix(model[i]) for i in kfac_layers(model)]


def ranks_train(rank: int, world_size: int) -> dict[str, Any]:
    """Every strategy, fraction 0.3, two steps on this rank's half of each global batch."""
    out: dict[str, Any] = {}
    for strategy, method in [*STRATEGIES, ("dp", "eigen")]:
        torch.manual_seed(25)
        model = small_conv_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = make_pre(
            ddp, strategy=strategy, inverse_method=method, damping=0.02, statistics_fraction=0.3
        )
        out[strategy] = []
        for step in range(2):
            x, t = _batch(step)
            mine = slice(rank * 8, rank * 8 + 8)
            batch_loss(ddp(x[mine]), t[mine]).backward()
            pre.step()
            out[strategy].append(_directions(model) if strategy != "dp" else pre.factors())
            sgd_(model)
        pre.remove()
    return out


def test_every_strategy_on_two_workers_keeps_each_workers_first_examples() -> None:
    got = run_workers(ranks_train, 2, timeout=180)
    # The one-process equivalent: the two halves as two accumulated micro-batches, each
    # keeping its own first 3 examples (itself checked against the oracle above).
    for strategy, method in STRATEGIES:
        torch.manual_seed(25)
        model = small_conv_model()
        pre = make_pre(
            model,
            inverse_method=method,
            damping=0.02,
            accumulation_steps=2,
            statistics_fraction=0.3,
        )
        for step in range(2):
            x, t = _batch(step)
            for half in (slice(0, 8), slice(8, 16)):
                (batch_loss(model(x[half]), t[half]) / 2).backward()
            pre.step()
            for rank in (0, 1):
                for index, (mine, want) in enumerate(
                    zip(got[rank][strategy][step], _directions(model), strict=True)
                ):
                    what = f"{strategy}, rank {rank}, step {step}, layer {index}"
                    assert_close(mine, want, rtol=1e-9, what=what)
            sgd_(model)
    # DP-KFAC: a layer's owner builds its factors from its own shard, here its first 3.
    torch.manual_seed(25)
    model, (x, t) = small_conv_model(), _batch(0)
    held = 0
    for rank in (0, 1):
        shard_x, shard_t = x[rank * 8 : rank * 8 + 3], t[rank * 8 : rank * 8 + 3]
        for name, (a, g) in got[rank]["dp"][0].items():
            want_a, want_g = oracle_layer_factors(model, int(name), shard_x, shard_t)
            assert_close(a, want_a, what=f"dp A of {name} on rank {rank}")
            assert_close(g, want_g, what=f"dp G of {name} on rank {rank}")
            held += 1
    assert held == len(kfac_layers(model))
