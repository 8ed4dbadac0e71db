"""The operations the host issues per kind of K-FAC step: what a GPU's launch cost multiplies.

On a GPU each operator call below autograd is a kernel launch (or a few, for a ``_foreach``
call) that the host prepares in some microseconds; when they are many and small the device
waits for the host. This counts them, on any device, for one model at a time and per kind
of step of a ``(10, 100)`` schedule: a plain step (K-FAC preconditions), a factor step (the
hooks capture statistics, ``step()`` folds them) and a decomposition step, each split into
the forward-backward pass and ``pre.step()``; SGD's forward-backward alongside.

Categories: ``ops`` (operator calls that can launch work: everything but views) and
``views`` (metadata only: no launch). Host reads (synchronisations) are not operator calls
everywhere (``tolist`` reads memory directly): ``dkfac.bench.cuda_syncs`` counts them on a
GPU. A few paths differ by device (finiteness checks share one launch on a GPU, a CPU
checks each tensor's extremes; optimizers use ``_foreach`` kernels on a GPU only), so counts
taken on a CPU are the CPU's. Variants (``--variant LABEL=JSON``) are more
``KFACPreconditioner`` keywords, side by side in one run.

Usage::

    python benchmarks/step_launches.py --device cpu --image-size 64 --batch 8
        --variant 'one-at-a-time={"batched_preconditioning": false}'
        --variant 'batched={"batched_preconditioning": true}'    # one command line
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac
from gpu_overhead import (
    MODELS,
    add_model_arguments,
    add_variant_argument,
    environment,
    fresh_model,
    write_report,
)

#: Operators that only make a new view of existing memory: no kernel launch.
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "select",
        "slice",
        "unsqueeze",
        "squeeze",
        "expand",
        "as_strided",
        "detach",
        "alias",
        "unbind",
        "split",
        "split_with_sizes",
        "diagonal",
        "narrow",
        "lift_fresh",
    }
)


class OperatorCount(TorchDispatchMode):
    """Counts the operator calls that reach the backends, by category and by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        """``ops``, ``views`` and the most called operators."""
        views = sum(n for name, n in self.names.items() if name in VIEW_OPS)
        total = sum(self.names.values())
        return {
            "ops": total - views,
            "views": views,
            "top": dict(
                (name, n) for name, n in self.names.most_common(12) if name not in VIEW_OPS
            ),
        }


def counted(fn: Callable[[], Any]) -> dict[str, Any]:
    """The operator calls ``fn`` makes."""
    with OperatorCount() as count:
        fn()
    return count.summary()


def count_steps(
    model_name: str,
    device: torch.device,
    image_size: int,
    batch_size: int,
    method: str,
    options: dict[str, Any] | None,
) -> dict[str, Any]:
    """Counts of SGD's pass (``options`` None) or one dkfac run's step kinds."""
    spec = MODELS[model_name]
    model, optimizer = fresh_model(spec, device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=generator).to(device)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=generator).to(device)

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    if options is None:
        forward_backward()  # warm (lazy initialisation)
        return {"forward_backward": counted(forward_backward), "optimizer": counted(optimizer.step)}
    # Decompositions every 20 steps, not 100: what each kind of step issues is the same, and
    # the run reaches a second decomposition sooner.
    pre = dkfac.KFACPreconditioner(
        model, inverse_method=method, factor_update_steps=10, inv_update_steps=20, **options
    )
    # Step 10: a factor step that is not the first of its decomposition interval; step 20: a
    # decomposition step that is not the first (step 0 also makes the first estimates and
    # the statistics' index plans: work no later step repeats).
    kinds = {1: "plain", 10: "factors", 20: "decomposition"}
    result: dict[str, Any] = {}
    for step in range(21):
        if step in kinds:
            result[kinds[step]] = {
                "forward_backward": counted(forward_backward),
                "kfac_step": counted(pre.step),
            }
        else:
            forward_backward()
            pre.step()
        optimizer.step()
    pre.remove()
    return result


def table(results: dict[str, Any]) -> str:
    """One row per variant and step kind: the ops of the pass and of ``step()``."""
    lines = ["| run | step | forward+backward ops | step() ops |", "|---|---|---|---|"]
    sgd = results["sgd"]
    lines.append(
        f"| SGD | any | {sgd['forward_backward']['ops']} | optimizer.step(): "
        f"{sgd['optimizer']['ops']} |"
    )
    for label, kinds in results["variants"].items():
        for kind in ("plain", "factors", "decomposition"):
            counts = kinds[kind]
            lines.append(
                f"| {label} | {kind} | {counts['forward_backward']['ops']} | "
                f"{counts['kfac_step']['ops']} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, batch=4)
    parser.add_argument("--method", default="inverse", choices=("eigen", "inverse"))
    add_variant_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    image_size = args.image_size or MODELS[args.model].image_size
    variants: dict[str, dict[str, Any]] = dict(args.variant) or {"dkfac": {}}
    common = (args.model, device, image_size, args.batch, args.method)
    results: dict[str, Any] = {
        "environment": environment(device),
        "model": args.model,
        "image_size": image_size,
        "batch": args.batch,
        "method": args.method,
        "sgd": count_steps(*common, None),
        "variants": {label: count_steps(*common, options) for label, options in variants.items()},
        "options": variants,
    }
    print(table(results))
    write_report(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
