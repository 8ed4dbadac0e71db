"""One rank of ``dkfac bench``: time DDP + SGD against the K-FAC strategies.

Started by :mod:`dkfac.bench.command` through torchrun, as a module so that it runs from an
installed package::

    python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker ...

gloo process group, one intra-op thread, a fixed synthetic batch per rank and model
(``--batch-size`` per worker, each model's input shape from
:data:`~dkfac.bench.configs.INPUT_SHAPES`: 3x32x32 images for the CIFAR ResNets, vectors of
1024 features for ``mlp6``), SGD (momentum 0.9, lr 0.1) on a DDP-wrapped model.
Configurations: SGD alone (DDP, no K-FAC), then per ``(f, i)`` schedule ``strategy="dkfac"``,
``strategy="kaisa"`` with ``grad_worker_fraction`` 1/P (and 1/2 when P > 2 is even),
``strategy="spd"`` and ``strategy="pad"``, all with ``inverse_method="eigen"``. SPD-KFAC and
PAD-KFAC calibrate their cost model when the preconditioner is built (all ranks together),
before the warm-up.

Every configuration gets a freshly built model (same seed), its own warm-up and a timed window
that starts after a ``dist.barrier()``. Periodic configurations (``f > 1`` or ``i > 1``) time
``--iters-long`` iterations, the others ``--iters``. The configurations run interleaved in
rounds (the order rotates from round to round); the overhead of a K-FAC configuration is taken
inside a round against that round's SGD window, then reduced by the median over rounds. Rank 0
writes the report (raw rounds and the per-model summary) to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

import dkfac
from dkfac.bench.configs import (
    INPUT_SHAPES,
    INVERSE_METHOD,
    LR,
    MODELS,
    MOMENTUM,
    NUM_CLASSES,
    PHASES,
    SCHEDULES,
    SGD,
    STRATEGIES,
    Configuration,
    configurations,
    count_schedule_hits,
    environment,
)
from dkfac.comm import destroy_process_groups
from dkfac.curvature.inverse import FACTOR_SIDES
from dkfac.strategies import option_keywords

#: ``comm_stats()`` phase prefix -> name of the byte split.
BYTE_SPLIT = {"factor_comm": "factor", "inverse_comm": "inverse", "grad_comm": "grad"}


def make_batch(batch_size: int, seed: int, shape: Sequence[int]) -> tuple[Tensor, Tensor]:
    """One random input batch and random labels, drawn from ``seed``.

    Args:
        batch_size: Number of samples.
        seed: Seed of the generator the inputs and then the labels are drawn from.
        shape: Shape of one input without the batch dimension (see ``INPUT_SHAPES``).

    Returns:
        Inputs of shape ``(batch_size, *shape)`` and labels in ``[0, NUM_CLASSES)``.

    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *shape, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return x, y


def kfac_memory_bytes(pre: dkfac.KFACPreconditioner) -> tuple[int, int]:
    """Bytes of the running factors and of the decompositions this rank holds.

    Factors are counted one by one: under PAD an owner may hold a layer's ``A`` and not its
    ``G`` (``pre.factors()`` lists only layers with both, so it would miss those).
    """
    factor_bytes = 0
    for layer in pre.layers:
        for side in FACTOR_SIDES:
            factor = layer.factor(side)
            if factor is not None:
                factor_bytes += factor.numel() * factor.element_size()
    inverse_bytes = 0
    for layer in pre.layers:
        if layer.inverse is not None:
            inverse_bytes += sum(
                t.numel() * t.element_size() for t in layer.inverse.tensors().values()
            )
    return factor_bytes, inverse_bytes


