"""Layers that run several times per forward pass, and windows of irregular length.

* The single-worker convention (docs/math.md, "Layers used several times") against a float64
  oracle written here: inputs and per-example output gradients of every use, taken with
  autograd on a deep copy, one example at a time.
* Every strategy against ``strategy="local"`` on the global batch (float64, 1e-10; DP-KFAC
  against local on each owner's shard), at P = 2 and 3, both inverse methods: a Linear called
  twice, a conv in two branches, a 5-step weight-tied loop, an embedding (its diagonal ``A``
  through every strategy's communication), each with regular windows and
  with more and fewer backward passes than ``accumulation_steps``.
* A layer whose forward runs on a worker that gets no gradient for it: every strategy pools
  ``A`` over the workers whose forward ran and ``G`` over those with a gradient.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import dkfac
from distributed_harness import run_workers
from dkfac.comm import ClusterCostModel
from dkfac.comm.cost_model import AlphaBeta, CubicCost
from dkfac.curvature import EmbeddingBlock
from dynamo_trouble import dynamo_trouble
from test_oracle_numerics import assert_close, conv_patches

DT = torch.float64
#: Float64 factors, and embeddings preconditioned (they are on request).
F64 = {"factor_dtype": DT, "inv_dtype": DT, "blocks": {nn.Embedding: EmbeddingBlock}}
LOCAL_BATCH = 3
COST = ClusterCostModel(AlphaBeta(alpha=1e-3, beta=1e-8), CubicCost(c0=0.0, c3=5e-9))


class LinearTwice(nn.Module):
    """``shared`` runs twice in every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        h = torch.tanh(self.shared(h))
        return self.head(torch.tanh(self.shared(h)) + h)


