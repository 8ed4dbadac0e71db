"""Distributed strategies against the single-process run on the global batch (gloo, CPU)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import WorkerFailedError, run_workers
from dkfac.distributed.placement import longest_processing_time

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
    return configs


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
        model = uneven_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        pre = dkfac.KFACPreconditioner(ddp, lr=0.1, **F64, **config)
        train(ddp, pre, world_size, rank)
        out.append(
            {
                "params": [p.detach().clone() for p in model.parameters()],
                "comm": pre.comm_stats(),
                "inverses": {layer.name: layer.inverse is not None for layer in pre.layers},
                "factors": sorted(pre.factors()),
            }
        )
        pre.remove()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_strategies_equal_single_process_on_global_batch(world_size: int) -> None:
    configs = configurations(world_size)
    results = run_workers(distributed_run, world_size, args=(configs,), timeout=240)
    for index, config in enumerate(configs):
        reference = uneven_model()
        pre = dkfac.KFACPreconditioner(
            reference, lr=0.1, inverse_method=config["inverse_method"], **F64
        )
        train(reference, pre, world_size, None)
        for rank in range(world_size):
            for got, want in zip(
                results[rank][index]["params"], reference.parameters(), strict=True
            ):
                torch.testing.assert_close(
                    got,
                    want.detach(),
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
        for rank in range(world_size):
            assert results[rank][index]["comm"] == expected[rank], (config, rank)
            if config.get("grad_worker_fraction", 1.0) == 1 / world_size:
                owners = owners_of(reference, world_size)
                held = {name for name, has in results[rank][index]["inverses"].items() if has}
                assert held == {name for name, owner in owners.items() if owner == rank}


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


def hanging(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins


def test_harness_times_out_instead_of_hanging() -> None:
    with pytest.raises((TimeoutError, WorkerFailedError)):
        run_workers(hanging, 2, timeout=15)


class WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)
        self.unused = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def troubled_run(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    model = WithUnusedHead().double()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    kwargs = {"grad_worker_fraction": 1 / world_size} if strategy == "kaisa" else {}
    pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, **F64, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    warned = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        if step == 2 and rank == 0:
            x[0, 0] = float("nan")  # one worker's statistics go bad for one step
        opt.zero_grad()
        F.cross_entropy(ddp(x), torch.randint(0, 3, (4,), generator=g)).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = torch.nan_to_num(p.grad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        warned += [str(w.message) for w in caught]
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "warned": warned}


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "spd", "pad"])
def test_unused_layer_and_nan_statistics_on_one_worker_stay_consistent(strategy: str) -> None:
    results = run_workers(troubled_run, 2, args=(strategy,), timeout=90)
    for got, want in zip(results[1]["params"], results[0]["params"], strict=True):
        assert torch.isfinite(want).all()
        # Every worker applied the very same update, to the last bit.
        assert torch.equal(got, want)
    assert any("NaN/Inf" in message for result in results for message in result["warned"])


def float32_run(rank: int, world_size: int, strategy: str) -> list[torch.Tensor]:
    model = uneven_model().float()
    ddp = nn.parallel.DistributedDataParallel(model)
    pre = dkfac.KFACPreconditioner(ddp, strategy=strategy, lr=0.1)
    train(ddp, pre, world_size, rank)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "spd", "pad"])
def test_float32_strategies_match_single_process(strategy: str) -> None:
    results = run_workers(float32_run, 2, args=(strategy,), timeout=90)
    reference = uneven_model().float()
    train(reference, dkfac.KFACPreconditioner(reference, lr=0.1), 2, None)
    for params in results:
        for got, want in zip(params, reference.parameters(), strict=True):
            # rtol 1e-5, measured against the tensor's scale for entries near zero.
            scale = float(want.detach().abs().max())
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5 * scale)
