"""The seed papers' ResNet-50 cluster, simulated: do the simulator's predictions match them?

A V100-like compute profile is derived from ResNet-50's per-layer multiply-adds and a V100's
sustained rates (:mod:`dkfac.sim.flops`; the figures and their sources are below), the link
is 10 Gbit/s Ethernet (NCCL, one worker per link), and ``dkfac simulate``'s timeline predicts
SGD and every K-FAC strategy at P = 64, schedule (1, 1). The seeds' figures
(``../shared/ALGORITHMS.md``, issue 14) are printed next to the predictions: D-KFAC's iteration
(SGD 0.199 s, D-KFAC 0.882 s, of which factor communication 0.300 s), SPD 10-35% and PAD up
to 36% faster than D-KFAC, DP-KFAC 2.79-3.15x less communication and 1.14-1.47x less memory
per second-order update than D-KFAC. Writes ``seed_reproduction.json`` to ``--out``, and the
V100-like profile as ``profile_resnet50_v100_<method>.json`` (``dkfac simulate --profile``).

DP-KFAC's paper counts a whole worker: every byte a step sends (the gradients' allreduce
included) and every byte a worker holds. The simulator's own ratios cover K-FAC's collectives
and state only, so the script also derives whole-worker figures: a step's busiest uplink with
the gradients, and the memory of the model's weights, gradients and momentum, the
activations autograd saves for the backward pass (counted at one image on this machine's
CPU, once per distinct storage, times the batch) and K-FAC's state.

Usage::

    .venv/bin/python benchmarks/seed_reproduction.py
    .venv/bin/python benchmarks/seed_reproduction.py --network 100gbit,5us --comm-dtype float16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dkfac.bench.link_shape import LinkShape
from dkfac.comm.cost_model import CubicCost
from dkfac.models.imagenet_resnet import resnet50
from dkfac.sim.flops import DeviceRates, flop_profile, resnet50_work
from dkfac.sim.network import LinkModel
from dkfac.sim.run import SGD, SimulatedCluster, SimulatedRun
from dkfac.sim.timeline import settings_of, simulate
from dkfac.strategies.accounting import account_strategy

#: A V100 (SXM2, 16 GB, float32), every figure an assumption stated with its basis:
#: ResNet-50 float32 training throughput about 360 images/s at batch 32 (NVIDIA's published
#: float32 figures for a V100 are near 390/s at larger batches); SGEMM sustained 12 TFLOP/s
#: (15.7 peak); copies at 800 GB/s (900 peak HBM2); cuSOLVER's float32 ``syevd`` about
#: 0.45 s at d = 4608 and a few ms of start-up (c3 = 4.5e-12), a Cholesky inverse about
#: 25 ms at d = 4608 (c3 = 2.5e-13).
V100 = DeviceRates(
    name="V100-like",
    samples_per_s=360.0,
    gemm_flops_per_s=12e12,
    memory_bytes_per_s=800e9,
    eigen=CubicCost(3e-3, 4.5e-12),
    inverse=CubicCost(1e-3, 2.5e-13),
)

SEED = {
    "sgd_s": 0.199,
    "dkfac_s": 0.882,
    "dkfac_factor_comm_s": 0.300,
    "spd_gain": (0.10, 0.35),
    "pad_gain_max": 0.36,
    "dp_comm_saving": (2.79, 3.15),
    "dp_memory_saving": (1.14, 1.47),
}
STRATEGIES = ("sgd", "dkfac", "kaisa", "spd", "pad", "dp")
BATCH = 32
BATCH_NORM_BYTES = 4 * 53_120  # ResNet-50's BatchNorm weights and biases
#: Copies of the weights a worker of SGD with momentum holds: weights, gradients, momentum.
MODEL_STATE_COPIES = 3


def saved_activation_bytes(model: torch.nn.Module, example: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward pass of one forward of ``example``.

    Counted once per storage (a ReLU's output that the next convolution saves again is one
    tensor), parameters excluded (a convolution saves its weight, which the model holds anyway).
    """
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(example).sum()
    return sum(seen.values())