class ConvBranches(nn.Module):
    """One conv applied to two branches of the input (a mirrored copy)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 2 * 2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 3, 2, 2)
        h = torch.relu(self.conv(x)) + torch.tanh(self.conv(x.flip(-1)))
        return self.head(h.flatten(1))


class TiedLoop(nn.Module):
    """A recurrent cell: ``cell`` runs five times per forward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, 5)
        self.cell = nn.Linear(5, 5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        for _ in range(5):
            h = torch.tanh(self.cell(h)) + 0.5 * h
        return self.head(h)


class CheckpointedLoop(TiedLoop):
    """``TiedLoop`` with each step of the loop under activation checkpointing (as ALBERT-like
    models with gradient checkpointing run a shared block): the segment is recomputed in
    backward, where the reentrant variant makes its only capture."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def step(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.cell(h)) + 0.5 * h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        for _ in range(5):
            h = checkpoint(self.step, h, use_reentrant=self.reentrant)
        return self.head(h)


class TokenBag(nn.Module):
    """An embedding of ids made from the inputs (ids repeat within and across examples)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(8, 5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.flatten(1) * 2).floor().clamp(-4, 3).long() + 4
        return self.head(torch.tanh(self.embed(ids)).mean(1))


MODELS = {"twice": LinearTwice, "branches": ConvBranches, "loop": TiedLoop, "embedding": TokenBag}
#: The same parameters and function as "loop", recomputed in backward.
CHECKPOINTED = {
    "loop-checkpointed": lambda: CheckpointedLoop(reentrant=False),
    "loop-checkpointed-reentrant": lambda: CheckpointedLoop(reentrant=True),
}


def build_model(name: str) -> nn.Module:
    return {**MODELS, **CHECKPOINTED}[name]().double()


#: Backward passes of each window; ``accumulation_steps`` is 1 (regular) or 2 (mismatched:
#: one window has fewer passes than configured, one more).
SCHEDULES: dict[str, tuple[int, list[int]]] = {
    "regular": (1, [1, 1, 1, 1]),
    "mismatched": (2, [2, 3, 1, 2]),
}


def windows_of(config: dict[str, Any]) -> tuple[int, list[int]]:
    """``accumulation_steps`` and passes per window of ``config``.

    DP-KFAC runs one window (three passes for "mismatched"): after it, its trajectory (global
    gradients preconditioned with each owner's shard factors) is no single-process run's, so
    its factors are compared with local K-FAC on the owner's shard where both start alike.
    """
    accumulation, windows = SCHEDULES[config["schedule"]]
    if config.get("strategy") == "dp":
        return accumulation, [3 if config["schedule"] == "mismatched" else 1]
    return accumulation, windows


def window_batch(window: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * window + micro)
    n = LOCAL_BATCH * world_size
    return torch.randn(n, 12, generator=g, dtype=DT), torch.randint(0, 4, (n,), generator=g)


def shard(tensor: torch.Tensor, rank: int | None) -> torch.Tensor:
    if rank is None:
        return tensor
    return tensor[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def train_windows(
    model: nn.Module,
    pre: dkfac.KFACPreconditioner,
    windows: list[int],
    world_size: int,
    rank: int | None,
) -> None:
    """One optimizer step per window; every micro-batch's loss divided by the window's passes.

    ``rank`` None: the global batch in one process; otherwise this rank's shard under DDP
    (gradients averaged at the last micro-batch only).
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window, passes in enumerate(windows):
        opt.zero_grad()
        for micro in range(passes):
            x, y = window_batch(window, micro, world_size)
            x, y = shard(x, rank), shard(y, rank)
            last = micro == passes - 1
            no_sync = getattr(model, "no_sync", None)
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / passes).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        # Passes, not calls, are counted: a shared layer's uses never look like a mismatch,
        # and the first real one is reported (once per run).
        configured = pre.config.accumulation_steps
        first_mismatch = passes != configured and all(p == configured for p in windows[:window])
        reported = any("backward pass(es)" in str(w.message) for w in caught)
        captures = any(pre._strategy.captures(layer) for layer in pre.layers)  # not DP's idle rank
        assert reported == (first_mismatch and captures), (window, passes)
        assert not any("no factor statistics" in str(w.message) for w in caught)
        opt.step()


def held_factors(pre: dkfac.KFACPreconditioner) -> dict[str, torch.Tensor]:
    """Every running factor this worker holds, by ``layer/side``."""
    return {
        f"{layer.name}/{side}": factor.clone()
        for layer in pre.layers
        for side in ("a", "g")
        if (factor := layer.factor(side)) is not None
    }


def local_run(
    config: dict[str, Any], world_size: int, rank: int | None = None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``strategy="local"`` on the global batch (or on ``rank``'s shard alone)."""
    accumulation, windows = windows_of(config)
    model = build_model(config["model"])
    pre = dkfac.KFACPreconditioner(
        model, inverse_method=config["method"], accumulation_steps=accumulation, **F64
    )
    train_windows(model, pre, windows, world_size, rank)
    return [p.detach().clone() for p in model.parameters()], held_factors(pre)


def strategy_options(strategy: str, world_size: int) -> dict[str, Any]:
    if strategy == "kaisa":
        return {"grad_worker_fraction": 1 / world_size}
    if strategy in ("spd", "pad"):
        # profile_steps=2: the fusion is re-planned from measured ready times mid-run.
        return {"cost_model": COST, "profile_steps": 2}
    return {}


def distributed_run(
    rank: int, world_size: int, configs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        accumulation, windows = windows_of(config)
        model = build_model(config["model"])
        # DDP needs a static graph to see a parameter used in several reentrant backwards.
        static = config["model"].endswith("reentrant")
        if config.get("compiled"):  # inside DDP: DDP's own forward breaks a graph around it
            torch._dynamo.reset()
            counters.clear()
            model = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]
        ddp = nn.parallel.DistributedDataParallel(model, static_graph=static)
        pre = dkfac.KFACPreconditioner(
            ddp,
            strategy=config["strategy"],
            inverse_method=config["method"],
            accumulation_steps=accumulation,
            **strategy_options(config["strategy"], world_size),
            **F64,
        )
        train_windows(ddp, pre, windows, world_size, rank)
        out.append(
            {
                "params": [p.detach().clone() for p in model.parameters()],
                "factors": held_factors(pre),
                "plan": pre.plan(),
                "dynamo_trouble": dynamo_trouble(),
            }
        )
        pre.remove()
    return out


def shared_configs(world_size: int) -> list[dict[str, Any]]:
    return [
        {"strategy": strategy, "method": method, "model": model, "schedule": schedule}
        for strategy in ("dkfac", "kaisa", "spd", "pad", "dp")
        for method in ("eigen", "inverse")
        for model in MODELS
        for schedule in SCHEDULES
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_strategy_equals_local_on_the_global_batch_with_shared_layers(
    world_size: int,
) -> None:
    configs = shared_configs(world_size)
    results = run_workers(distributed_run, world_size, args=(configs,), timeout=280)
    assert_each_equals_local(configs, results, world_size)


def test_compiled_models_equal_local_on_the_global_batch_without_graph_breaks() -> None:
    """``DDP(torch.compile(model))`` (aot_eager) at P = 2: the compiled hooks' statistics, added
    at ``step()`` (docs/architecture.md), give every strategy the eager ``local`` run's factors
    and parameters; TorchDynamo breaks no graph in dkfac's hooks."""
    configs = [
        {"strategy": "dkfac", "method": "eigen", "model": "twice", "schedule": "regular"},
        {"strategy": "kaisa", "method": "inverse", "model": "embedding", "schedule": "regular"},
        {"strategy": "spd", "method": "eigen", "model": "twice", "schedule": "mismatched"},
        {"strategy": "pad", "method": "eigen", "model": "branches", "schedule": "regular"},
        {"strategy": "dp", "method": "eigen", "model": "loop", "schedule": "regular"},
    ]
    configs = [{**config, "compiled": True} for config in configs]
    results = run_workers(distributed_run, 2, args=(configs,), timeout=200)
    assert_each_equals_local(configs, results, 2)
    for rank in range(2):
        for config, result in zip(configs, results[rank], strict=True):
            assert result["dynamo_trouble"] == {}, (config, rank)


def assert_each_equals_local(
    configs: list[dict[str, Any]], results: list[list[dict[str, Any]]], world_size: int
) -> None:
    """Each config's parameters and factors on every rank equal ``local``'s (DP: on a shard)."""
    for index, config in enumerate(configs):
        label = f"{config} P={world_size}"
        if config["strategy"] == "dp":
            # DP-KFAC: each layer's factors are local K-FAC on its owner's shard alone.
            owners = {f["layer"]: f["decomposed_by"] for f in results[0][index]["plan"]["factors"]}
            shards = {rank: local_run(config, world_size, rank)[1] for rank in set(owners.values())}
            for rank in range(world_size):
                got = results[rank][index]["factors"]
                mine = shards.get(rank, {})  # a rank may own no layer
                want = {k: v for k, v in mine.items() if owners[k.split("/")[0]] == rank}
                assert got.keys() == want.keys(), label
                for key in want:
                    assert_close(got[key], want[key], what=f"{label} {key}")
            continue
        want_params, want_factors = local_run(config, world_size)
        held = set()
        for rank in range(world_size):
            got = results[rank][index]
            for param, want in zip(got["params"], want_params, strict=True):
                torch.testing.assert_close(param, want, rtol=0, atol=1e-10, msg=label)
            for key, factor in got["factors"].items():
                assert_close(factor, want_factors[key], what=f"{label} rank {rank} {key}")
            held |= set(got["factors"])
        assert held == set(want_factors), label  # every factor is somewhere


def test_checkpointed_segments_recomputed_in_backward_equal_the_plain_model() -> None:
    """Activation checkpointing, reentrant or not, at P = 2: every strategy's parameters and
    factors equal ``local`` on the plain (not checkpointed) model and the global batch."""
    configs = [
        {"strategy": strategy, "method": "eigen", "model": model, "schedule": schedule}
        for strategy in ("dkfac", "kaisa", "spd", "pad")
        for model in CHECKPOINTED
        for schedule in SCHEDULES
        # DDP's static graph, which reentrant checkpointing of a shared layer needs, does not
        # support no_sync (PyTorch asserts): gradient accumulation is DDP's limit there.
        if not (model.endswith("reentrant") and schedule != "regular")
    ]
    results = run_workers(distributed_run, 2, args=(configs,), timeout=200)
    for index, config in enumerate(configs):
        want_params, want_factors = local_run({**config, "model": "loop"}, 2)
        for rank in range(2):
            got = results[rank][index]
            for param, want in zip(got["params"], want_params, strict=True):
                torch.testing.assert_close(param, want, rtol=0, atol=1e-10, msg=str(config))
            for key, factor in got["factors"].items():
                assert_close(factor, want_factors[key], what=f"{config} rank {rank} {key}")


# -- the single-worker convention -------------------------------------------------------------
def oracle_factors(
    model: nn.Module, path: str, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of the layer at ``path``, used R times per pass, from every use of every example.

    ``A = Σ_{n,r,pos} ā āᵀ / (N·R·positions)`` with ``ā = [a, 1]``; ``G = (1/N) Σ_{n,r,pos}
    g gᵀ`` with ``g = dℓ_n/dy_{n,r}``, the gradient of example ``n``'s own loss with respect to
    the output of use ``r`` (K-FAC "expand"). A mean loss over the batch is assumed.
    """
    model = copy.deepcopy(model)
    layer = model.get_submodule(path)
    a_rows, g_rows = [], []
    for n in range(x.shape[0]):
        uses: list[tuple[torch.Tensor, torch.Tensor]] = []

        def keep(
            module: nn.Module,
            inputs: tuple[torch.Tensor, ...],
            output: torch.Tensor,
            uses: list[tuple[torch.Tensor, torch.Tensor]] = uses,
        ) -> None:
            output.retain_grad()
            uses.append((inputs[0].detach(), output))

        handle = layer.register_forward_hook(keep)
        loss = F.cross_entropy(model(x[n : n + 1]), y[n : n + 1], reduction="sum")
        handle.remove()
        loss.backward()
        for inp, out in uses:
            assert out.grad is not None
            if isinstance(layer, nn.Conv2d):
                patches = conv_patches(inp, layer)
                patches = patches.reshape(-1, patches.shape[-1])
                grads = out.grad.permute(0, 2, 3, 1).reshape(-1, out.shape[1])
            else:
                patches = inp.reshape(-1, inp.shape[-1])
                grads = out.grad.reshape(-1, out.shape[-1])
            a_rows.append(torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=DT)], dim=1))
            g_rows.append(grads)
    a, g = torch.cat(a_rows), torch.cat(g_rows)
    return a.t() @ a / a.shape[0], g.t() @ g / x.shape[0]


@pytest.mark.parametrize(
    ("model_name", "shared"),
    [
        ("twice", "shared"),
        ("branches", "conv"),
        ("loop", "cell"),
        ("loop-checkpointed", "cell"),
        ("loop-checkpointed-reentrant", "cell"),
    ],
)
def test_a_layer_used_several_times_per_pass_has_the_expand_factors(
    model_name: str, shared: str
) -> None:
    model = build_model(model_name)
    x, y = window_batch(0, 0, 2)
    pre = dkfac.KFACPreconditioner(model, **F64)
    F.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recomputed segment is no extra backward pass
        pre.step()  # the first fold is the window's factor itself
    plain = build_model(model_name.split("-")[0])  # the oracle runs no recomputation
    for name in (shared, "head"):  # "head" runs once: the ordinary factors
        want_a, want_g = oracle_factors(plain, name, x, y)
        got_a, got_g = pre.factors()[name]
        assert_close(got_a, want_a, what=f"{name} A")
        assert_close(got_g, want_g, what=f"{name} G")


# -- forward here, gradient elsewhere -----------------------------------------------------------
class SideBranch(nn.Module):
    """``side`` runs on every worker; only where ``use_side`` does its output reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(12, 5)
        self.side = nn.Linear(5, 4)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        side = self.side(h)
        return self.head(h) + (side if use_side else side.detach() * 0.0)


def side_branch_run(rank: int, world_size: int, strategies: list[str]) -> dict[str, Any]:
    out = {}
    x, y = window_batch(0, 0, world_size)
    for strategy in strategies:
        model = SideBranch().double()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        options = strategy_options(strategy, world_size)
        pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, **options, **F64)
        F.cross_entropy(ddp(shard(x, rank), use_side=rank == 0), shard(y, rank)).backward()
        pre.step()
        out[strategy] = held_factors(pre)
        pre.remove()
    return out


def side_oracle(world_size: int) -> dict[str, torch.Tensor]:
    """``side``'s factors: A over every worker's rows, G over the examples of rank 0 alone.

    Each worker's loss is the mean over its own examples (DDP averages them), so its
    per-example output gradient is ``dℓ_n/dy_n`` of that example's own loss.
    """
    model = SideBranch().double()
    x, y = window_batch(0, 0, world_size)
    a_rows, g_rows = [], []
    for rank in range(world_size):
        xs, ys = shard(x, rank), shard(y, rank)
        for n in range(xs.shape[0]):
            h = torch.tanh(model.body(xs[n : n + 1])).detach()
            a_rows.append(torch.cat([h, torch.ones(1, 1, dtype=DT)], dim=1))
            if rank == 0:
                side = model.side(h).detach().requires_grad_(True)
                loss = F.cross_entropy(model.head(h) + side, ys[n : n + 1], reduction="sum")
                (g,) = torch.autograd.grad(loss, side)
                g_rows.append(g)
    a, g = torch.cat(a_rows), torch.cat(g_rows)
    return {"side/a": a.t() @ a / a.shape[0], "side/g": g.t() @ g / g.shape[0]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_layer_without_gradient_on_some_workers_pools_each_factor_where_it_exists(
    world_size: int,
) -> None:
    strategies = ["dkfac", "kaisa", "spd", "pad"]
    results = run_workers(side_branch_run, world_size, args=(strategies,), timeout=120)
    want = side_oracle(world_size)
    for strategy in strategies:
        held = set()
        for rank in range(world_size):
            for key in ("side/a", "side/g"):
                if key in results[rank][strategy]:
                    assert_close(results[rank][strategy][key], want[key], what=f"{strategy} {key}")
                    held.add(key)
        assert held == {"side/a", "side/g"}, strategy


def test_a_single_worker_folds_a_without_g_when_no_gradient_comes() -> None:
    model = SideBranch().double()
    pre = dkfac.KFACPreconditioner(model, **F64)
    x, y = window_batch(0, 0, 1)
    F.cross_entropy(model(x, use_side=False), y).backward()
    pre.step()
    side = pre.layers[1]
    h = torch.tanh(model.body(x)).detach()
    rows = torch.cat([h, torch.ones(h.shape[0], 1, dtype=DT)], dim=1)
    assert_close(side.a, rows.t() @ rows / rows.shape[0], what="A")  # type: ignore[arg-type]
    assert side.g is None and side.inverse is None
    assert model.side.weight.grad is None  # nothing to precondition