def time_window(
    config: Configuration,
    model_name: str,
    x: Tensor,
    y: Tensor,
    *,
    warmup: int,
    iters: int,
    seed: int,
    bucket_cap_mb: float,
) -> dict[str, Any]:
    """Build a fresh DDP model for ``config``, warm it up, time ``iters`` iterations.

    Returns this rank's raw numbers; :func:`reduce_window` combines the ranks. The garbage
    collector is paused during the window (for every configuration alike).
    """
    torch.manual_seed(seed)
    net = MODELS[model_name](num_classes=NUM_CLASSES)
    net.train()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pre: dkfac.KFACPreconditioner | None = None
    if config.strategy is not None:
        pre = dkfac.KFACPreconditioner(
            model,
            strategy=config.strategy,
            inverse_method=INVERSE_METHOD,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            bucket_cap_mb=bucket_cap_mb,
            **option_keywords(config.strategy, grad_worker_fraction=config.grad_worker_fraction),
        )

    def iteration() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        torch.autograd.backward(loss)  # loss.backward(), untyped in torch's stubs
        if pre is not None:
            pre.step()
        optimizer.step()
        return loss

    clock = time.perf_counter
    iter_s: list[float] = []
    phase_sums: dict[str, float] = collections.defaultdict(float)
    byte_sums: dict[str, int] = collections.defaultdict(int)
    call_sums: dict[str, int] = collections.defaultdict(int)
    try:
        loss = torch.zeros(())
        for _ in range(warmup):
            loss = iteration()
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            dist.barrier()
            window_start = clock()
            for _ in range(iters):
                t0 = clock()
                loss = iteration()
                iter_s.append(clock() - t0)
                if pre is not None:
                    for phase, seconds in pre.timings().items():
                        phase_sums[phase] += seconds
                    for key, count in pre.comm_stats().items():
                        byte_sums[key] += count["bytes"]
                        call_sums[key] += count["calls"]
            wall_s = clock() - window_start
        finally:
            if gc_was_enabled:
                gc.enable()
        final_loss = float(loss.detach())
        factor_bytes = inverse_bytes = 0
        if pre is not None:
            if pre.steps != warmup + iters:
                raise RuntimeError(
                    f"{config.key}: pre.steps={pre.steps}, expected {warmup + iters}"
                )
            factor_bytes, inverse_bytes = kfac_memory_bytes(pre)
    finally:
        if pre is not None:
            pre.remove()
    return {
        "wall_s": wall_s,
        "iter_s": iter_s,
        "phase_s": {name: value / iters for name, value in phase_sums.items()},
        "bytes_per_step": {key: value / iters for key, value in byte_sums.items()},
        "calls_per_step": {key: value / iters for key, value in call_sums.items()},
        "factor_bytes": factor_bytes,
        "inverse_bytes": inverse_bytes,
        "final_loss": final_loss,
    }


def split_bytes(bytes_per_step: dict[str, float]) -> dict[str, float]:
    """Total bytes per step and its factor / inverse / grad (/ other) parts."""
    parts = {"total": 0.0, "factor": 0.0, "inverse": 0.0, "grad": 0.0, "other": 0.0}
    for key, value in bytes_per_step.items():
        parts["total"] += value
        parts[BYTE_SPLIT.get(key.split("/", 1)[0], "other")] += value
    return parts


def reduce_window(
    config: Configuration, ranks: Sequence[dict[str, Any]], *, warmup: int, iters: int
) -> dict[str, Any]:
    """Combine the raw windows of all ranks into one JSON-ready window."""
    wall_s = max(r["wall_s"] for r in ranks)
    iter_s = [max(values) for values in zip(*(r["iter_s"] for r in ranks), strict=True)]
    window: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "wall_s": wall_s,
        "amortized_s": wall_s / iters,
        "median_s": statistics.median(iter_s),
        "iter_s": iter_s,
        "iter_s_rank0": ranks[0]["iter_s"],
        "final_loss": ranks[0]["final_loss"],
        "factor_updates_in_window": None,
        "inverse_updates_in_window": None,
    }
    if not config.kfac:
        return window
    extra = sorted({name for r in ranks for name in r["phase_s"]} - set(PHASES))
    phase_names = [*PHASES, *extra]
    phase_s_per_rank = [{name: r["phase_s"].get(name, 0.0) for name in phase_names} for r in ranks]
    bytes_split_per_rank = [split_bytes(r["bytes_per_step"]) for r in ranks]
    memory_per_rank = [r["factor_bytes"] + r["inverse_bytes"] for r in ranks]
    return window | {
        "factor_updates_in_window": count_schedule_hits(config.factor_update_steps, warmup, iters),
        "inverse_updates_in_window": count_schedule_hits(config.inv_update_steps, warmup, iters),
        "whole_inverse_periods": iters % config.inv_update_steps == 0,
        "phase_s": {
            name: statistics.fmean(p[name] for p in phase_s_per_rank) for name in phase_names
        },
        "phase_s_per_rank": phase_s_per_rank,
        "bytes_per_step": {
            part: statistics.fmean(b[part] for b in bytes_split_per_rank)
            for part in bytes_split_per_rank[0]
        },
        "bytes_per_step_per_rank": bytes_split_per_rank,
        "comm_per_step_per_rank": [
            {
                key: {"bytes": r["bytes_per_step"][key], "calls": r["calls_per_step"][key]}
                for key in sorted(r["bytes_per_step"])
            }
            for r in ranks
        ],
        "kfac_memory_bytes": max(memory_per_rank),
        "kfac_memory_bytes_per_rank": memory_per_rank,
        "factor_bytes_per_rank": [r["factor_bytes"] for r in ranks],
        "inverse_bytes_per_rank": [r["inverse_bytes"] for r in ranks],
    }


