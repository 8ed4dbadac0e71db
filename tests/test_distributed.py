"""Distributed strategies against the single-process run on the global batch (gloo, CPU)."""

from __future__ import annotations

import copy
import inspect
import math
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import WorkerFailedError, run_workers
from dkfac.bench.timed_window import kfac_memory_bytes
from dkfac.comm import ClusterCostModel
from dkfac.strategies.accounting import DryRunSettings, RankAccount, account_strategy
from dkfac.strategies.layer_shapes import layer_shapes_of
from dkfac.strategies.placement import longest_processing_time

STEPS = 5
LOCAL_BATCH = 4
F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


def uneven_model() -> nn.Module:
    """Conv2d and Linear layers of uneven sizes (d_A: 28, 46, 64, 14; d_G: 5, 7, 13, 4)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(5, 7, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(63, 13),
        nn.Tanh(),
        nn.Linear(13, 4),
    ).double()


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = LOCAL_BATCH * world_size
    return (
        torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (n,), generator=g),
    )


def configurations(world_size: int) -> list[dict[str, Any]]:
    fractions = [1.0] + [k / world_size for k in range(1, world_size) if world_size % k == 0]
    configs = []
    for method in ("eigen", "inverse"):
        configs.append({"strategy": "dkfac", "inverse_method": method})
        configs += [
            {"strategy": "kaisa", "inverse_method": method, "grad_worker_fraction": f}
            for f in fractions
        ]
    # Cholesky factors travel as their mirrored (symmetric) matrices: D-KFAC broadcasts them
    # to every worker, KAISA to a layer's gradient workers (at P = 4, f = 1/2: two of four, the
    # mixed case; at P = 2 and 3, f = 1: all of them).
    configs.append({"strategy": "dkfac", "inverse_method": "cholesky"})
    fraction = 0.5 if world_size == 4 else 1.0
    configs.append(
        {"strategy": "kaisa", "inverse_method": "cholesky", "grad_worker_fraction": fraction}
    )
    return configs


#: bfloat16 keeps 8 significant bits: rounding to it changes a value by at most u = 2^-8.
BF16_UNIT_ROUNDOFF = 2.0**-8
#: Damping of the bf16 transport checks (see :func:`check_float32_runs`).
BF16_DAMPING = 0.03


def float32_configurations(strategies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """float32 runs (model, factors, decompositions) of ``strategies``, both methods, and a
    bfloat16-transport run of the first one next to its float32 twin (damping 0.03).

    Checked by :func:`check_float32_runs`.
    """
    configs = [
        {**strategy, "inverse_method": method, "float32": True}
        for method in ("eigen", "inverse")
        for strategy in strategies
    ]
    twin = {**strategies[0], "inverse_method": "eigen", "float32": True, "damping": BF16_DAMPING}
    return [*configs, twin, {**twin, "comm_dtype": torch.bfloat16}]


def build(config: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """A fresh model and the preconditioner options of ``config`` (float64 unless float32)."""
    options = dict(config)
    if options.pop("float32", False):
        return uneven_model().float(), options
    return uneven_model(), {**F64, **options}


def reference_run(
    config: dict[str, Any], world_size: int
) -> tuple[list[torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Parameters and factors of ``strategy="local"`` on the global batch, as ``config``."""
    kept = ("inverse_method", "float32", "damping", "inv_update_steps")
    local = {k: v for k, v in config.items() if k in kept}
    model, options = build(local)
    pre = dkfac.KFACPreconditioner(model, lr=0.1, **options)
    train(model, pre, world_size, None)
    return [p.detach() for p in model.parameters()], pre.factors()


