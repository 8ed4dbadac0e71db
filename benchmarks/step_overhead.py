"""Per-iteration cost of ``dkfac.KFACPreconditioner`` compared with plain SGD.

The benchmark trains a ResNet-20 (32x32 inputs) on one fixed synthetic batch in a single
process and measures how much a K-FAC step adds to an SGD iteration:

* configurations: plain SGD, and SGD + K-FAC with ``(factor_update_steps, inv_update_steps)``
  in ``{(1, 1), (10, 100)}`` x ``inverse_method`` in ``{"eigen", "inverse"}``;
* every configuration gets a freshly built model (same seed) and its own warm-up, then a
  timed window; for the periodic (10, 100) configurations the window should cover whole
  inverse periods (the default of 100 iterations holds exactly one decomposition and ten
  factor updates), so the amortized cost contains the rare expensive steps in the right
  proportion;
* ``--compile`` adds each configuration again with the model under ``torch.compile`` (the
  default Inductor backend; TorchDynamo's caches reset for each, so every compiled model gets
  its own graphs, compiled in its warm-up, which covers its first two factor windows: the
  second traces a convolution's Gram again with the index plan made after the first); a
  compiled K-FAC configuration's overhead is taken against compiled SGD, and its TorchDynamo
  graph breaks and frames that fell back to eager are recorded (none expected);
* the configurations run interleaved in rounds (the order rotates from round to round), so a
  slow phase of the machine hits all of them; the overhead of a K-FAC configuration is
  computed within a round against that round's SGD and then reduced by the median over rounds.

Usage::

    .venv/bin/python benchmarks/step_overhead.py            # full run (a few minutes)
    .venv/bin/python benchmarks/step_overhead.py --quick    # smoke test
    .venv/bin/python benchmarks/step_overhead.py --compile  # eager and compiled side by side

The printed table and a JSON file with every raw per-iteration time are the output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters

import dkfac
from dkfac.bench.configs import git_commit
from dkfac.models import resnet20

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
LR = 0.1
MOMENTUM = 0.9
#: Default output, under the working folder (outside the source tree).
DEFAULT_JSON = Path("runs") / "step_overhead.json"

REFERENCE_LINE = (
    "kfac-pytorch 0.4.2 measured on this machine class (single process, 1 thread, ResNet-20, "
    "batch 32): SGD 0.189 s/iter, overhead at (10,100): +50% eigen, +47% inverse; target: "
    "dkfac at most half of that (+25% eigen, +23.5% inverse)"
)
REFERENCE: dict[str, Any] = {
    "library": "kfac-pytorch 0.4.2",
    "setting": "single process, 1 thread, ResNet-20, batch 32",
    "sgd_s_per_iter": 0.189,
    "overhead_pct_at_10_100": {"eigen": 50.0, "inverse": 47.0},
}
TARGET_OVERHEAD_PCT: dict[str, float] = {"eigen": 25.0, "inverse": 23.5}


@dataclass(frozen=True)
class Configuration:
    """One measured setup: plain SGD or SGD with a K-FAC preconditioner."""

    key: str
    label: str
    inverse_method: str | None = None
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    compiled: bool = False

    @property
    def baseline(self) -> str:
        """Key of the SGD configuration its overhead is taken against (compiled or not)."""
        return SGD_COMPILED.key if self.compiled else SGD.key

    def compiled_twin(self) -> Configuration:
        """The same configuration with the model under ``torch.compile``."""
        return Configuration(
            f"{self.key}_compiled",
            f"{self.label} compiled",
            self.inverse_method,
            self.factor_update_steps,
            self.inv_update_steps,
            compiled=True,
        )

    @property
    def kfac(self) -> bool:
        """Whether this configuration uses ``dkfac.KFACPreconditioner``."""
        return self.inverse_method is not None

    @property
    def periodic(self) -> bool:
        """Whether the expensive K-FAC work happens only on some iterations."""
        return self.kfac and self.inv_update_steps > 1


SGD = Configuration("sgd", "SGD")
SGD_COMPILED = Configuration("sgd_compiled", "SGD compiled", compiled=True)
CONFIGURATIONS: tuple[Configuration, ...] = (
    SGD,
    Configuration("kfac_eigen_1_1", "K-FAC eigen (1,1)", "eigen", 1, 1),
    Configuration("kfac_inverse_1_1", "K-FAC inverse (1,1)", "inverse", 1, 1),
    Configuration("kfac_eigen_10_100", "K-FAC eigen (10,100)", "eigen", 10, 100),
    Configuration("kfac_inverse_10_100", "K-FAC inverse (10,100)", "inverse", 10, 100),
)


@dataclass
class Window:
    """Raw timings of one timed window of one configuration (all in seconds)."""

    iters: int
    warmup: int
    wall_s: float
    iter_s: list[float]
    fwd_bwd_s: list[float]
    pre_step_s: list[float]
    opt_step_s: list[float]
    factor_updates: int | None
    inverse_updates: int | None
    whole_periods: bool
    final_loss: float
    dynamo_trouble: dict[str, Any] | None = None

    @property
    def amortized_s(self) -> float:
        """Wall-clock time of the window divided by its number of iterations."""
        return self.wall_s / self.iters

    @property
    def median_s(self) -> float:
        """Median of the per-iteration times of the window."""
        return statistics.median(self.iter_s)

    def to_json(self) -> dict[str, Any]:
        """Return the raw numbers and the per-window reductions as a JSON-ready dict."""
        return {
            "iters": self.iters,
            "warmup": self.warmup,
            "wall_s": self.wall_s,
            "amortized_s": self.amortized_s,
            "median_s": self.median_s,
            "mean_fwd_bwd_s": statistics.fmean(self.fwd_bwd_s),
            "mean_pre_step_s": statistics.fmean(self.pre_step_s),
            "mean_opt_step_s": statistics.fmean(self.opt_step_s),
            "factor_updates_in_window": self.factor_updates,
            "inverse_updates_in_window": self.inverse_updates,
            "whole_periods": self.whole_periods,
            "final_loss": self.final_loss,
            "dynamo_trouble": self.dynamo_trouble,
            "iter_s": self.iter_s,
            "fwd_bwd_s": self.fwd_bwd_s,
            "pre_step_s": self.pre_step_s,
            "opt_step_s": self.opt_step_s,
        }


def make_batch(batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Return one random input batch and random labels, drawn from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *IMAGE_SHAPE, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return x, y


def count_schedule_hits(period: int, start: int, iters: int) -> int:
    """Number of K-FAC steps ``k`` in ``[start, start + iters)`` with ``k % period == 0``."""
    return sum(1 for k in range(start, start + iters) if k % period == 0)


def time_configuration(
    config: Configuration, x: Tensor, y: Tensor, *, warmup: int, iters: int, seed: int
) -> Window:
    """Build a fresh model for ``config``, warm it up, then time ``iters`` iterations.

    The garbage collector is paused during the timed window (for every configuration alike),
    so a collection triggered by one configuration's allocations does not land in its timings.
    """
    torch.manual_seed(seed)
    model = resnet20(num_classes=NUM_CLASSES)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if config.compiled:
        torch._dynamo.reset()  # its own graphs (and recompile budget) for this fresh model
        counters.clear()
        model = torch.compile(model)  # type: ignore[assignment]
    pre: dkfac.KFACPreconditioner | None = None
    if config.inverse_method is not None:
        pre = dkfac.KFACPreconditioner(
            model,
            inverse_method=config.inverse_method,
            lr=LR,
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
        )
    iter_s: list[float] = []
    fwd_bwd_s: list[float] = []
    pre_step_s: list[float] = []
    opt_step_s: list[float] = []
    clock = time.perf_counter
    try:
        loss = torch.zeros(())
        for _ in range(warmup):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if pre is not None:
                pre.step()
            optimizer.step()
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            window_start = clock()
            for _ in range(iters):
                t0 = clock()
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                t1 = clock()
                if pre is not None:
                    pre.step()
                t2 = clock()
                optimizer.step()
                t3 = clock()
                iter_s.append(t3 - t0)
                fwd_bwd_s.append(t1 - t0)
                pre_step_s.append(t2 - t1)
                opt_step_s.append(t3 - t2)
            wall_s = clock() - window_start
        finally:
            if gc_was_enabled:
                gc.enable()
        final_loss = float(loss.detach())
        if pre is not None and pre.steps != warmup + iters:
            raise RuntimeError(f"{config.label}: pre.steps={pre.steps}, expected {warmup + iters}")
    finally:
        if pre is not None:
            pre.remove()
    factor_updates = inverse_updates = None
    whole_periods = True
    if config.kfac:
        factor_updates = count_schedule_hits(config.factor_update_steps, warmup, iters)
        inverse_updates = count_schedule_hits(config.inv_update_steps, warmup, iters)
        whole_periods = iters % config.inv_update_steps == 0
    trouble = None
    if config.compiled:
        trouble = {
            "graph_breaks": sum(counters["graph_break"].values()),
            "unimplemented": sum(counters["unimplemented"].values()),
            "frames_not_ok": counters["frames"]["total"] - counters["frames"]["ok"],
            "unique_graphs": counters["stats"]["unique_graphs"],
        }
    return Window(
        iters=iters,
        warmup=warmup,
        wall_s=wall_s,
        iter_s=iter_s,
        fwd_bwd_s=fwd_bwd_s,
        pre_step_s=pre_step_s,
        opt_step_s=opt_step_s,
        factor_updates=factor_updates,
        inverse_updates=inverse_updates,
        whole_periods=whole_periods,
        final_loss=final_loss,
        dynamo_trouble=trouble,
    )


def environment(threads: int) -> dict[str, Any]:
    """Describe the software and machine the numbers were measured on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "torch_version": torch.__version__,
        "dkfac_version": dkfac.__version__,
        "git_commit": git_commit(),
        "torch_num_threads": torch.get_num_threads(),
        "requested_threads": threads,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(affinity(0)) if affinity is not None else None,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "mkl_available": torch.backends.mkl.is_available(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def summarize(
    configs: Sequence[Configuration], rounds: Sequence[dict[str, Window]]
) -> dict[str, dict[str, Any]]:
    """Reduce the rounds: medians over rounds of each window's amortized and median times.

    The overhead of a K-FAC configuration is computed inside each round against that round's
    SGD window (amortized times), then reduced by the median over rounds.
    """
    summary: dict[str, dict[str, Any]] = {}
    for config in configs:
        windows = [r[config.key] for r in rounds]
        entry: dict[str, Any] = {
            "label": config.label,
            "inverse_method": config.inverse_method,
            "factor_update_steps": config.factor_update_steps if config.kfac else None,
            "inv_update_steps": config.inv_update_steps if config.kfac else None,
            "iters": windows[0].iters,
            "whole_periods": all(w.whole_periods for w in windows),
            "amortized_s": statistics.median(w.amortized_s for w in windows),
            "median_s": statistics.median(w.median_s for w in windows),
            "fwd_bwd_s": statistics.median(statistics.fmean(w.fwd_bwd_s) for w in windows),
            "pre_step_s": statistics.median(statistics.fmean(w.pre_step_s) for w in windows),
            "opt_step_s": statistics.median(statistics.fmean(w.opt_step_s) for w in windows),
            "overhead_pct": None,
            "overhead_pct_per_round": None,
            "dynamo_trouble": [w.dynamo_trouble for w in windows] if config.compiled else None,
        }
        if config.kfac and all(config.baseline in r for r in rounds):
            per_round = [
                100.0 * (r[config.key].amortized_s / r[config.baseline].amortized_s - 1.0)
                for r in rounds
            ]
            entry["overhead_pct_per_round"] = per_round
            entry["overhead_pct"] = statistics.median(per_round)
        summary[config.key] = entry
    return summary


def evaluate_targets(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Compare the (10,100) overheads with the targets (half of kfac-pytorch 0.4.2's)."""
    verdicts: dict[str, dict[str, Any]] = {}
    for method, target in TARGET_OVERHEAD_PCT.items():
        entry = summary.get(f"kfac_{method}_10_100")
        measured = None if entry is None else entry["overhead_pct"]
        valid = entry is not None and measured is not None and bool(entry["whole_periods"])
        verdicts[method] = {
            "target_overhead_pct": target,
            "reference_overhead_pct": REFERENCE["overhead_pct_at_10_100"][method],
            "measured_overhead_pct": measured,
            "window_covers_whole_periods": valid,
            "met": None if measured is None else bool(measured <= target),
        }
    return verdicts


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:8.1f}"


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Render the summary as a fixed-width table (times per iteration)."""
    header = (
        f"{'configuration':<24}{'iters':>6}{'amortized s/iter':>18}{'median s/iter':>15}"
        f"{'overhead [min, max]':>27}{'fwd+bwd ms':>12}{'pre.step ms':>13}"
        f"{'opt.step ms':>13}"
    )
    lines = [header, "-" * len(header)]
    for entry in summary.values():
        overhead = "-"
        if entry["overhead_pct"] is not None:
            per_round = entry["overhead_pct_per_round"]
            overhead = f"{entry['overhead_pct']:+.1f}%"
            if len(per_round) > 1:
                overhead += f" [{min(per_round):+.1f}, {max(per_round):+.1f}]"
        pre_step = _ms(entry["pre_step_s"]) if entry["inverse_method"] is not None else "-"
        lines.append(
            f"{entry['label']:<24}{entry['iters']:>6}{entry['amortized_s']:>18.4f}"
            f"{entry['median_s']:>15.4f}{overhead:>27}{_ms(entry['fwd_bwd_s']):>12}"
            f"{pre_step:>13}{_ms(entry['opt_step_s']):>13}"
        )
    lines.append(
        "amortized = window wall time / iterations (median over rounds); median = median "
        "per-iteration time (median over rounds);"
    )
    lines.append(
        "overhead = amortized K-FAC / amortized SGD of the same round - 1 (median over "
        "rounds; a compiled configuration against compiled SGD); split columns = mean ms per "
        "iteration."
    )
    return "\n".join(lines)


def format_targets(
    verdicts: dict[str, dict[str, Any]], summary: dict[str, dict[str, Any]], *, like_for_like: bool
) -> str:
    """Render the reference line and whether each (10,100) target is met."""
    lines = [REFERENCE_LINE]
    sgd = summary.get(SGD.key)
    if sgd is not None:
        lines.append(
            f"measured here: SGD {sgd['amortized_s']:.3f} s/iter (reference "
            f"{REFERENCE['sgd_s_per_iter']:.3f})"
        )
    if not like_for_like:
        lines.append("note: threads or batch size differ from the reference setting")
    for method, verdict in verdicts.items():
        measured = verdict["measured_overhead_pct"]
        target = verdict["target_overhead_pct"]
        if measured is None:
            lines.append(f"target {method} (10,100) <= +{target}%: not measured")
            continue
        status = "MET" if verdict["met"] else "NOT MET"
        if not verdict["window_covers_whole_periods"]:
            status += " (not meaningful: the window does not cover whole inverse periods)"
        lines.append(
            f"target {method} (10,100) <= +{target}%: measured {measured:+.1f}% -> {status}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line and fill in the defaults (which depend on ``--quick``)."""
    parser = argparse.ArgumentParser(
        description="Time SGD vs SGD + dkfac.KFACPreconditioner on ResNet-20 (CPU)."
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed iterations per configuration and round (default 3, quick 1)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed iterations of the (10,100) configurations; a multiple of 100 covers whole "
        "inverse periods (default 100, quick 20)",
    )
    parser.add_argument(
        "--iters-short",
        type=int,
        default=None,
        help="timed iterations of SGD and the (1,1) configurations (default 20, quick 4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round, few iterations")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also every configuration with the model under torch.compile (Inductor)",
    )
    args = parser.parse_args(argv)
    defaults = (
        {"rounds": 1, "warmup": 1, "iters": 20, "iters_short": 4}
        if args.quick
        else {"rounds": 3, "warmup": 3, "iters": 100, "iters_short": 20}
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, minimum in (
        ("threads", 1),
        ("batch_size", 1),
        ("rounds", 1),
        ("warmup", 0),
        ("iters", 1),
        ("iters_short", 1),
    ):
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run all rounds and return the JSON-ready report."""
    x, y = make_batch(args.batch_size, args.seed)
    configs = list(CONFIGURATIONS)
    if args.compile:
        configs += [config.compiled_twin() for config in CONFIGURATIONS]
    rounds: list[dict[str, Window]] = []
    orders: list[list[str]] = []
    for index in range(args.rounds):
        shift = index % len(configs)
        order = configs[shift:] + configs[:shift]
        orders.append([c.key for c in order])
        windows: dict[str, Window] = {}
        for config in order:
            iters = args.iters if config.periodic else args.iters_short
            # A compiled model traces its graphs in its first two factor windows (the second
            # once more for the convolutions' index plans): warm up through both.
            warmup = (
                max(args.warmup, config.factor_update_steps + 1) if config.compiled else args.warmup
            )
            window = time_configuration(config, x, y, warmup=warmup, iters=iters, seed=args.seed)
            windows[config.key] = window
            print(
                f"round {index + 1}/{args.rounds} {config.label:<24} amortized "
                f"{window.amortized_s:.4f} s/iter, median {window.median_s:.4f} s/iter",
                file=sys.stderr,
                flush=True,
            )
            if not math.isfinite(window.final_loss):
                print(f"warning: {config.label}: non-finite loss", file=sys.stderr)
        rounds.append({c.key: windows[c.key] for c in configs})
    summary = summarize(configs, rounds)
    verdicts = evaluate_targets(summary)
    raw_rounds = []
    by_key = {config.key: config for config in configs}
    for index, windows in enumerate(rounds):
        raw_rounds.append(
            {
                "round": index,
                "order": orders[index],
                "overhead_pct": {
                    key: 100.0 * (w.amortized_s / windows[by_key[key].baseline].amortized_s - 1.0)
                    for key, w in windows.items()
                    if by_key[key].kfac
                },
                "windows": {key: w.to_json() for key, w in windows.items()},
            }
        )
    return {
        "benchmark": "step_overhead",
        "environment": environment(args.threads),
        "settings": {
            "model": "resnet20",
            "num_classes": NUM_CLASSES,
            "input_shape": list(IMAGE_SHAPE),
            "batch_size": args.batch_size,
            "threads": args.threads,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "warmup_compiled": "max(warmup, factor_update_steps + 1)",
            "iters_periodic": args.iters,
            "iters_short": args.iters_short,
            "seed": args.seed,
            "lr": LR,
            "momentum": MOMENTUM,
            "quick": args.quick,
            "compile": args.compile,
            "gc_disabled_in_window": True,
            "fwd_bwd_includes_zero_grad": True,
        },
        "configurations": [
            {
                "key": c.key,
                "label": c.label,
                "inverse_method": c.inverse_method,
                "factor_update_steps": c.factor_update_steps if c.kfac else None,
                "inv_update_steps": c.inv_update_steps if c.kfac else None,
                "compiled": c.compiled,
            }
            for c in configs
        ],
        "rounds": raw_rounds,
        "summary": summary,
        "reference": {**REFERENCE, "line": REFERENCE_LINE},
        "targets": verdicts,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table and write the JSON report; return the exit code."""
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            report = run(args)
    finally:
        torch.set_num_threads(previous_threads)
    env = report["environment"]
    print(
        f"torch {env['torch_version']}, dkfac {env['dkfac_version']}, threads "
        f"{env['torch_num_threads']}, cpus {env['cpu_count']}, python {env['python_version']}, "
        f"{env['platform']}, {env['date_utc']}"
    )
    print(
        f"ResNet-20, batch {args.batch_size}, SGD(lr={LR}, momentum={MOMENTUM}), rounds "
        f"{args.rounds}, warm-up {args.warmup}, timed iterations {args.iters_short} "
        f"(SGD, (1,1)) / {args.iters} ((10,100))"
    )
    print()
    print(format_table(report["summary"]))
    for entry in report["summary"].values():
        if entry["dynamo_trouble"] is not None:
            print(f"{entry['label']}: TorchDynamo per round: {entry['dynamo_trouble']}")
    print()
    like_for_like = args.threads == 1 and args.batch_size == 32
    print(format_targets(report["targets"], report["summary"], like_for_like=like_for_like))
    path: Path = args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
