"""Host time per kind of K-FAC step: what a GPU waits for when a model's kernels are small.

On a GPU, a small model's step (ResNet-32 at batch 128 takes ~9 ms on an H100) is bound by
the host: Python and the dispatch of each operator, not the kernels. dkfac's share of such a
step is its host time. This measures it on the CPU by running a model's own structure
(every layer, hook and operator call) with its channels divided by ``--thin`` (default: its
narrowest width, so that equal widths stay equal) and tiny inputs, so that the arithmetic
left is negligible: what a step takes is then host time. Per kind of step
of a ``(10, 100)`` schedule: the forward-backward pass (capturing statistics or not),
``pre.step()`` and the optimizer's step, medians over the run; and the amortised host time
per iteration against SGD's, side by side in one process, their iterations interleaved
(:func:`time_round`). Variants (``--variant LABEL=JSON``) are more ``KFACPreconditioner``
keywords; ``--gpu-paths`` turns on what dkfac's defaults turn on for a GPU only (the batched
preconditioning, folds and input statistics, the patch Grams by im2col), so the host work of
the GPU's code paths is what is timed (a few device-dependent details, e.g. the finiteness
checks, stay the CPU's).

``--graphs-without-replay`` lets variants with ``plain_step_graphs`` take the graph path on
the CPU (:class:`ReplayLaunchingNothing`): their plain steps' host time is then a replayed
step's (the key, the copies in and out) but the replay's one launch.

Usage::

    python benchmarks/host_time.py --models resnet32,resnet50 --gpu-paths --rounds 5 \
        --out benchmarks/results/host_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dkfac
import dkfac.preconditioner
from gpu_overhead import MODELS, add_variant_argument, environment, write_report

#: The schedule timed: factors every 10 steps, decompositions every 100.
FACTOR_STEPS, DECOMPOSITION_STEPS = 10, 100
#: Keywords that select the code paths dkfac's defaults take on a GPU. The patch Grams: a
#: GPU's rule takes im2col for every stride-1 convolution whose output is no larger than its
#: input, which in these ResNets is every one (``"im2col"``; until 2026-11-30 the runs took
#: the CPU's shifted products, and ResNet-32's factor steps 1.3 ms more host time for it).
GPU_PATHS = (
    ("batched_preconditioning", True),
    ("batched_factor_updates", True),
    ("batched_statistics", True),
    ("conv_patches", "im2col"),
)
KINDS = ("plain", "factors", "decomposition")


class ReplayLaunchingNothing:
    """``plain_step_graphs``' capture on the CPU, with a replay that does nothing.

    The host's part of a replayed plain step is everything but the graph's one launch, so a
    variant with ``plain_step_graphs`` timed with this in place of ``CudaGraphs`` shows what a
    GPU's host would spend on it. The directions it writes are the captured step's, again on
    every replay: the run's numbers are for timing only.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capture(
        self, compute: Callable[[], list[torch.Tensor]], device: torch.device
    ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Run ``compute`` once; its outputs, and a replay that launches nothing."""
        return compute(), _launch_nothing

    def release(self) -> None:
        """Nothing is held (no graph is made)."""


def _launch_nothing() -> None:
    """A replay with no work (:class:`ReplayLaunchingNothing`)."""


def thinned(module: nn.Module, divisor: int) -> nn.Module:
    """``module`` with every convolution, batch norm and linear layer ``divisor`` times narrower.

    The image's 3 input channels stay; a layer keeps at least one channel and a linear layer
    at least two outputs (the classifier's classes). Layers are replaced in place, so the
    structure (the layer count, their kinds, kernels, strides and padding) is the model's own.

    Raises:
        ValueError: a grouped convolution (its groups would not divide the new widths).
    """
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Conv2d):
            if child.groups != 1:
                raise ValueError(f"thinned: {name!r} is a grouped convolution")
            inputs = child.in_channels if child.in_channels == 3 else child.in_channels // divisor
            replacement: nn.Module = nn.Conv2d(
                max(inputs, 1),
                max(child.out_channels // divisor, 1),
                child.kernel_size,
                child.stride,
                child.padding,
                child.dilation,
                bias=child.bias is not None,
                padding_mode=child.padding_mode,
            )
        elif isinstance(child, nn.BatchNorm2d):
            replacement = nn.BatchNorm2d(max(child.num_features // divisor, 1))
        elif isinstance(child, nn.Linear):
            replacement = nn.Linear(
                max(child.in_features // divisor, 1),
                max(child.out_features // divisor, 2),
                bias=child.bias is not None,
            )
        else:
            thinned(child, divisor)
            continue
        setattr(module, name, replacement)
    return module


def narrowest(module: nn.Module) -> int:
    """The fewest output channels of ``module``'s convolutions (the default divisor).

    Dividing every width by it keeps equal widths equal (they are its multiples in ResNets),
    so layers of one shape are stacked and batched as in the full-width model.
    """
    return min(m.out_channels for m in module.modules() if isinstance(m, nn.Conv2d))


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in milliseconds."""
    return statistics.median(seconds) * 1e3


def kind_of(step: int) -> str:
    """Which kind of step ``step`` of the schedule is."""
    if step % DECOMPOSITION_STEPS == 0:
        return "decomposition"
    return "factors" if step % FACTOR_STEPS == 0 else "plain"


class TimedRun:
    """One configuration's model, optimizer and preconditioner (SGD's: ``options`` None)."""

    def __init__(
        self,
        model_name: str,
        thin: int,
        batch: int,
        image_size: int,
        options: dict[str, Any] | None,
    ) -> None:
        spec = MODELS[model_name]
        torch.manual_seed(0)
        classes = max(spec.num_classes // thin, 2)  # the classifier's, as thinned() makes it
        self.model = thinned(spec.build(spec.num_classes), thin)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, 3, image_size, image_size, generator=generator)
        self.y = torch.randint(0, classes, (batch,), generator=generator)
        self.pre = None
        if options is not None:
            self.pre = dkfac.KFACPreconditioner(
                self.model,
                inverse_method="inverse",
                factor_update_steps=FACTOR_STEPS,
                inv_update_steps=DECOMPOSITION_STEPS,
                **options,
            )
        self.samples: dict[str, dict[str, list[float]]] = {}

    def iteration(self, step: int, recorded: bool) -> None:
        """Step ``step`` of the schedule: its parts timed, kept when ``recorded``."""
        kind = "plain" if self.pre is None else kind_of(step)
        parts = {"forward_backward": _timed(self._forward_backward)}
        if self.pre is not None:
            parts["kfac_step"] = _timed(self.pre.step)
        # Untimed: every optimizer step starts from gradients just written, as dkfac's step()
        # leaves them. Backward wrote SGD's earlier, and on the CPU its optimizer step read
        # them 0.02-0.19 ms slower from memory, which a GPU's host does not (it reads none).
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(1.0)  # exact: the values stay, their cache lines are warm
        parts["optimizer"] = _timed(self.optimizer.step)
        if recorded:
            for part, seconds in parts.items():
                self.samples.setdefault(kind, {}).setdefault(part, []).append(seconds)

    def medians(self) -> dict[str, dict[str, float]]:
        """Each kind's and part's median, in milliseconds (the hooks removed)."""
        if self.pre is not None:
            self.pre.remove()
        return {
            kind: {part: median_ms(values) for part, values in parts.items()}
            for kind, parts in self.samples.items()
        }

    def _forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(self.x), self.y).backward()


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_round(
    common: tuple[Any, ...], runs: dict[str, dict[str, Any] | None], steps: int
) -> dict[str, Any]:
    """One round: every run's medians, their iterations interleaved in one process.

    Each run has a model of its own; step ``s`` of every run is taken before step ``s + 1``
    of any, in an order rotated from one step of a kind to the next of that kind (rotated by
    the step number alone, every factor step of SGD and one variant would come in one order).
    Runs made one after another, even in rotated order, differed by their process's state:
    SGD's passes and dkfac's plain passes (the same operators; plain steps carry no layer
    hook) read up to 1.3 ms apart, more than the differences timed, and in one process,
    interleaved, within 0.2 ms (2026-11-29, docs/benchmarks.md).
    """
    timed = {label: TimedRun(*common, options) for label, options in runs.items()}
    labels = list(timed)
    turns = dict.fromkeys(KINDS, 0)  # steps of each kind taken so far
    # The first window (its first estimates and index plans) is warm-up, not timed.
    for step in range(DECOMPOSITION_STEPS + steps):
        kind = kind_of(step)
        shift = turns[kind] % len(labels)
        turns[kind] += 1
        for label in labels[shift:] + labels[:shift]:
            timed[label].iteration(step, recorded=step >= DECOMPOSITION_STEPS)
    return {label: run.medians() for label, run in timed.items()}


