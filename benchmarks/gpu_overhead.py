"""Per-iteration cost of dkfac on one GPU against SGD and kfac-pytorch, side by side.

Models: a ResNet-50 (ImageNet shapes, 224x224 inputs by default) and a ResNet-32 (CIFAR
shapes, 32x32), batch 128, synthetic data, one process on one device. Configurations: plain
SGD; dkfac and kfac-pytorch with ``(factor_update_steps, inv_update_steps)`` in ``{(1, 1),
(10, 100)}`` x ``{eigen, inverse}`` (and dkfac's ``cholesky``: ``inverse``'s preconditioner by
triangular solves, compared with kfac-pytorch's ``inverse``). Every configuration builds its
model afresh (same seed), warms up, then times a window (synchronised with the device at
both ends); a (10, 100) window is exactly one inverse period (one decomposition, ten factor
updates) after a warm-up that holds the first decomposition. Configurations run interleaved
in rounds; each overhead is against the same round's SGD, reduced by the median over rounds.

dkfac's host waits are counted too (CUDA's synchronisation detector): per plain step, factor
update and decomposition step of the (10, 100) schedule.

kfac-pytorch is not on PyPI: ``--install-kfac-pytorch SOURCE`` pip-installs it into a
temporary folder first (default source: its public repository; a wheel built from it on a
machine without network). Without it the kfac-pytorch rows are reported as not measured.

Usage::

    python benchmarks/gpu_overhead.py --out runs/gpu_overhead \
        --install-kfac-pytorch git+https://github.com/gpauloski/kfac-pytorch
    python benchmarks/gpu_overhead.py --device cpu --quick     # smoke test anywhere
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac.bench.configs import git_commit, source_digest
from dkfac.bench.cuda_syncs import cuda_syncs
from dkfac.curvature.inverse import check_method_precision
from dkfac.models.imagenet_resnet import resnet50
from dkfac.models.resnet import resnet32

LR = 0.1
MOMENTUM = 0.9
CHANNELS_LAST = torch.channels_last
KFAC_PYTORCH_REPOSITORY = "git+https://github.com/gpauloski/kfac-pytorch"
#: Amortised overhead over SGD that issue 17 asks of dkfac at (10, 100) (Distributed
#: Shampoo's figure for its own preconditioner), and the (1, 1) overhead as a fraction of
#: kfac-pytorch's in the same run.
TARGET_AMORTISED_PCT = 10.0
TARGET_FRACTION_OF_KFAC_PYTORCH = 0.5


@dataclass(frozen=True)
class ModelSpec:
    """A benchmarked network and its synthetic inputs."""

    name: str
    build: Callable[[int], nn.Module]
    image_size: int
    num_classes: int


MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec("resnet50", resnet50, 224, 1000),
    "resnet32": ModelSpec("resnet32", resnet32, 32, 10),
}


@dataclass(frozen=True)
class Configuration:
    """Plain SGD (``library=None``) or SGD with one library's K-FAC preconditioner."""

    key: str
    library: str | None = None
    method: str = "eigen"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def periodic(self) -> bool:
        """Whether the decompositions happen on some iterations only."""
        return self.inv_update_steps > 1


#: dkfac's variants besides its defaults: label -> KFACPreconditioner keywords.
BUILTIN_VARIANTS: dict[str, dict[str, Any]] = {"dkfac-bf16": {"statistics_precision": "bf16"}}


#: The keywords every configuration sets itself (a variant may not).
FIXED_KEYWORDS = ("inverse_method", "lr", "factor_update_steps", "inv_update_steps")


def parse_options(text: str) -> dict[str, Any]:
    """A JSON object of more KFACPreconditioner keywords, none of :data:`FIXED_KEYWORDS`."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object of keywords")
    fixed = sorted(set(parsed) & set(FIXED_KEYWORDS))
    if fixed:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {', '.join(fixed)} set by every configuration, not by a variant"
        )
    return parsed


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``LABEL=JSON`` (``--variant``): a dkfac variant's label and its keyword options."""
    label, options = labelled_options(text)
    if not label.startswith("dkfac-") or "_" in label:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL=JSON with LABEL 'dkfac-<name>' (no '_')"
        )
    return label, options