def summarize(
    models: Sequence[str], configs: Sequence[Configuration], rounds: Sequence[dict[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Reduce the rounds per model and configuration (medians over rounds).

    The overhead of a K-FAC configuration is computed inside each round against that round's
    SGD window (amortized times), then reduced by the median over rounds.
    """
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        entries: dict[str, dict[str, Any]] = {}
        for config in configs:
            windows = [r["windows"][model][config.key] for r in rounds]
            sgd = [r["windows"][model][SGD.key] for r in rounds]
            entry: dict[str, Any] = {
                **config.to_json(),
                "iters": windows[0]["iters"],
                "amortized_s": statistics.median(w["amortized_s"] for w in windows),
                "median_s": statistics.median(w["median_s"] for w in windows),
                "amortized_s_per_round": [w["amortized_s"] for w in windows],
                "overhead_s": None,
                "overhead_pct": None,
                "overhead_s_per_round": None,
                "overhead_pct_per_round": None,
            }
            if config.kfac:
                pairs = list(zip(windows, sgd, strict=True))
                over_s = [w["amortized_s"] - s["amortized_s"] for w, s in pairs]
                over_pct = [100.0 * (w["amortized_s"] / s["amortized_s"] - 1.0) for w, s in pairs]
                entry |= {
                    "overhead_s": statistics.median(over_s),
                    "overhead_pct": statistics.median(over_pct),
                    "overhead_s_per_round": over_s,
                    "overhead_pct_per_round": over_pct,
                    "whole_inverse_periods": all(w["whole_inverse_periods"] for w in windows),
                    "factor_updates_in_window": windows[0]["factor_updates_in_window"],
                    "inverse_updates_in_window": windows[0]["inverse_updates_in_window"],
                    "phase_s": {
                        name: statistics.median(w["phase_s"][name] for w in windows)
                        for name in windows[0]["phase_s"]
                    },
                    "bytes_per_step": {
                        part: statistics.median(w["bytes_per_step"][part] for w in windows)
                        for part in windows[0]["bytes_per_step"]
                    },
                    "kfac_memory_bytes": max(w["kfac_memory_bytes"] for w in windows),
                }
            entries[config.key] = entry
        summary[model] = entries
    return summary


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run every round on this rank (process group up); the report on rank 0, else None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = {
        model: make_batch(args.batch_size, args.seed + 1000 * (rank + 1), INPUT_SHAPES[model])
        for model in args.models
    }
    configs = configurations(world_size, args.strategies, args.schedules)
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        shift = index % len(configs)
        order = configs[shift:] + configs[:shift]
        windows: dict[str, dict[str, Any]] = {}
        for model in args.models:
            x, y = batches[model]
            model_windows: dict[str, Any] = {}
            for config in order:
                iters = args.iters_long if config.periodic else args.iters
                raw = time_window(
                    config,
                    model,
                    x,
                    y,
                    warmup=args.warmup,
                    iters=iters,
                    seed=args.seed,
                    bucket_cap_mb=args.bucket_cap_mb,
                )
                gathered: list[Any] = [None] * world_size
                dist.all_gather_object(gathered, raw)
                window = reduce_window(config, gathered, warmup=args.warmup, iters=iters)
                model_windows[config.key] = window
                if rank == 0:
                    print(
                        f"[P={world_size}] round {index + 1}/{args.rounds} {model} "
                        f"{config.label:<14} {config.schedule:<8} amortized "
                        f"{window['amortized_s']:.4f} s/iter, median "
                        f"{window['median_s']:.4f} s/iter",
                        file=sys.stderr,
                        flush=True,
                    )
                    if not math.isfinite(window["final_loss"]):
                        print(f"warning: {config.key}: non-finite loss", file=sys.stderr)
            windows[model] = {c.key: model_windows[c.key] for c in configs}
        rounds.append({"round": index, "order": [c.key for c in order], "windows": windows})
    if rank != 0:
        return None
    return {
        "world_size": world_size,
        "backend": dist.get_backend(),
        "environment": environment(),
        "configurations": [c.to_json() for c in configs],
        "rounds": rounds,
        "summary": summarize(args.models, configs, rounds),
    }


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _schedules(value: str) -> list[tuple[int, int]]:
    pairs = []
    for item in _csv(value):
        f, i = item.split(":")
        pairs.append((int(f), int(i)))
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The worker's options; the launcher passes every one of them, already validated."""
    parser = argparse.ArgumentParser(prog="python -m dkfac.bench.worker")
    parser.add_argument("--out", type=Path, required=True, help="report JSON (rank 0)")
    parser.add_argument("--models", type=_csv, required=True)
    parser.add_argument("--strategies", type=_csv, default=list(STRATEGIES))
    parser.add_argument(
        "--schedules", type=_schedules, default=list(SCHEDULES), help="f:i pairs, e.g. 1:1,10:100"
    )
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--iters-long", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Join the torchrun job (gloo, one thread), measure; rank 0 writes ``--out``."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        report = measure(args)
        if report is not None:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        dist.barrier()
    finally:
        destroy_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
