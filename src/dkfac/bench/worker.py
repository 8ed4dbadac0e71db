"""One rank of ``dkfac bench``: time DDP + SGD against the K-FAC strategies.

Started by :mod:`dkfac.bench.command` through torchrun, as a module so that it runs from an
installed package::

    python -m torch.distributed.run --standalone --nproc_per_node=P -m dkfac.bench.worker ...

gloo process group (``--device cuda``: GPU ``LOCAL_RANK``, NCCL), one intra-op thread, a
fixed synthetic batch per rank and model
(``--batch-size`` per worker, each model's input shape from
:data:`~dkfac.bench.models.INPUT_SHAPES`: 3x32x32 images for the CIFAR ResNets, vectors of
1024 features for ``mlp6``, 64 token ids with their next tokens as targets for
``transformer``), SGD (momentum 0.9, lr 0.1) on a DDP-wrapped model.
Configurations: SGD alone (DDP, no K-FAC); SGD with :class:`dkfac.DeAR` averaging the
gradients instead of DDP when ``dear`` is among ``--strategies`` (its bucket size search runs
inside the warm-up); then per ``(f, i)`` schedule ``strategy="dkfac"``,
``strategy="kaisa"`` with ``grad_worker_fraction`` 1/P (and 1/2 when P > 2 is even),
``strategy="spd"``, ``strategy="pad"`` and ``strategy="dp"``, all with
``inverse_method="eigen"``. SPD-KFAC and PAD-KFAC calibrate their cost model when the
preconditioner is built (all ranks together), before the warm-up.

Every configuration gets a freshly built model (same seed), its own warm-up and a timed window
that starts after a ``dist.barrier()``. Periodic configurations (``f > 1`` or ``i > 1``) time
``--iters-long`` iterations, the others ``--iters``. The configurations run interleaved in
rounds (the order rotates from round to round); the overhead of every configuration but SGD
is taken inside a round against that round's SGD window, then reduced by the median over
rounds (negative: faster than DDP + SGD). Rank 0
writes the report (raw rounds and the per-model summary) to ``--out``.

This module runs the rounds on this rank and writes the report; one window is timed by
:mod:`dkfac.bench.timed_window` and combined across ranks and rounds by
:mod:`dkfac.bench.window_reduction`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dkfac.bench.configs import (
    SCHEDULES,
    STRATEGIES,
    comma_separated,
    configurations,
    environment,
    parse_schedules,
)
from dkfac.bench.models import make_batch as make_batch
from dkfac.bench.models import model_batch
from dkfac.bench.timed_window import time_window
from dkfac.bench.window_reduction import reduce_window, summarize
from dkfac.cli.device import backend_for, local_slot
from dkfac.comm import destroy_process_groups


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run every round on this rank (process group up); the report on rank 0, else None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = worker_device(args.device)
    batches = {
        model: tuple(
            t.to(device) for t in model_batch(model, args.batch_size, args.seed + 1000 * (rank + 1))
        )
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
                    device=device,
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
        "device": str(device),
        "environment": environment(),
        "configurations": [c.to_json() for c in configs],
        "rounds": rounds,
        "summary": summarize(args.models, configs, rounds),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The worker's options; the launcher passes every one of them, already validated."""
    parser = argparse.ArgumentParser(prog="python -m dkfac.bench.worker")
    parser.add_argument("--out", type=Path, required=True, help="report JSON (rank 0)")
    parser.add_argument("--models", type=comma_separated, required=True)
    parser.add_argument("--strategies", type=comma_separated, default=list(STRATEGIES))
    parser.add_argument(
        "--schedules", type=parse_schedules, default=SCHEDULES, help="f:i pairs, e.g. 1:1,10:100"
    )
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--iters-long", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_args(argv)


def worker_device(kind: str) -> torch.device:
    """This worker's device: ``cuda:LOCAL_RANK`` (torchrun's) for ``"cuda"``, else the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", local_slot().rank)


def main(argv: Sequence[str] | None = None) -> int:
    """Join the torchrun job (gloo, one thread), measure; rank 0 writes ``--out``."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = worker_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))
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
