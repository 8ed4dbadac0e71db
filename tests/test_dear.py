"""DeAR against DDP + the same optimizer (gloo, CPU, float64), and its bucket-size search."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.dear.bucket_search import (
    BucketSizeSearch,
    distinct_candidates,
    power_of_two_sizes,
)

STEPS = 4
LOCAL_BATCH = 3


class Net(nn.Module):
    """Conv + BatchNorm + Linear layers, a layer some ranks skip, one no rank uses, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 4 * 4, 9)
        self.sometimes = nn.Linear(9, 9)
        self.never = nn.Linear(9, 9)
        self.frozen = nn.Linear(9, 9)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        h = torch.tanh(self.fc1(h))
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return self.head(self.frozen(h))


class AttentionNet(nn.Module):
    """Stock modules that use parameters without calling the modules holding them.

    ``nn.MultiheadAttention`` applies ``out_proj.weight`` itself (``out_proj.forward`` never
    runs), and old-style ``weight_norm`` recomputes ``head.weight`` in a forward pre-hook.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the pre-hook form is the point
            self.head = nn.utils.weight_norm(nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def make_model(kind: str = "conv") -> nn.Module:
    torch.manual_seed(0)
    return (Net() if kind == "conv" else AttentionNet()).double()


def batch(step: int, rank: int, kind: str = "conv") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    shape = (3, 6, 6) if kind == "conv" else (5, 4)
    x = torch.randn(LOCAL_BATCH, *shape, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (LOCAL_BATCH,), generator=g)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if name == "sgd-tensor-lr":  # the scheduler changes this tensor in place
        return torch.optim.SGD(params, lr=torch.tensor(0.05), momentum=0.9)
    # eps=1e-6, not 1e-8: near g = 0 AdamW's step moves by lr/eps per unit of gradient, so a
    # last-bit difference of summation order (allreduce vs reduce-scatter) in a tiny K-FAC
    # direction would be amplified 1e6x and the 1e-10 comparison would measure conditioning.
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6)


def uses_sometimes(config: dict[str, Any], step: int, rank: int) -> bool:
    """Rank-dependent use of ``sometimes`` when the config asks for it.

    With 2 ranks: used by rank 0 at step 0, by no rank at step 1 (after it has optimizer
    state), by rank 1 at step 2.
    """
    return not config.get("rank_dependent") or (step + rank) % 3 == 0


def perturbed_model(kind: str, rank: int) -> nn.Module:
    """The test model, shifted by ``rank``: DDP and DeAR must start from rank 0's state."""
    model = make_model(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    return model


def kfac_for(model: nn.Module, config: dict[str, Any]) -> dkfac.KFACPreconditioner | None:
    if not config.get("kfac"):
        return None
    return dkfac.KFACPreconditioner(
        model, strategy="dkfac", lr=0.05, factor_dtype=torch.float64, inv_dtype=torch.float64
    )


def run_ddp(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    kind = config.get("model", "conv")
    model = perturbed_model(kind, rank)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = make_optimizer(config["optimizer"], model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    pre = kfac_for(ddp, config)
    evals = []
    for step in range(config.get("steps", STEPS)):
        x, y = batch(step, rank, kind)
        optimizer.zero_grad()
        F.cross_entropy(ddp(x, uses_sometimes(config, step, rank)), y).backward()
        if pre is not None:
            pre.step()
        optimizer.step()
        schedule.step()
        if config.get("evaluate"):
            evals.append(evaluate(ddp, kind))  # through DDP, which syncs buffers there
    if pre is not None:
        pre.remove()
    return {"params": snapshot(model), "evals": evals}


def run_dear(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    kind = config.get("model", "conv")
    model = perturbed_model(kind, rank)
    dear = dkfac.DeAR(
        model,
        lambda params: make_optimizer(config["optimizer"], params),
        bucket_cap_mb=config["cap"],
        auto_range_mb=config.get("auto_range", (1.0, 64.0)),
        auto_trial_steps=1,
    )
    frozen = model.get_parameter("frozen.weight") if kind == "conv" else None
    frozen_before = None if frozen is None else frozen.detach().clone()  # rank 0's
    schedule = torch.optim.lr_scheduler.LambdaLR(dear.optimizer, lambda s: 1.0 / (1 + s))
    pre = kfac_for(model, config)
    evals, comm = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(config.get("steps", STEPS)):
            x, y = batch(step, rank, kind)
            F.cross_entropy(model(x, uses_sometimes(config, step, rank)), y).backward()
            if pre is not None:
                dear.gather_gradients()
                pre.step()
            dear.step()
            schedule.step()
            comm.append(dear.comm_stats())
            if config.get("evaluate"):
                evals.append(evaluate(model, kind))  # applies the pending update first
    dear.finish()
    if pre is not None:
        pre.remove()
    if kind == "conv":  # (old-style weight_norm modules cannot be deep-copied after a forward)
        # A deep copy (EMA, best-model snapshot) trains on its own; DeAR ignores it.
        twin = copy.deepcopy(model)
        twin(batch(0, rank, kind)[0]).sum().backward()
    if frozen is not None:
        assert torch.equal(frozen, frozen_before), "a frozen parameter changed"
    result = {
        "params": snapshot(model),
        "evals": evals,
        "comm": comm,
        "cap": dear.bucket_cap_mb,
        "tuning": dear.tuning,
        "flat_bytes": [b.flat.numel() * b.flat.element_size() for b in dear._pipeline.buckets],
    }
    dear.remove()
    return result


def evaluate(model: nn.Module, kind: str) -> torch.Tensor:
    model.eval()
    with torch.inference_mode():  # optimizer state must not become inference tensors
        out = model(batch(99, 0, kind)[0]).clone()
    model.train()
    return out


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def both(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"ddp": run_ddp(rank, world, config), "dear": run_dear(rank, world, config)}
        for config in configs
    ]


CONFIGS: dict[int, list[dict[str, Any]]] = {
    2: [
        {"optimizer": "sgd", "cap": 25.0, "evaluate": True},
        {"optimizer": "sgd", "cap": 1e-4, "rank_dependent": True},
        {"optimizer": "adamw", "cap": 1e-3},
        {"optimizer": "adamw", "cap": 1e-4, "evaluate": True, "rank_dependent": True},
        {"optimizer": "sgd", "cap": 1e-3, "kfac": True},
        {"optimizer": "sgd", "cap": "auto", "auto_range": (2**-12, 2**-10), "steps": 9},
        {"optimizer": "sgd-tensor-lr", "cap": 1e-4, "model": "attention", "evaluate": True},
        {"optimizer": "adamw", "cap": 25.0, "model": "attention"},
    ],
    3: [
        {"optimizer": "sgd", "cap": 1e-4, "rank_dependent": True, "evaluate": True},
        {"optimizer": "adamw", "cap": 25.0, "kfac": True},
    ],
    4: [
        {"optimizer": "adamw", "cap": 1e-3, "rank_dependent": True},
        {"optimizer": "sgd", "cap": 1e-4, "kfac": True},
    ],
}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dear_equals_ddp_and_the_same_optimizer(world_size: int) -> None:
    configs = CONFIGS[world_size]
    results = run_workers(both, world_size, args=(configs,), timeout=240)
    for index, config in enumerate(configs):
        for rank in range(world_size):
            got, want = results[rank][index]["dear"], results[rank][index]["ddp"]
            for a, b in zip(got["params"], want["params"], strict=True):
                torch.testing.assert_close(
                    a, b, rtol=0, atol=1e-10, msg=lambda m, c=config, r=rank: f"{c} r{r}: {m}"
                )
            for a, b in zip(got["evals"], want["evals"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
            # Parameter replicas agree to the last bit (one all-gathered value per element);
            # BatchNorm buffers differ between ranks until the next forward, as with DDP.
            n_params = len(list(make_model(config.get("model", "conv")).parameters()))
            first = results[0][index]["dear"]["params"][:n_params]
            for a, b in zip(got["params"][:n_params], first, strict=True):
                assert torch.equal(a, b), (config, rank)


def test_dear_comm_bytes_and_auto_bucket_size() -> None:
    configs = [
        {"optimizer": "sgd", "cap": 1e-3},
        {"optimizer": "sgd", "cap": "auto", "auto_range": (2**-12, 2**-10), "steps": 9},
    ]
    results = run_workers(both, 2, args=(configs,), timeout=120)
    fixed = results[0][0]["dear"]
    total = sum(fixed["flat_bytes"])  # gradients + one flag per parameter + padding to P
    n_params = sum(p.numel() for p in make_model().parameters() if p.requires_grad)
    assert n_params * 8 < total <= (n_params + 8 + 2 * len(fixed["flat_bytes"])) * 8
    for step_stats in fixed["comm"][1:]:
        assert step_stats["grad_reduce_scatter/reduce_scatter"] == {
            "bytes": total,
            "calls": len(fixed["flat_bytes"]),
            "wire_bytes": sum(b // 2 for b in fixed["flat_bytes"]),
        }
        assert step_stats["grad_all_gather/all_gather"]["bytes"] == total
        assert "buffer_broadcast/broadcast" in step_stats
    auto = [results[rank][1]["dear"] for rank in range(2)]
    candidates = [size for size, _ in auto[0]["tuning"]]
    assert len(candidates) >= 2, auto[0]["tuning"]
    assert auto[0]["tuning"] == auto[1]["tuning"]  # agreed medians: the same choice everywhere
    best = min(auto[0]["tuning"], key=lambda item: (item[1], item[0]))[0]
    assert auto[0]["cap"] == auto[1]["cap"] == best


def dear_steps(model: nn.Module, dear: dkfac.DeAR, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        dear.step()


def checkpoint_runs(rank: int, world: int, folder: str) -> dict[str, list[torch.Tensor]]:
    """5 steps straight, and 3 steps, save (DeAR applies the pending update), 2 more resumed."""
    path = Path(folder) / f"rank{rank}.pt"

    def build() -> tuple[nn.Module, dkfac.DeAR]:
        model = make_model()
        return model, dkfac.DeAR(model, lambda p: make_optimizer("adamw", p), bucket_cap_mb=1e-3)

    model, dear = build()
    dear_steps(model, dear, range(5), rank)
    dear.remove()  # applies the last update
    straight = snapshot(model)

    model, dear = build()
    dear_steps(model, dear, range(3), rank)
    torch.save({"model": model.state_dict(), "optimizer": dear.optimizer.state_dict()}, path)
    dear.remove()
    model, dear = build()
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    dear.optimizer.load_state_dict(saved["optimizer"])
    dear_steps(model, dear, range(3, 5), rank)
    dear.remove()
    return {"straight": straight, "resumed": snapshot(model)}


def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    for result in run_workers(checkpoint_runs, 2, args=(str(tmp_path),), timeout=120):
        for a, b in zip(result["resumed"], result["straight"], strict=True):
            assert torch.equal(a, b)


def accumulation_run(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Two micro-batches per step, the first under no_sync, for DDP and DeAR."""
    out = {}
    for kind in ("ddp", "dear"):
        model = make_model()
        if kind == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            optimizer = make_optimizer("sgd", model.parameters())
            forward, no_sync, step = ddp, ddp.no_sync, optimizer.step
        else:
            dear = dkfac.DeAR(model, lambda p: make_optimizer("sgd", p), bucket_cap_mb=1e-4)
            forward, no_sync, step = model, dear.no_sync, dear.step
        for s in range(3):
            if kind == "ddp":
                optimizer.zero_grad()
            for micro in range(2):
                x, y = batch(10 * s + micro, rank)
                if micro == 0:
                    with no_sync():
                        F.cross_entropy(forward(x), y).backward()
                else:
                    F.cross_entropy(forward(x), y).backward()
            step()
        if kind == "dear":
            dear.finish()
        out[kind] = snapshot(model)
    return out


def test_no_sync_gradient_accumulation_equals_ddp() -> None:
    for result in run_workers(accumulation_run, 2, timeout=120):
        for a, b in zip(result["dear"], result["ddp"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def trace_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)  # every layer runs in every forward: each update waits there
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 9), nn.Tanh(), nn.Linear(9, 3)
    ).double()
    dear = dkfac.DeAR(model, lambda p: make_optimizer("sgd", p), bucket_cap_mb=1e-4)
    for step in range(4):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        dear.step()
    path = Path(folder) / f"trace{rank}.json"
    dear.export_trace(str(path))
    timings = dear.timings()
    dear.remove()
    return {"trace": json.loads(path.read_text()), "timings": timings}


def test_trace_shows_reduce_scatter_under_backward_and_all_gather_under_forward(
    tmp_path: Path,
) -> None:
    result = run_workers(trace_run, 2, args=(str(tmp_path),), timeout=120)[0]
    assert set(result["timings"]) >= {"grad_reduce_scatter", "grad_all_gather", "update"}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for event in result["trace"]["traceEvents"]:
        if event["ph"] == "X":
            key = (event["args"]["step"], event["name"])
            spans.setdefault(key, []).append((event["ts"], event["ts"] + event["dur"]))
    for step in (2, 3):  # step 0's update is applied at once (see DeAR.step)
        ((_, backward_end),) = spans[(step, "backward (gradients ready)")]
        launches = [start for start, _ in spans[(step, "reduce_scatter in flight")]]
        assert min(launches) < backward_end  # launched from a hook, before backward ended
        ((forward_start, forward_end),) = spans[(step, "forward")]
        gathers = spans[(step, "all_gather in flight")]  # last step's, waited in this forward
        assert gathers and all(forward_start <= end <= forward_end for _, end in gathers)


def test_bad_arguments_raise_value_errors() -> None:
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 is not allowed: expected a positive"),
        ({"bucket_cap_mb": "fast"}, r"bucket_cap_mb='fast' is not allowed"),
        ({"bucket_cap_mb": "auto", "auto_range_mb": (8, 2)}, r"auto_range_mb=\(8, 2\)"),
        ({"bucket_cap_mb": "auto", "auto_trial_steps": 0}, r"auto_trial_steps=0 is not allowed"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dkfac.DeAR(model, sgd, **kwargs)
    with pytest.raises(ValueError, match=r"optimizer=3 is not allowed"):
        dkfac.DeAR(model, 3)  # type: ignore[arg-type]
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the model"):
        dkfac.DeAR(model, foreign)
    with pytest.raises(ValueError, match=r"no parameter that requires grad"):
        dkfac.DeAR(nn.ReLU(), lambda p: torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(RuntimeError, match=r"torchrun"):
        dkfac.DeAR(model, sgd)


def test_power_of_two_sizes_and_distinct_layouts() -> None:
    assert power_of_two_sizes(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert power_of_two_sizes(1, 48) == [1, 2, 4, 8, 16, 32, 48]
    assert power_of_two_sizes(3, 3) == [3]
    with pytest.raises(ValueError, match=r"auto_range_mb=\(0, 4\)"):
        power_of_two_sizes(0, 4)
    # Sizes that cut the list at the same places are one candidate: the smallest is kept.
    layouts = {1: "a", 2: "a", 4: "b", 8: "c", 16: "c"}
    assert distinct_candidates([1, 2, 4, 8, 16], layouts.__getitem__) == [1, 4, 8]


def test_bucket_size_search_measures_each_candidate_and_keeps_the_fastest() -> None:
    search = BucketSizeSearch([1.0, 4.0, 16.0], trial_steps=3, warmup_steps=1)
    # Per candidate: one warm-up (ignored, deliberately huge) then three timed iterations.
    times = {1.0: [9.0, 0.5, 0.7, 0.6], 4.0: [9.0, 0.3, 0.9, 0.35], 16.0: [9.0, 0.4, 0.4, 0.4]}
    order = []
    for size in (1.0, 4.0, 16.0):
        assert search.current == size
        order.append(size)
        finished = [search.record(t) for t in times[size]]
        assert finished == [False, False, False, True]
    assert search.measured_all and order == [1.0, 4.0, 16.0]
    assert search.medians == [0.6, 0.35, 0.4]
    assert search.choose(search.medians) == 4.0
    assert search.choose([0.4, 0.5, 0.4]) == 1.0  # ties: the smaller size
    assert not search.record(1.0)  # nothing more to measure
    with pytest.raises(ValueError, match="trial_steps=0"):
        BucketSizeSearch([1.0], trial_steps=0)
