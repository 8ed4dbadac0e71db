"""What ``dkfac bench`` measures: models, strategies, schedules and the configurations.

Models: the CIFAR ResNets ``resnet20`` and ``resnet32`` (3x32x32 images) and ``mlp6``, a
6-layer MLP with 1024-wide layers on 1024-feature vectors (large factors, small compute: the
communication-bound case). Strategies: ``dkfac``, ``kaisa``, ``spd`` (SPD-KFAC), ``pad``
(PAD-KFAC) and ``dp`` (DP-KFAC), always next to the DDP + SGD reference.

Shared by the launcher (:mod:`dkfac.bench.command`), the workers (:mod:`dkfac.bench.worker`) and
the table and chart (:mod:`dkfac.bench.report`).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dkfac
from dkfac.models import MLP, resnet20, resnet32
from dkfac.strategies.registry import strategy_names

NUM_CLASSES = 10
LR = 0.1
MOMENTUM = 0.9
INVERSE_METHOD = "eigen"

#: Width of the input and of every hidden layer of ``mlp6``.
MLP6_WIDTH = 1024
#: Hidden layers of ``mlp6`` (six ``nn.Linear`` in all, counting the classifier).
MLP6_HIDDEN_LAYERS = 5


def mlp6(num_classes: int = NUM_CLASSES) -> nn.Module:
    """A 6-layer MLP with wide layers: 1024 -> 1024 (x5) -> ``num_classes``, ReLU between.

    Large K-FAC factors (1025x1025 and 1024x1024 per layer) for little forward and backward
    compute: the communication-bound case of the benchmark.

    Args:
        num_classes: Number of output classes.

    Returns:
        The model, whose inputs are vectors of :data:`MLP6_WIDTH` features.

    """
    return MLP(MLP6_WIDTH, [MLP6_WIDTH] * MLP6_HIDDEN_LAYERS, num_classes=num_classes)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet20": resnet20,
    "resnet32": resnet32,
    "mlp6": mlp6,
}
MODEL_LABELS = {"resnet20": "ResNet-20", "resnet32": "ResNet-32", "mlp6": "MLP-6 (1024 wide)"}
#: Shape of one synthetic input of each model, without the batch dimension.
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "resnet20": (3, 32, 32),
    "resnet32": (3, 32, 32),
    "mlp6": (MLP6_WIDTH,),
}
#: K-FAC strategies that can be measured (SGD is always measured as the reference).
STRATEGIES: tuple[str, ...] = strategy_names(distributed=True)
#: Default ``(factor_update_steps, inv_update_steps)`` schedules.
SCHEDULES: tuple[tuple[int, int], ...] = ((1, 1), (10, 100))

#: Phases of ``pre.timings()``, in the order of a K-FAC step.
PHASES: tuple[str, ...] = (
    "factor_comm",
    "inverse_comm",
    "grad_comm",
    "factor_compute",
    "inverse_compute",
    "precondition",
)


@dataclass(frozen=True)
class Configuration:
    """One measured setup: DDP + SGD alone, or with a K-FAC preconditioner."""

    key: str
    label: str
    strategy: str | None = None
    grad_worker_fraction: float = 1.0
    fraction_label: str = "1"
    factor_update_steps: int = 1
    inv_update_steps: int = 1

    @property
    def kfac(self) -> bool:
        """Whether this configuration builds a ``dkfac.KFACPreconditioner``."""
        return self.strategy is not None

    @property
    def periodic(self) -> bool:
        """Whether the expensive K-FAC work happens only on some iterations."""
        return self.kfac and (self.factor_update_steps > 1 or self.inv_update_steps > 1)

    @property
    def schedule(self) -> str:
        """``"(f,i)"`` of a K-FAC configuration, ``"-"`` for SGD."""
        if not self.kfac:
            return "-"
        return f"({self.factor_update_steps},{self.inv_update_steps})"

    def to_json(self) -> dict[str, Any]:
        """The configuration as a JSON-ready dict."""
        return {
            "key": self.key,
            "label": self.label,
            "strategy": self.strategy,
            "grad_worker_fraction": self.grad_worker_fraction if self.kfac else None,
            "grad_worker_fraction_label": self.fraction_label if self.kfac else None,
            "factor_update_steps": self.factor_update_steps if self.kfac else None,
            "inv_update_steps": self.inv_update_steps if self.kfac else None,
            "inverse_method": INVERSE_METHOD if self.kfac else None,
        }


SGD = Configuration("sgd", "SGD (DDP)")


def kaisa_fractions(world_size: int) -> list[int]:
    """Denominators ``d`` of the KAISA fractions ``1/d`` measured with ``world_size`` workers.

    Always ``1/P`` (MEM-OPT); also ``1/2`` when ``P > 2`` is even (a hybrid grid).
    """
    denominators = [world_size]
    if world_size > 2 and world_size % 2 == 0:
        denominators.append(2)
    return denominators


def configurations(
    world_size: int,
    strategies: Sequence[str] = STRATEGIES,
    schedules: Sequence[tuple[int, int]] = SCHEDULES,
) -> list[Configuration]:
    """SGD, then the chosen strategies at every schedule.

    Per schedule, in the order of :data:`STRATEGIES`: ``dkfac``, the KAISA fractions of
    :func:`kaisa_fractions`, ``spd``, ``pad`` and ``dp``. ``dkfac``, ``spd``, ``pad`` and ``dp``
    get one configuration each (key ``"{strategy}_{f}_{i}"``, label the strategy's name).

    Args:
        world_size: Number of workers ``P`` (it picks the KAISA fractions).
        strategies: Strategies to measure; others in :data:`STRATEGIES` are left out.
        schedules: ``(factor_update_steps, inv_update_steps)`` pairs.

    Returns:
        The configurations, SGD first.

    """
    configs = [SGD]
    for f, i in schedules:
        for strategy in STRATEGIES:
            if strategy not in strategies:
                continue
            if strategy == "kaisa":
                for d in kaisa_fractions(world_size):
                    configs.append(
                        Configuration(
                            f"kaisa_1of{d}_{f}_{i}",
                            f"kaisa f=1/{d}",
                            "kaisa",
                            1.0 / d,
                            f"1/{d}",
                            f,
                            i,
                        )
                    )
            else:
                configs.append(
                    Configuration(f"{strategy}_{f}_{i}", strategy, strategy, 1.0, "1", f, i)
                )
    return configs


def comma_separated(value: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated command-line value."""
    return [part.strip() for part in value.split(",") if part.strip()]


def count_schedule_hits(period: int, start: int, iters: int) -> int:
    """Number of K-FAC steps ``k`` in ``[start, start + iters)`` with ``k % period == 0``."""
    return sum(1 for k in range(start, start + iters) if k % period == 0)


def git_commit(source: Path | None = None) -> str | None:
    """The commit checked out where dkfac's source lives (``git rev-parse HEAD``).

    Args:
        source: a directory of the code; default: the imported ``dkfac`` package.

    Returns:
        The commit hash, or ``None`` when ``source`` holds no file tracked by a git checkout
        (an installed package, even one inside another repository's tree) or git is missing.
    """
    directory = source or Path(dkfac.__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=directory, capture_output=True, text=True, timeout=30, check=False
        )

    try:
        if git("ls-files", "--error-unmatch", ".").returncode != 0:
            return None
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() if head.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Describe the software and machine the numbers were measured on, and the code's commit."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "torch_version": torch.__version__,
        "dkfac_version": dkfac.__version__,
        "git_commit": git_commit(),
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(affinity(0)) if affinity is not None else None,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