def labelled_options(text: str) -> tuple[str, dict[str, Any]]:
    """``LABEL=JSON`` with any label: a run's label and its KFACPreconditioner keywords."""
    label, sep, options = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL=JSON")
    return label, parse_options(options)


def add_variant_argument(parser: argparse.ArgumentParser) -> None:
    """``--variant LABEL=JSON`` (repeatable; :func:`labelled_options`), for per-step probes."""
    parser.add_argument(
        "--variant",
        type=labelled_options,
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="a run with more KFACPreconditioner keywords (repeatable; default: dkfac's defaults)",
    )


#: Each library's methods: dkfac's "cholesky" is "inverse"'s preconditioner by triangular
#: solves (no inverse formed), which kfac-pytorch does not have.
METHODS: dict[str, tuple[str, ...]] = {
    "dkfac": ("eigen", "inverse", "cholesky"),
    "kfac-pytorch": ("eigen", "inverse"),
}
#: The kfac-pytorch method each dkfac method is compared with: the same preconditioner.
SAME_PRECONDITIONER = {"eigen": "eigen", "inverse": "inverse", "cholesky": "inverse"}


def refused(method: str, options: dict[str, Any]) -> bool:
    """Whether the library refuses ``method`` with ``options``' preconditioning precision."""
    try:
        check_method_precision(method, options.get("precondition_precision", "highest"))
    except ValueError:
        return True
    return False


def configurations(
    libraries: list[str], variants: dict[str, dict[str, Any]] | None = None
) -> list[Configuration]:
    """SGD, then each library (and dkfac variant) x method x schedule.

    dkfac runs with its defaults, then once per variant (``BUILTIN_VARIANTS``, e.g.
    ``dkfac-bf16_*`` with ``statistics_precision="bf16"``, plus ``variants``) with those
    keywords added.
    """
    result = [Configuration("sgd")]
    runs: list[tuple[str, str, dict[str, Any]]] = [(lib, lib, {}) for lib in libraries]
    if "dkfac" in libraries:
        extra = {**BUILTIN_VARIANTS, **(variants or {})}
        runs[1:1] = [(label, "dkfac", options) for label, options in extra.items()]
    for label, library, options in runs:
        for fu, iu in ((1, 1), (10, 100)):
            for method in METHODS[library]:
                if refused(method, options):  # a pair the library refuses: no row
                    continue
                key = f"{label}_{method}_{fu}_{iu}"
                keywords = tuple(sorted(options.items()))
                result.append(Configuration(key, library, method, fu, iu, keywords))
    return result


def kfac_preconditioner(config: Configuration, model: nn.Module) -> Any:
    """The configuration's preconditioner over ``model`` (its ``step()`` runs K-FAC)."""
    if config.library == "dkfac":
        return dkfac.KFACPreconditioner(
            model,
            inverse_method=config.method,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            **dict(config.options),
        )
    kfac = importlib.import_module("kfac.preconditioner")
    return kfac.KFACPreconditioner(
        model,
        compute_method=config.method,
        lr=LR,
        factor_update_steps=config.factor_update_steps,
        inv_update_steps=config.inv_update_steps,
    )