def timed_rounds(
    common: tuple[Any, ...], variants: dict[str, dict[str, Any]], rounds: int, steps: int
) -> list[dict[str, Any]]:
    """``rounds`` rounds of SGD and every variant (:func:`time_round`), each with new models."""
    runs: dict[str, dict[str, Any] | None] = {"sgd": None, **variants}
    return [time_round(common, runs, steps) for _ in range(rounds)]


def median_of_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each kind's and part's median over the rounds."""
    return {
        kind: {part: statistics.median(r[kind][part] for r in rounds) for part in parts}
        for kind, parts in rounds[0].items()
    }


def amortised_ms(kinds: dict[str, dict[str, float]]) -> float:
    """Host time per iteration of the schedule, from each kind's medians."""
    if set(kinds) == {"plain"}:
        return sum(kinds["plain"].values())
    share = {
        "decomposition": 1 / DECOMPOSITION_STEPS,
        "factors": 1 / FACTOR_STEPS - 1 / DECOMPOSITION_STEPS,
    }
    share["plain"] = 1 - share["factors"] - share["decomposition"]
    return sum(share[kind] * sum(parts.values()) for kind, parts in kinds.items())


def table(model: str, result: dict[str, Any]) -> str:
    """One row per run: medians per kind of step and the amortised host time."""
    sgd = amortised_ms(result["sgd"])
    lines = [
        f"{model} (channels / {result['thin']}, batch {result['batch']}, "
        f"{result['image_size']}x{result['image_size']}), host ms",
        "| run | plain: pass + step() | factor step: pass + step() | decomposition step() "
        "| amortised (vs SGD) |",
        "|---|---|---|---|---|",
        f"| SGD | {sgd:.2f} | | | {sgd:.2f} |",
    ]
    for label, kinds in result["variants"].items():
        plain, factors = (
            f"{kinds[kind]['forward_backward']:.2f} + {kinds[kind]['kfac_step']:.2f}"
            for kind in ("plain", "factors")
        )
        total = amortised_ms(kinds)
        lines.append(
            f"| {label} | {plain} | {factors} | "
            f"{kinds['decomposition']['kfac_step']:.1f} | {total:.2f} ({total / sgd - 1:+.1%}) |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet32,resnet50", help="comma-separated")
    parser.add_argument(
        "--thin", type=int, default=0, help="channel divisor (default: the narrowest width)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="timed steps after the warm-up")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds with new models; cells are their medians"
    )
    parser.add_argument(
        "--gpu-paths", action="store_true", help="every run takes dkfac's GPU code paths"
    )
    parser.add_argument(
        "--graphs-without-replay",
        action="store_true",
        help="plain_step_graphs variants take the graph path, replaying nothing (timing only)",
    )
    add_variant_argument(parser)
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.thin < 0 or args.batch < 1 or args.rounds < 1 or args.steps < DECOMPOSITION_STEPS:
        parser.error(
            f"--thin >= 0, --batch >= 1, --rounds >= 1 and --steps >= {DECOMPOSITION_STEPS} needed"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread: no intra-op pool's wake-ups in the host time
    variants: dict[str, dict[str, Any]] = dict(args.variant) or {"dkfac": {}}
    if args.gpu_paths:
        variants = {label: {**dict(GPU_PATHS), **options} for label, options in variants.items()}
    report: dict[str, Any] = {
        "environment": environment(torch.device("cpu")),
        "argv": sys.argv[1:] if argv is None else argv,
        "options": variants,
        "models": {},
    }
    with replaying_nothing(args.graphs_without_replay):
        for model_name in args.models.split(","):
            _time_model(model_name, args, variants, report)
    return 0


@contextlib.contextmanager
def replaying_nothing(enabled: bool) -> Iterator[None]:
    """While timing: ``plain_step_graphs``' capture is :class:`ReplayLaunchingNothing`."""
    saved = dkfac.preconditioner.CudaGraphs  # type: ignore[attr-defined]
    if enabled:
        dkfac.preconditioner.CudaGraphs = ReplayLaunchingNothing  # type: ignore[attr-defined,assignment]
    try:
        yield
    finally:
        dkfac.preconditioner.CudaGraphs = saved  # type: ignore[attr-defined]


def _time_model(
    model_name: str,
    args: argparse.Namespace,
    variants: dict[str, dict[str, Any]],
    report: dict[str, Any],
) -> None:
    """Time SGD and every variant on ``model_name``, print its table, write the report."""
    spec = MODELS[model_name]
    thin = args.thin or narrowest(spec.build(spec.num_classes))
    common = (model_name, thin, args.batch, args.image_size)
    rounds = timed_rounds(common, variants, args.rounds, args.steps)
    result = {
        "thin": thin,
        "batch": args.batch,
        "image_size": args.image_size,
        "sgd": median_of_rounds([timed["sgd"] for timed in rounds]),
        "variants": {
            label: median_of_rounds([timed[label] for timed in rounds]) for label in variants
        },
        "rounds": rounds,
    }
    result["amortised_ms"] = {"sgd": amortised_ms(result["sgd"])} | {
        label: amortised_ms(kinds) for label, kinds in result["variants"].items()
    }
    report["models"][model_name] = result
    print(table(model_name, result), flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    sys.exit(main())