#: The damping of a preconditioner built without one (the float32 runs').
DEFAULT_DAMPING = inspect.signature(dkfac.KFACPreconditioner).parameters["damping"].default
#: float32 keeps 24 significant bits: rounding to it changes a value by at most u = 2^-24.
FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def assert_float32_close(
    got: torch.Tensor,
    want: torch.Tensor,
    start: torch.Tensor,
    kappa: float,
    world_size: int,
    label: str,
) -> None:
    """float32 equality of a parameter: its own rounding plus its factors' rounding amplified.

    Two terms, each an error a correct run makes:

    * ``1e-5 · max|want|``: a parameter is its start minus updates computed from every entry of
      the layer (gradients summed in another order on P workers than in one process), so its
      rounding error is float32's times the tensor's scale, not times its own value (entries
      near zero carry the same absolute error as the others).
    * ``P · u · κ · moved``: each reduced factor is a sum of P ranks' statistics in another
      order, off by about ``P·u`` relative; eigen's ``1/(λ_A·λ_G + γ)`` amplifies that by up to
      ``κ`` (:func:`damped_amplification`) in the direction, so in the distance ``moved``
      the parameter travelled from ``start``. With the default damping (κ ≈ 130 here) this is
      the larger term: on an AMD EPYC host eigen at P = 4 lands 2.6e-6 from the reference in
      a tensor whose first term allows 1.5e-6 and second 4.0e-6 (an Intel host measured at
      most 6e-6 · max|w|, within the first term alone).

    A lost or doubled factor moves the direction by half or more of ``moved``, far outside.
    """
    moved = float((want - start).abs().max())
    tolerance = 1e-5 * float(want.abs().max()) + world_size * FLOAT32_UNIT_ROUNDOFF * kappa * moved
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=label)


def damped_amplification(
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]], damping: float
) -> float:
    """``max (λmax(A)·λmax(G) + γ)/γ`` over layers: how much eigen's ``1/(λ_A·λ_G + γ)`` can
    amplify a perturbation of the factors relative to the direction."""
    return max(
        float(torch.linalg.eigvalsh(a.double()).max() * torch.linalg.eigvalsh(g.double()).max())
        / damping
        + 1
        for a, g in factors.values()
    )


def check_float32_runs(
    configs: list[dict[str, Any]],
    results: list[list[dict[str, Any]]],
    world_size: int,
    cost_model: ClusterCostModel | None = None,
) -> None:
    """float32 runs equal their float32 reference; bf16 transport halves the bytes.

    ``results[rank][i]`` is the run of ``configs[i]`` (from :func:`float32_configurations`);
    a ``comm_dtype`` run is compared with its float32 twin, which comes earlier in ``configs``.
    ``cost_model`` is the one SPD/PAD planned with (for the planned memory).

    bf16 tolerance: bf16 keeps 8 significant bits (unit roundoff ``u = 2^-8``). Each
    rank's statistic is rounded once and the sum over P ranks P - 1 more times, so a
    reduced factor is off by about ``P·u`` relative (its decomposition's own rounding,
    ``u``, is smaller). A perturbation of the factors reaches the preconditioned direction
    amplified by at most ``κ = (λmax(A)·λmax(G) + γ)/γ`` (directions are divided by
    ``λ_A·λ_G + γ``), taken from the reference run's factors: ``κ ≈ 14-15`` here with
    ``γ = 0.03``. So the parameters must stay within ``P·u·κ`` (11% at P = 2, 22% at
    P = 4) of the distance the float32 run moved from its start; measured: 12-39% of that
    allowance at P = 2-4. A lost or doubled factor changes the directions by half or more;
    counts sent in bf16 would show in the bytes.
    """
    for index, config in enumerate(configs):
        count_bytes = counts_bytes(config["strategy"], len(layer_dims(uneven_model())))
        label = f"{config} P={world_size}"
        for rank in range(1, world_size):  # replicas agree to the last bit
            for got, first in zip(
                results[rank][index]["params"], results[0][index]["params"], strict=True
            ):
                assert torch.equal(got, first), (label, rank)
        planned = planned_accounts(config, world_size, cost_model)
        for rank in range(world_size):
            assert results[rank][index]["memory"] == planned[rank], (label, rank)
        if "comm_dtype" not in config:
            want_params, factors = reference_run(config, world_size)
            kappa = damped_amplification(factors, config.get("damping", DEFAULT_DAMPING))
            start = [p.detach() for p in build(config)[0].parameters()]
            for got, want, first in zip(
                results[0][index]["params"], want_params, start, strict=True
            ):
                assert_float32_close(got, want, first, kappa, world_size, label)
            continue
        twin = configs.index({k: v for k, v in config.items() if k != "comm_dtype"})
        for rank in range(world_size):
            low, full = results[rank][index]["comm"], results[rank][twin]["comm"]
            assert low.keys() == full.keys(), label
            for key in low:
                # Every payload in half the bytes; the float64 counts (in the factor
                # allreduce) travel exact in both. (SPD/PAD may fuse differently: their
                # buckets are planned from the bytes on the wire.)
                counts = count_bytes if key == "factor_comm/allreduce" else 0
                assert 2 * (low[key]["bytes"] - counts) == full[key]["bytes"] - counts, (
                    label,
                    key,
                )
        _, factors = reference_run(configs[twin], world_size)
        kappa = damped_amplification(factors, config["damping"])
        start = build(config)[0].parameters()
        for got, want, first in zip(
            results[0][index]["params"], results[0][twin]["params"], start, strict=True
        ):
            moved = float((want - first.detach()).abs().max())
            tolerance = world_size * BF16_UNIT_ROUNDOFF * kappa * moved
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=label)


