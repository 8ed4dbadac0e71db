"""Where dkfac's time goes on one GPU: per kind of step, per phase, and per decomposition.

``gpu_overhead.py`` gives the totals; this script explains them, for one model at a time:

* **Step kinds** of the ``(10, 100)`` schedule, each step timed alone (the device is waited
  for before and after): plain steps, factor steps and decomposition steps against SGD's
  step, and the amortised overhead they add up to.
* **Phases**: ``torch.profiler`` over one step of each kind; the device time spent inside
  each ``dkfac/<phase>`` range and the top kernels (tables written to ``--out``).
* **Decompositions**: the factors after the warm-up decomposed every way torch offers
  (eigh / Cholesky inverse / ``inv``, one at a time or batched by size, on the GPU or the
  host CPU; Cholesky inverses also per size, one at a time against batched), and ``eigh``
  on kfac-pytorch's own factors: identity-started running averages ``w I + (1 - w) F``
  (``w = 0.95^k`` after ``k`` updates), as they are after a short warm-up and with the
  identity removed (as they are after a long run).

Usage::

    python benchmarks/gpu_breakdown.py --models resnet32,resnet50 --out runs/gpu_breakdown
    python benchmarks/gpu_breakdown.py --device cpu --quick      # smoke test anywhere
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dkfac
from gpu_overhead import (
    CHANNELS_LAST,
    LR,
    MODELS,
    ModelSpec,
    eigh_seconds,
    environment,
    fresh_model,
    install_kfac_pytorch,
    kfac_pytorch_version,
    parse_options,
    synchronize,
)

Batch = tuple[torch.Tensor, torch.Tensor]


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes, the device waited for before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def step_kinds(
    spec: ModelSpec,
    method: str,
    batch: Batch,
    steps: int,
    out: Path,
    options: dict[str, Any] | None = None,
    channels_last: bool = False,
) -> dict[str, Any]:
    """Each step of a ``(10, 100)`` dkfac run timed alone, by kind; SGD's step alongside.

    ``options``: more KFACPreconditioner keywords; ``channels_last``: the network (SGD's and
    dkfac's) in that format (the batch must be too).
    """
    x, y = batch
    device = x.device
    model, optimizer = fresh_model(spec, device, channels_last)

    def sgd_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        sgd_step()
    sgd = [timed(sgd_step, device) for _ in range(10)]
    model, optimizer = fresh_model(spec, device, channels_last)
    pre = dkfac.KFACPreconditioner(
        model,
        inverse_method=method,
        lr=LR,
        factor_update_steps=10,
        inv_update_steps=100,
        **(options or {}),
    )
    kinds: dict[str, list[float]] = {"plain": [], "factors": [], "decomposition": []}
    kfac_part: dict[str, list[float]] = {"plain": [], "factors": [], "decomposition": []}
    profiled: set[str] = set()
    for step in range(steps):
        kind = "decomposition" if step % 100 == 0 else "factors" if step % 10 == 0 else "plain"

        def forward_backward() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

        def kfac_and_update() -> None:
            pre.step()
            optimizer.step()

        # Profiled: each kind's first step from the second decomposition on (step 0 plans
        # things once); timed: every other step after it (``steps`` > 200 to time one
        # decomposition).
        if step >= 100 and kind not in profiled:
            profiled.add(kind)
            profile_step(forward_backward, kfac_and_update, out / f"{spec.name}_{method}_{kind}")
            continue
        first = timed(forward_backward, device)
        second = timed(kfac_and_update, device)
        if step > 100:
            kinds[kind].append(first + second)
            kfac_part[kind].append(second)
    pre.remove()
    sgd_s = statistics.median(sgd)
    medians = {kind: statistics.median(v) for kind, v in kinds.items() if v}
    amortised = (
        0.9 * medians["plain"] + 0.09 * medians["factors"] + 0.01 * medians["decomposition"]
        if len(medians) == 3
        else None
    )
    return {
        "sgd_step_s": sgd_s,
        "step_s": medians,
        "kfac_and_optimizer_s": {k: statistics.median(v) for k, v in kfac_part.items() if v},
        "counted": {kind: len(v) for kind, v in kinds.items()},
        "amortised_s": amortised,
        "amortised_overhead_pct": None if amortised is None else 100 * (amortised / sgd_s - 1),
    }


def device_time_us(event: Any) -> float:
    """An averaged profiler event's device time in microseconds (either attribute name)."""
    for name in ("device_time_total", "cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(
    forward_backward: Callable[[], None], kfac_and_update: Callable[[], None], stem: Path
) -> None:
    """One step under ``torch.profiler``: ``stem``.txt (top ops), ``stem``.json (phases)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        forward_backward()
        with torch.profiler.record_function("kfac_and_optimizer"):
            kfac_and_update()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    unit = "cuda" if torch.cuda.is_available() else "cpu"
    tables = [
        averages.table(sort_by=f"{order}{unit}_time_total", row_limit=40) for order in ("", "self_")
    ]
    stem.with_suffix(".txt").write_text("\n\n".join(tables))
    phases = {
        e.key: {"device_us": device_time_us(e), "cpu_us": float(e.cpu_time_total), "n": e.count}
        for e in averages
        if e.key.startswith("dkfac/") or e.key == "kfac_and_optimizer"
    }
    stem.with_suffix(".json").write_text(json.dumps(phases, indent=1))


def warm_factors(
    spec: ModelSpec,
    batch: Batch,
    steps: int,
    options: dict[str, Any] | None = None,
    channels_last: bool = False,
) -> list[torch.Tensor]:
    """The running factors of dkfac (both sides of every layer) after ``steps`` updates.

    ``options`` and ``channels_last`` as for :func:`step_kinds`.
    """
    x, y = batch
    model, optimizer = fresh_model(spec, x.device, channels_last)
    pre = dkfac.KFACPreconditioner(model, lr=LR, inv_update_steps=10**6, **(options or {}))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    factors = [f.detach().clone() for pair in pre.factors().values() for f in pair]
    pre.remove()
    return factors


def by_size(matrices: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """Matrices grouped by side length."""
    groups: dict[int, list[torch.Tensor]] = {}
    for matrix in matrices:
        groups.setdefault(matrix.shape[0], []).append(matrix)
    return groups


def damped(matrix: torch.Tensor) -> torch.Tensor:
    """``F + 1e-3 tr(F)/d I`` (positive definite for the Cholesky variants)."""
    shift = 1e-3 * torch.diagonal(matrix).mean().clamp_min(1e-12)
    return matrix + shift * torch.eye(matrix.shape[0], device=matrix.device, dtype=matrix.dtype)


def decomposition_variants(factors: list[torch.Tensor]) -> dict[str, float]:
    """Seconds to decompose all ``factors`` each way (one warm-up pass first)."""
    device = factors[0].device
    positive = [damped(f) for f in factors]
    groups = by_size(factors)
    positive_groups = by_size(positive)

    def cholesky_inverse(m: torch.Tensor) -> torch.Tensor:
        lower, _ = torch.linalg.cholesky_ex(m)
        return torch.cholesky_inverse(lower)

    def triangular_solve_and_product(m: torch.Tensor) -> torch.Tensor:
        # The same inverse as L⁻ᵀ L⁻¹: one triangular solve and one product (as LAPACK's
        # potri), against CUDA's cholesky_inverse, which solves against the identity. In IEEE
        # float32 whatever --tf32 says: a TF32 product would lose the inverse's accuracy.
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            lower, _ = torch.linalg.cholesky_ex(m)
            eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device).expand_as(m)
            lower_inverse = torch.linalg.solve_triangular(lower, eye, upper=False)
            inverse: torch.Tensor = lower_inverse.mT @ lower_inverse
            return inverse
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    variants: dict[str, Callable[[], Any]] = {
        "eigh_one_at_a_time": lambda: [torch.linalg.eigh(f) for f in factors],
        "eigh_batched_by_size": lambda: [
            torch.linalg.eigh(torch.stack(g)) for g in groups.values()
        ],
        "cholesky_inverse_one_at_a_time": lambda: [cholesky_inverse(m) for m in positive],
        "cholesky_inverse_batched_by_size": lambda: [
            cholesky_inverse(torch.stack(g)) for g in positive_groups.values()
        ],
        "triangular_solve_and_product_one_at_a_time": lambda: [
            triangular_solve_and_product(m) for m in positive
        ],
        # inverse_method="cholesky": the factorisation alone (its solves run on every step).
        "cholesky_factor_one_at_a_time": lambda: [torch.linalg.cholesky_ex(m) for m in positive],
        "cholesky_factor_batched_by_size": lambda: [
            torch.linalg.cholesky_ex(torch.stack(g)) for g in positive_groups.values()
        ],
        "inv_ex_one_at_a_time": lambda: [torch.linalg.inv_ex(m) for m in positive],
        "inv_ex_batched_by_size": lambda: [
            torch.linalg.inv_ex(torch.stack(g)) for g in positive_groups.values()
        ],
    }
    if device.type == "cuda":

        def eigh_on_host() -> None:
            host = [f.to("cpu", non_blocking=True) for f in factors]
            torch.cuda.synchronize()
            results = [torch.linalg.eigh(f) for f in host]
            for values, vectors in results:
                values.to(device, non_blocking=True), vectors.to(device, non_blocking=True)

        variants["eigh_on_host_cpu"] = eigh_on_host
    seconds: dict[str, float] = {}
    for name, fn in variants.items():
        fn()
        seconds[name] = timed(fn, device)
    return seconds


def cholesky_inverse_by_size(factors: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per side length shared by several factors: Cholesky inverses one at a time and batched.

    Where batching pays is a matter of size (ResNet-32's factors gained, ResNet-50's lost in
    total): these are what a size limit for ``batched_decompositions`` would be set from.
    """
    device = factors[0].device
    result: dict[str, dict[str, float]] = {}
    for dim, group in sorted(by_size([damped(f) for f in factors]).items()):
        if len(group) < 2:
            continue

        def one_at_a_time(group: list[torch.Tensor] = group) -> None:
            for m in group:
                torch.cholesky_inverse(torch.linalg.cholesky_ex(m)[0])

        def batched(group: list[torch.Tensor] = group) -> None:
            torch.cholesky_inverse(torch.linalg.cholesky_ex(torch.stack(group))[0])

        row = {"count": float(len(group))}
        for label, fn in (("one_at_a_time_s", one_at_a_time), ("batched_s", batched)):
            fn()
            row[label] = timed(fn, device)
        result[str(dim)] = row
    return result


def kfac_pytorch_factors(spec: ModelSpec, batch: Batch, steps: int) -> dict[str, Any]:
    """Time ``eigh`` on kfac-pytorch's factors after ``steps`` updates, with, without identity."""
    kfac = importlib.import_module("kfac.preconditioner")
    x, y = batch
    model, optimizer = fresh_model(spec, x.device)
    pre = kfac.KFACPreconditioner(model, lr=LR, factor_update_steps=1, inv_update_steps=10**6)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    factors = []
    for _, layer in pre._layers.values():  # its factors have no public getter
        factors += [layer.a_factor.detach().clone(), layer.g_factor.detach().clone()]
    weight = 0.95**steps
    without_identity = [
        (f - weight * torch.eye(f.shape[0], device=f.device, dtype=f.dtype)) / (1 - weight)
        for f in factors
    ]
    return {
        "steps": steps,
        "identity_weight": weight,
        "factors": len(factors),
        "eigh_s_as_held": eigh_seconds(factors),
        "eigh_s_identity_removed": eigh_seconds(without_identity),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="resnet32,resnet50")
    parser.add_argument("--methods", default="inverse,eigen")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=211, help="(10,100) steps run per method")
    parser.add_argument(
        "--tf32", action="store_true", help="also rerun the step kinds with TF32 matmuls"
    )
    parser.add_argument(
        "--tf32-only", action="store_true", help="run the step kinds with TF32 matmuls only"
    )
    parser.add_argument(
        "--options", type=parse_options, default={}, help="more dkfac keywords, a JSON object"
    )
    parser.add_argument(
        "--channels-last", action="store_true", help="network and inputs in channels-last"
    )
    parser.add_argument("--warm-steps", type=int, default=5, help="factor updates before probes")
    parser.add_argument("--install-kfac-pytorch", default="", metavar="SOURCE")
    parser.add_argument("--image-size", type=int, default=0)
    parser.add_argument(
        "--parts", default="steps,decompositions,kfac-pytorch", help="which parts to run"
    )
    parser.add_argument("--out", default="runs/gpu_breakdown")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny everything")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every part for every model; JSON (and profiler tables) under ``--out``."""
    args = parse_args(argv)
    out = Path(args.out)
    (out / "tf32").mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = args.tf32_only
    note = install_kfac_pytorch(args.install_kfac_pytorch) if args.install_kfac_pytorch else ""
    theirs = kfac_pytorch_version()
    result: dict[str, Any] = {
        "environment": environment(device),
        "kfac_pytorch": theirs or f"not measured {note}".strip(),
        "options": args.options,
        "channels_last": args.channels_last,
        "models": {},
    }
    path = out / "gpu_breakdown.json"
    for name in args.models.split(","):
        spec = MODELS[name]
        size = args.image_size or (8 if args.quick else spec.image_size)
        batch_size = 4 if args.quick else args.batch_size
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, 3, size, size, generator=generator).to(device)
        y = torch.randint(0, spec.num_classes, (batch_size,), generator=generator).to(device)
        if args.channels_last:
            x = x.contiguous(memory_format=CHANNELS_LAST)
        entry: dict[str, Any] = {"image_size": size, "batch_size": batch_size}
        result["models"][name] = entry
        parts = args.parts.split(",")
        for method in args.methods.split(",") if "steps" in parts else []:
            label = f"steps_{method}" + ("_tf32" if args.tf32_only else "")
            entry[label] = step_kinds(
                spec, method, (x, y), args.steps, out, args.options, args.channels_last
            )
            print(name, method, entry[label], flush=True)
            path.write_text(json.dumps(result, indent=1))
            if args.tf32 and not args.tf32_only and device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = True
                try:
                    entry[f"steps_{method}_tf32"] = step_kinds(
                        spec,
                        method,
                        (x, y),
                        args.steps,
                        out / "tf32",
                        args.options,
                        args.channels_last,
                    )
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = False
                print(name, method, "tf32", entry[f"steps_{method}_tf32"], flush=True)
        if "decompositions" not in parts and "kfac-pytorch" not in parts:
            continue
        factors = warm_factors(spec, (x, y), args.warm_steps, args.options, args.channels_last)
        entry["factor_sizes"] = sorted(f.shape[0] for f in factors)
        if "decompositions" in parts:
            entry["decompositions_s"] = decomposition_variants(factors)
            entry["cholesky_inverse_by_size"] = cholesky_inverse_by_size(factors)
            print(name, entry["decompositions_s"], flush=True)
            print(name, entry["cholesky_inverse_by_size"], flush=True)
        if theirs and "kfac-pytorch" in parts:
            entry["kfac_pytorch_eigh"] = kfac_pytorch_factors(spec, (x, y), args.warm_steps)
            entry["dkfac_eigh_s_same_steps"] = eigh_seconds(factors)
            print(name, entry["kfac_pytorch_eigh"], entry["dkfac_eigh_s_same_steps"], flush=True)
        path.write_text(json.dumps(result, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