def whole_worker_bytes(per_image_activations: int) -> dict[str, int]:
    """ResNet-50's memory per worker besides K-FAC: weights, gradients, momentum, activations."""
    parameters = sum(p.numel() for p in resnet50().parameters())
    return {
        "model_state": MODEL_STATE_COPIES * 4 * parameters,
        "activations": per_image_activations * BATCH,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--network", default="10gbit,50us", help="RATE[,DELAY] per worker")
    parser.add_argument("--method", default="eigen", choices=("eigen", "inverse"))
    parser.add_argument(
        "--comm-dtype", default=None, choices=("float16", "bfloat16"), help="K-FAC's transport"
    )
    parser.add_argument("--out", default="runs/seed_reproduction")
    args = parser.parse_args(argv)
    profile = flop_profile(
        resnet50_work(), V100, BATCH, other_grad_bytes=BATCH_NORM_BYTES, inverse_method=args.method
    )
    link = LinkModel.from_link_shape(LinkShape.parse(args.network))
    cluster = SimulatedCluster(args.world_size, link, backend="nccl")
    rows: list[dict[str, Any]] = []
    for strategy in STRATEGIES:
        fraction = 1.0 / args.world_size if strategy == "kaisa" else 1.0
        run = SimulatedRun(
            strategy,
            grad_worker_fraction=fraction,
            inverse_method=args.method,
            comm_dtype=args.comm_dtype,
        )
        began = time.perf_counter()
        prediction = simulate(profile, cluster, run)
        step = prediction.steps[0]
        rows.append(
            {
                "strategy": strategy,
                "label": run.label,
                "iteration_s": prediction.iteration_s,
                "stages_s": step.stages,
                "busiest_uplink_bytes": step.wire_bytes,
                "simulated_in_s": time.perf_counter() - began,
            }
        )
        print(f"{run.label:24s} {prediction.iteration_s:8.3f} s/iter", flush=True)
    by = {row["strategy"]: row for row in rows}
    kfac = SimulatedRun("dkfac", inverse_method=args.method, comm_dtype=args.comm_dtype)
    settings = settings_of(profile, cluster, kfac)
    memory, sent = {}, {}
    for strategy in ("dkfac", "dp"):
        accounts = account_strategy(strategy, profile.shapes, settings)
        memory[strategy] = max(a.factor_bytes + a.inverse_bytes for a in accounts)
        sent[strategy] = max(a.wire_bytes for a in accounts)
    torch.manual_seed(0)
    worker = whole_worker_bytes(saved_activation_bytes(resnet50(), torch.randn(1, 3, 224, 224)))
    besides = sum(worker.values())
    held = {**worker, "kfac_dkfac": memory["dkfac"], "kfac_dp": memory["dp"]}
    dkfac = by["dkfac"]
    derived = {
        "sgd_s": by[SGD]["iteration_s"],
        "dkfac_s": dkfac["iteration_s"],
        "dkfac_factor_comm_s": dkfac["stages_s"].get("factor_exchange", 0.0),
        "spd_gain": 1 - by["spd"]["iteration_s"] / dkfac["iteration_s"],
        "pad_gain": 1 - by["pad"]["iteration_s"] / dkfac["iteration_s"],
        "dp_comm_saving": sent["dkfac"] / sent["dp"],
        "dp_memory_saving": memory["dkfac"] / memory["dp"],
        "dp_comm_saving_whole_step": (
            dkfac["busiest_uplink_bytes"] / by["dp"]["busiest_uplink_bytes"]
        ),
        "dp_memory_saving_whole_worker": (besides + memory["dkfac"]) / (besides + memory["dp"]),
    }
    print()
    print(f"{'figure':28s} {'seed':>14s} {'simulated':>10s}")
    for name, value in derived.items():
        seed = SEED.get(name.removesuffix("_whole_step").removesuffix("_whole_worker"))
        seed = SEED["pad_gain_max"] if name == "pad_gain" else seed
        text = "-" if seed is None else str(seed)
        print(f"{name:28s} {text:>14s} {value:10.3f}")
    print("\nD-KFAC's stages (s):", {k: round(v, 3) for k, v in dkfac["stages_s"].items()})
    print("A worker's memory (MB):", {k: round(v / 1e6) for k, v in held.items()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "seed_reproduction",
        "settings": {**vars(args), "batch_size": BATCH, "device": repr(V100)},
        "seed": SEED,
        "derived": derived,
        "worker_bytes": held,
        "rows": rows,
        "profile": profile.to_dict(),
    }
    (out / "seed_reproduction.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    # The V100-like profile on its own, for dkfac simulate --profile (other networks, P).
    profile_path = out / f"profile_resnet50_v100_{args.method}.json"
    profile.save(profile_path)
    print(f"\nresults: {out / 'seed_reproduction.json'}")
    print(f"profile: {profile_path} (dkfac simulate --profile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