def fresh_model(
    spec: ModelSpec, device: torch.device, channels_last: bool = False
) -> tuple[nn.Module, torch.optim.SGD]:
    """``spec``'s network from seed 0 on ``device``, and its SGD (every measurement's start).

    ``channels_last``: the network's convolution weights in channels-last memory format (the
    inputs must be too), as GPU users of convolutional networks often train them.
    """
    torch.manual_seed(0)
    model = spec.build(spec.num_classes).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_window(
    spec: ModelSpec,
    config: Configuration,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    warmup: int,
    iters: int,
    channels_last: bool = False,
) -> dict[str, Any]:
    """Build a fresh model for ``config``, warm it up, time ``iters`` iterations.

    ``channels_last``: the network in that format (the batch must be too).
    """
    start_memory = 0
    if device.type == "cuda":  # each window's own peak, not the process's so far
        gc.collect()  # the previous window's model and preconditioner, freed before it starts
        torch.cuda.reset_peak_memory_stats(device)
        start_memory = torch.cuda.memory_allocated(device)
    x, y = batch
    model, optimizer = fresh_model(spec, device, channels_last)
    pre = kfac_preconditioner(config, model) if config.library else None

    def iteration() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if pre is not None:
            pre.step()
        optimizer.step()
        return loss

    for _ in range(warmup):
        iteration()
    synchronize(device)
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(iters):
            loss = iteration()
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    if config.library == "dkfac":
        pre.remove()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "warmup": warmup,
        "iters": iters,
        "window_s": seconds,
        "amortized_s": seconds / iters,
        "final_loss": float(loss.detach()),
        "peak_memory_bytes": peak,
        # What the window added at its peak: comparable between windows (the peak alone also
        # counts what was allocated when it began, the batch and anything not yet freed).
        "memory_at_start_bytes": start_memory,
        "peak_above_start_bytes": peak - start_memory if peak else 0,
    }


def host_waits(
    spec: ModelSpec, batch: tuple[torch.Tensor, torch.Tensor], channels_last: bool = False
) -> dict[str, Any]:
    """Dkfac's host waits per kind of step of the (10, 100) schedule, both methods (CUDA)."""
    result: dict[str, Any] = {}
    x, y = batch
    for method in ("eigen", "inverse"):
        model, optimizer = fresh_model(spec, x.device, channels_last)
        pre = dkfac.KFACPreconditioner(
            model, inverse_method=method, lr=LR, factor_update_steps=10, inv_update_steps=100
        )
        counts: dict[str, list[int]] = {"plain": [], "factors": [], "decomposition": []}
        for step in range(101):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)

            def kfac_part(loss: torch.Tensor = loss, pre: Any = pre) -> None:
                loss.backward()
                pre.step()

            waits = len(cuda_syncs(kfac_part))
            optimizer.step()
            if step == 0:
                continue  # the first step plans the convolutions' patch Grams once
            kind = "decomposition" if step % 100 == 0 else "factors" if step % 10 == 0 else "plain"
            counts[kind].append(waits)
        pre.remove()
        result[method] = {kind: max(values) for kind, values in counts.items()}
        result[method]["layers"] = len(pre.layers)
    return result


def eigh_seconds(matrices: list[torch.Tensor]) -> float:
    """Seconds of ``eigh`` on each matrix in turn (warm-up calls first, the device waited for)."""
    for matrix in matrices[:4]:  # warm the solver's workspaces
        torch.linalg.eigh(matrix)
    device = matrices[0].device
    synchronize(device)
    start = time.perf_counter()
    for matrix in matrices:
        torch.linalg.eigh(matrix)
    synchronize(device)
    return time.perf_counter() - start


def eigh_probe(
    spec: ModelSpec, batch: tuple[torch.Tensor, torch.Tensor], steps: int
) -> dict[str, Any]:
    """Why an eigen step costs what it does: eigh time on dkfac's factors after ``steps``.

    dkfac's running factors start from the first batch's; kfac-pytorch's start from the
    identity, so after ``k`` steps its factors are ``0.95^k I + (1 - 0.95^k) F``-like, whose
    clustered spectrum a divide-and-conquer eigensolver deflates early. Timing ``eigh`` on
    both forms of the same factors separates that from the libraries' own code.
    """
    x, y = batch
    model, optimizer = fresh_model(spec, x.device)
    pre = dkfac.KFACPreconditioner(model, lr=LR)
    phases: dict[str, float] = {}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
        synchronize(x.device)
        for phase, seconds in pre.timings().items():
            phases[phase] = phases.get(phase, 0.0) + seconds / steps
    factors = [f for pair in pre.factors().values() for f in pair]
    pre.remove()
    blend = 0.95**steps

    eye = [torch.eye(f.shape[0], device=f.device, dtype=f.dtype) for f in factors]
    blended = [blend * i + (1 - blend) * f for i, f in zip(eye, factors, strict=True)]
    return {
        "steps": steps,
        "phase_means_s": phases,
        "factors": len(factors),
        "eigh_s_dkfac_factors": eigh_seconds(factors),
        "eigh_s_identity_started_factors": eigh_seconds(blended),
        "identity_weight": blend,
    }