def counts_bytes(strategy: str, layers: int) -> int:
    """Bytes of the float64 counts in the factor allreduce: ``(rows, examples)`` per layer,
    and for SPD/PAD one more value, the number of ranks with statistics that came after their
    factor was sent (the late-statistics marker, :meth:`FactorPipeline.finish`)."""
    return 8 * (2 * layers + (1 if strategy in ("spd", "pad") else 0))


def train(
    model: nn.Module, pre: dkfac.KFACPreconditioner, world_size: int, rank: int | None
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(step, world_size)
        if rank is not None:
            x = x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
            y = y[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        opt.zero_grad()
        F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
        pre.step()
        opt.step()


def distributed_run(
    rank: int, world_size: int, configs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        model, options = build(config)
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = dkfac.KFACPreconditioner(ddp, lr=0.1, **options)
        train(ddp, pre, world_size, rank)
        factors = {name: (a.clone(), g.clone()) for name, (a, g) in pre.factors().items()}
        # A deep copy of a hooked model (EMA, snapshots) works and leaves K-FAC untouched.
        twin = copy.deepcopy(model)
        twin(global_batch(0, world_size)[0].to(next(twin.parameters()).dtype)).sum().backward()
        assert all(
            torch.equal(a, factors[name][0]) and torch.equal(g, factors[name][1])
            for name, (a, g) in pre.factors().items()
        )
        comm = pre._strategy.comm  # type: ignore[attr-defined]
        out.append(
            {
                "params": [p.detach().clone() for p in model.parameters()],
                "comm": pre.comm_stats(),
                "inverses": {layer.name: layer.inverse is not None for layer in pre.layers},
                "factors": sorted(pre.factors()),
                "memory": kfac_memory_bytes(pre),
                "subgroups": comm.subgroups,
            }
        )
        pre.remove()
        out[-1]["subgroups_after_remove"] = comm.subgroups  # remove() releases KAISA's groups
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_strategies_equal_single_process_on_global_batch(world_size: int) -> None:
    configs = configurations(world_size)
    extra = float32_configurations(
        [{"strategy": "dkfac"}, {"strategy": "kaisa", "grad_worker_fraction": 1 / world_size}]
    )
    results = run_workers(distributed_run, world_size, args=(configs + extra,), timeout=240)
    check_float32_runs(extra, [r[len(configs) :] for r in results], world_size)
    for rank_results in results:
        for result in rank_results:
            assert result["subgroups_after_remove"] == 0
        if world_size == 4:  # kaisa f=1/2 at P=4: a row group and a column group of 2 ranks
            assert any(result["subgroups"] == 2 for result in rank_results)
    for index, config in enumerate(configs):
        reference = uneven_model()
        want_params, _ = reference_run(config, world_size)
        for rank in range(world_size):
            for got, want in zip(results[rank][index]["params"], want_params, strict=True):
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=0,
                    atol=1e-10,
                    msg=lambda m, c=config, r=rank: f"{c} rank {r}: {m}",
                )
        for rank in range(1, world_size):  # replicas agree to the last bit
            for got, first in zip(
                results[rank][index]["params"], results[0][index]["params"], strict=True
            ):
                assert torch.equal(got, first), (config, rank)
        expected = expected_bytes(config, world_size, reference)
        planned = planned_accounts(config, world_size)
        for rank in range(world_size):
            assert results[rank][index]["comm"] == expected[rank], (config, rank)
            # The benchmark's memory column: what the dry run plans this rank to hold.
            assert results[rank][index]["memory"] == planned[rank], (config, rank)
            if config.get("grad_worker_fraction", 1.0) == 1 / world_size:
                owners = owners_of(reference, world_size)
                held = {name for name, has in results[rank][index]["inverses"].items() if has}
                assert held == {name for name, owner in owners.items() if owner == rank}


def dry_run_accounts(
    config: dict[str, Any], world_size: int, cost_model: ClusterCostModel | None = None
) -> list[RankAccount]:
    """Per rank, the dry-run accounting of ``config`` (one second-order update)."""
    dtype = torch.float32 if config.get("float32") else torch.float64
    settings = DryRunSettings(
        world_size,
        inverse_method=config["inverse_method"],
        factor_dtype=dtype,
        inv_dtype=dtype,
        grad_dtype=dtype,
        bucket_cap_mb=config.get("bucket_cap_mb", 25.0),
        comm_dtype=config.get("comm_dtype"),
        cost_model=cost_model,
        inv_update_steps=config.get("inv_update_steps", 1),
    )
    return account_strategy(
        config["strategy"],
        layer_shapes_of(uneven_model()),
        settings,
        grad_worker_fraction=config.get("grad_worker_fraction", 1.0),
        share=config.get("share", "auto"),
    )


def planned_accounts(
    config: dict[str, Any], world_size: int, cost_model: ClusterCostModel | None = None
) -> list[tuple[int, int]]:
    """Per rank, the (factor, decomposition) bytes the dry-run accounting plans for ``config``."""
    accounts = dry_run_accounts(config, world_size, cost_model)
    return [(account.factor_bytes, account.inverse_bytes) for account in accounts]


def layer_dims(model: nn.Module) -> dict[str, tuple[int, int]]:
    dims = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            d_a = module.weight[0].numel() + (module.bias is not None)
            dims[name] = (d_a, module.weight.shape[0])
    return dims


def owners_of(model: nn.Module, world_size: int) -> dict[str, int]:
    dims = layer_dims(model)
    owners = longest_processing_time([float(a**3 + g**3) for a, g in dims.values()], world_size)
    return dict(zip(dims, owners, strict=True))


def entry(op: str, payloads: list[int], world_size: int) -> dict[str, int]:
    """Accounting of ``len(payloads)`` collectives of ``op`` with these float64 value counts.

    Wire bytes per rank of a bandwidth-optimal algorithm: allreduce sends 2(P-1)/P of the
    payload, reduce and broadcast (P-1)/P (rounded down per call).
    """
    factor = 2 if op == "allreduce" else 1
    return {
        "bytes": 8 * sum(payloads),
        "calls": len(payloads),
        "wire_bytes": sum(factor * 8 * n * (world_size - 1) // world_size for n in payloads),
    }


def tri(d: int) -> int:
    return d * (d + 1) // 2


def expected_bytes(
    config: dict[str, Any], world_size: int, model: nn.Module
) -> list[dict[str, dict[str, int]]]:
    """Analytic per-rank payload of one (1, 1) step, float64, default 25 MiB buckets."""
    dims = layer_dims(model)
    owners = owners_of(model, world_size)
    g_workers = round(config.get("grad_worker_fraction", 1.0) * world_size)
    eigen = config["inverse_method"] == "eigen"
    factor_values = sum(tri(a) + tri(g) for a, g in dims.values())
    per_rank = []
    for rank in range(world_size):
        stats = {
            "factor_comm/allreduce": entry("allreduce", [factor_values, 2 * len(dims)], world_size)
        }
        my_row = rank // g_workers
        row_owners = [o for o in range(world_size) if o // g_workers == my_row]
        if g_workers > 1:
            payloads = []
            for owner in row_owners:
                mine = [dims[name] for name, o in owners.items() if o == owner]
                if mine:
                    payloads.append(
                        sum(
                            (a * a + a + g * g + g) if eigen else (tri(a) + tri(g)) for a, g in mine
                        )
                        + len(mine)  # + one validity flag each
                    )
            if payloads:
                stats["inverse_comm/broadcast"] = entry("broadcast", payloads, g_workers)
        if g_workers < world_size:
            rows = sorted({o // g_workers for o in owners.values()})
            stats["grad_comm/broadcast"] = entry(
                "broadcast",
                [
                    sum(a * g for name, (a, g) in dims.items() if owners[name] // g_workers == row)
                    for row in rows
                ],
                world_size // g_workers,
            )
        per_rank.append(dict(sorted(stats.items())))
    return per_rank


def bad_fraction(rank: int, world_size: int) -> str:
    try:
        dkfac.KFACPreconditioner(uneven_model(), strategy="kaisa", grad_worker_fraction=0.5)
    except ValueError as error:
        return str(error)
    return "no error"


def test_fraction_that_does_not_divide_the_world_is_refused() -> None:
    messages = run_workers(bad_fraction, 3, timeout=60)
    assert all("grad_worker_fraction=0.5" in m and "1/3" in m for m in messages)


def test_distributed_strategy_without_process_group_says_how_to_launch() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun"):
        dkfac.KFACPreconditioner(uneven_model(), strategy="dkfac")


def crashing(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def test_harness_reports_the_failing_worker() -> None:
    with pytest.raises(WorkerFailedError, match=r"rank 1 of 2 failed(.|\n)*boom on rank 1"):
        run_workers(crashing, 2, timeout=60)


def rank_one_sleeps(seconds: float) -> None:
    time.sleep(seconds)


def hanging(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        rank_one_sleeps(600)


def test_harness_times_out_instead_of_hanging_and_shows_where_each_worker_was() -> None:
    # The collective timeout (10 s) is longer than the harness's 8 s: the harness stops both.
    with pytest.raises(TimeoutError) as caught:
        run_workers(hanging, 2, timeout=8)
    message = str(caught.value)
    assert message.startswith("workers [0, 1] did not finish within 8 s")
    rank0, rank1 = message.split("--- rank 1")
    assert "--- rank 0" in rank0 and "in hanging" in rank0
    assert "in rank_one_sleeps" in rank1


class WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)
        self.unused = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def troubled_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``; rank 0's first example is NaN at step 2."""
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    if step == 2 and rank == 0:
        x[0, 0] = float("nan")  # one worker's statistics go bad for one step
    return x, torch.randint(0, 3, (4,), generator=g)


def troubled_steps(
    model: nn.Module, forward: nn.Module, pre: dkfac.KFACPreconditioner, ranks: list[int]
) -> list[str]:
    """Four SGD steps on the batches of ``ranks`` (concatenated); returns the warnings."""
    opt = torch.optim.SGD(forward.parameters(), lr=0.1)
    warned = []
    for step in range(4):
        batches = [troubled_batch(step, rank) for rank in ranks]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        opt.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = torch.nan_to_num(p.grad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        warned += [str(w.message) for w in caught]
        opt.step()
    return warned


def troubled_run(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    model = WithUnusedHead().double()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    kwargs = {"grad_worker_fraction": 1 / world_size} if strategy == "kaisa" else {}
    pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, lr=0.1, **F64, **kwargs)
    warned = troubled_steps(model, ddp, pre, [rank])
    return {"params": [p.detach().clone() for p in model.parameters()], "warned": warned}


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "spd", "pad"])
def test_unused_layer_and_nan_statistics_on_one_worker_stay_consistent(strategy: str) -> None:
    results = run_workers(troubled_run, 2, args=(strategy,), timeout=90)
    # Oracle: one process on the global batch (the NaN example included), same rule: the step's
    # factors are not updated anywhere, the unused layer is left alone.
    model = WithUnusedHead().double()
    pre = dkfac.KFACPreconditioner(model, lr=0.1, **F64)
    warned = troubled_steps(model, model, pre, [0, 1])
    assert any("NaN/Inf" in message for message in warned)
    for rank in range(2):
        for got, want in zip(results[rank]["params"], model.parameters(), strict=True):
            assert torch.isfinite(want).all()
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
        # Every worker applied the very same update, to the last bit.
        for got, want in zip(results[rank]["params"], results[0]["params"], strict=True):
            assert torch.equal(got, want)
    assert any("NaN/Inf" in message for result in results for message in result["warned"])


def directions_without_inverses(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    options: dict[str, Any] = {"factor_update_steps": 100, "inv_update_steps": 100}
    options |= {"kl_clip": 1e-6, "lr": 0.1}
    pre = dkfac.KFACPreconditioner(
        ddp, strategy="kaisa", grad_worker_fraction=0.5, comm_dtype=torch.bfloat16, **options
    )
    generator = torch.Generator().manual_seed(1)  # the same batch on both workers
    for step in range(2):
        x, y = (
            torch.randn(8, 3, generator=generator),
            torch.randint(0, 2, (8,), generator=generator),
        )
        model.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        if step == 1:
            for layer in pre.layers:
                layer.inverse = None  # each holder lost its decomposition (a failed one, say)
            before = [p.grad.detach().clone() for p in model.parameters()]
        pre.step()
    return [before, [p.grad.detach().clone() for p in model.parameters()]]


def test_a_rounded_broadcast_of_an_unpreconditioned_gradient_leaves_the_kl_terms_alike() -> None:
    """KAISA with one gradient worker per layer and bf16 transport, both layers' holders
    without an inverse: each sends its gradient itself, rounded to bf16 on every rank, the
    holder's own copy too. ν's terms ``⟨V, ∇⟩`` take the unrounded gradient on every rank
    (before, the holder's broadcast rounded its gradient matrix in place: its ν differed
    and the replicas drifted apart).
    Oracle: ``ν·V`` with ``V`` the rounded gradient and ``ν = √(κ / (η² Σ⟨V, ∇⟩))``."""
    ranks = run_workers(directions_without_inverses, 2, ())
    before, after = ranks[0]
    for got in (after, ranks[1][1]):
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(got, after, strict=True))
    rounded = [g.to(torch.bfloat16).float() for g in before]
    vg = sum(float((v.double() * g.double()).sum()) for v, g in zip(rounded, before, strict=True))
    nu = math.sqrt(1e-6 / (0.1 * 0.1 * vg))
    assert nu < 0.5  # the clip binds
    for got, v in zip(after, rounded, strict=True):
        torch.testing.assert_close(got, nu * v, rtol=1e-6, atol=0)