def install_kfac_pytorch(source: str) -> str:
    """pip-install kfac-pytorch from ``source`` into a temporary folder on ``sys.path``."""
    target = tempfile.mkdtemp(prefix="kfac_pytorch_")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target]
    done = subprocess.run([*command, source], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"pip install {source} failed: {done.stderr.strip()[-300:]}"
    sys.path.insert(0, target)
    return ""


def kfac_pytorch_version() -> str | None:
    """The importable kfac-pytorch's version, or None."""
    try:
        from importlib.metadata import version

        importlib.import_module("kfac.preconditioner")
        return version("kfac_pytorch")
    except Exception:  # not installed, or installed without metadata
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """The software and the device the numbers were measured on."""
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "source_sha256": source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def add_model_arguments(parser: argparse.ArgumentParser, batch: int) -> None:
    """``--model``, ``--device``, ``--batch``, ``--image-size`` (0: the model's), ``--out``."""
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--image-size", type=int, default=0, help="default: the model's")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder made), if there is one.

    Through a temporary file renamed over ``path``: a run killed while writing (a device
    box's time limit) leaves the previous report whole.
    """
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(partial, path)


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration: median amortised time and median overhead over the round's SGD."""
    summary: dict[str, dict[str, Any]] = {}
    for key in rounds[0]:
        times = [r[key]["amortized_s"] for r in rounds]
        overheads = [100.0 * (r[key]["amortized_s"] / r["sgd"]["amortized_s"] - 1) for r in rounds]
        summary[key] = {
            "median_s": statistics.median(times),
            "overhead_pct": statistics.median(overheads),
            "rounds": len(rounds),
        }
    return summary


def verdicts(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 17's targets on this summary (``met`` None where a side was not measured)."""
    result: dict[str, Any] = {}
    labels = sorted({key.split("_")[0] for key in summary if key.startswith("dkfac")})
    for label in labels:
        suffix = "" if label == "dkfac" else "_" + label.removeprefix("dkfac-")
        for method in METHODS["dkfac"]:
            periodic = summary.get(f"{label}_{method}_10_100")
            if periodic is not None:
                result[f"amortised_{method}{suffix}"] = {
                    "overhead_pct": periodic["overhead_pct"],
                    "target_pct": TARGET_AMORTISED_PCT,
                    "met": periodic["overhead_pct"] <= TARGET_AMORTISED_PCT,
                }
            ours = summary.get(f"{label}_{method}_1_1")
            theirs = summary.get(f"kfac-pytorch_{SAME_PRECONDITIONER[method]}_1_1")
            if ours is not None:
                limit = (
                    None
                    if theirs is None
                    else TARGET_FRACTION_OF_KFAC_PYTORCH * theirs["overhead_pct"]
                )
                result[f"every_step_{method}{suffix}"] = {
                    "overhead_pct": ours["overhead_pct"],
                    "kfac_pytorch_pct": None if theirs is None else theirs["overhead_pct"],
                    "met": None if limit is None else ours["overhead_pct"] <= limit,
                }
    return result


def format_table(model: str, summary: dict[str, dict[str, Any]]) -> str:
    """One model's rows: configuration, median ms per iteration, overhead over SGD."""
    lines = [f"{model}", f"  {'configuration':<32} {'ms/iter':>10} {'vs SGD':>9}"]
    for key, row in summary.items():
        extra = "" if key == "sgd" else f"{row['overhead_pct']:+8.1f}%"
        lines.append(f"  {key:<32} {1000 * row['median_s']:10.1f} {extra:>9}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--models", default="resnet32,resnet50", help="comma-separated")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--every-step-iters", type=int, default=5, help="(1,1) timed iterations")
    parser.add_argument(
        "--every-step-warmup", type=int, default=2, help="(1,1) warm-up iterations (default 2)"
    )
    parser.add_argument(
        "--eigh-probe", type=int, default=0, metavar="STEPS", help="also run eigh_probe"
    )
    parser.add_argument("--configs", default="", help="only these configuration keys (and sgd)")
    parser.add_argument("--sgd-iters", type=int, default=50, help="SGD timed iterations")
    parser.add_argument("--image-size", type=int, default=0, help="override (0: the model's)")
    parser.add_argument("--install-kfac-pytorch", default="", metavar="SOURCE")
    parser.add_argument(
        "--host-waits", default="resnet32", help="models whose host waits are counted (CUDA)"
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 matmuls (torch.backends.cuda.matmul.allow_tf32), as many GPU users do",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="a dkfac variant: LABEL 'dkfac-<name>', JSON its KFACPreconditioner keywords "
        "(e.g. dkfac-half='{\"statistics_fraction\": 0.5}'); repeatable",
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="every configuration (SGD too) with the network and inputs in channels-last format",
    )
    parser.add_argument("--out", default="runs/gpu_overhead", help="folder of the JSON")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny windows")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Measure every model and configuration; the JSON-ready result (``save``d per model)."""
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    install_note = (
        install_kfac_pytorch(args.install_kfac_pytorch) if args.install_kfac_pytorch else ""
    )
    theirs = kfac_pytorch_version()
    libraries = ["dkfac"] + (["kfac-pytorch"] if theirs else [])
    result: dict[str, Any] = {
        "environment": environment(device),
        "kfac_pytorch": theirs or f"not measured: not importable {install_note}".strip(),
        "batch_size": args.batch_size,
        "channels_last": args.channels_last,
        "variants": {**BUILTIN_VARIANTS, **dict(args.variant)},
        "models": {},
    }
    for name in args.models.split(","):
        spec = MODELS[name]
        size = args.image_size or spec.image_size
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 3, size, size, generator=generator).to(device)
        if args.channels_last:
            x = x.contiguous(memory_format=CHANNELS_LAST)
        y = torch.randint(0, spec.num_classes, (args.batch_size,), generator=generator).to(device)
        configs = configurations(libraries, dict(args.variant))
        if args.configs:
            wanted = {"sgd", *args.configs.split(",")}
            configs = [c for c in configs if c.key in wanted]
        rounds = []
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs) :] + configs[: round_index % len(configs)]
            windows = {}
            for config in order:
                if args.quick:
                    warmup, iters = (1, 2) if not config.periodic else (1, 10)
                elif config.library is None:
                    warmup, iters = 10, args.sgd_iters
                elif config.periodic:
                    warmup, iters = config.factor_update_steps, config.inv_update_steps
                else:
                    warmup, iters = args.every_step_warmup, args.every_step_iters
                windows[config.key] = time_window(
                    spec, config, (x, y), device, warmup, iters, args.channels_last
                )
                print(f"  {name} {config.key}: {1000 * windows[config.key]['amortized_s']:.1f} ms")
            rounds.append({c.key: windows[c.key] for c in configs})
        summary = summarize(rounds)
        entry: dict[str, Any] = {
            "image_size": size,
            "rounds": rounds,
            "summary": summary,
            "verdicts": verdicts(summary),
        }
        result["models"][name] = entry
        print(format_table(name, summary))
        save(result)
        if args.eigh_probe:
            entry["eigh_probe"] = eigh_probe(spec, (x, y), args.eigh_probe)
            print(f"  {name} eigh probe: {entry['eigh_probe']}")
            save(result)
        if device.type == "cuda" and name in args.host_waits.split(","):
            entry["host_waits"] = host_waits(spec, (x, y), args.channels_last)
            print(f"  {name} host waits per step: {entry['host_waits']}")
            save(result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write ``--out/gpu_overhead.json``."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_overhead.json"

    def save(result: dict[str, Any]) -> None:  # after each model: a cut-off run keeps it
        path.write_text(json.dumps(result, indent=1))

    result = run(args, save)
    print(json.dumps({m: e["verdicts"] for m, e in result["models"].items()}, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
