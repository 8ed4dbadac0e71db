"""What ``dkfac bench`` measures: models, strategies, schedules and the configurations.

Models (:mod:`dkfac.bench.models`): the CIFAR ResNets ``resnet20`` and ``resnet32``, ``mlp6``
(a 6-layer MLP with 1024-wide layers, the communication-bound case) and ``transformer`` (a
causal language model). Strategies: ``dkfac``, ``kaisa``, ``spd`` (SPD-KFAC), ``pad``
(PAD-KFAC) and ``dp`` (DP-KFAC), always next to the DDP + SGD reference; and, when named,
``dear``: SGD with DeAR's gradient averaging instead of DDP (:class:`dkfac.DeAR`, no K-FAC).

Shared by the launcher (:mod:`dkfac.bench.command`), the workers (:mod:`dkfac.bench.worker`) and
the table and chart (:mod:`dkfac.bench.report`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import dkfac
from dkfac.bench.models import INPUT_SHAPES as INPUT_SHAPES
from dkfac.bench.models import MLP6_HIDDEN_LAYERS as MLP6_HIDDEN_LAYERS
from dkfac.bench.models import MLP6_WIDTH as MLP6_WIDTH
from dkfac.bench.models import MODEL_LABELS as MODEL_LABELS
from dkfac.bench.models import MODELS as MODELS
from dkfac.bench.models import NUM_CLASSES as NUM_CLASSES
from dkfac.bench.models import TOKEN_VOCABULARIES as TOKEN_VOCABULARIES
from dkfac.bench.models import mlp6 as mlp6
from dkfac.cli.config import ConfigError
from dkfac.dear.bucket_search import DEFAULT_AUTO_RANGE_MB
from dkfac.strategies.registry import strategy_names

LR = 0.1
MOMENTUM = 0.9
INVERSE_METHOD = "eigen"

#: K-FAC strategies that can be measured (SGD is always measured as the reference).
STRATEGIES: tuple[str, ...] = strategy_names(distributed=True)
#: ``--strategies`` name of SGD with DeAR's gradient averaging instead of DDP (no K-FAC).
DEAR = "dear"
#: ``--strategies`` name of ``strategy=dkfac.AutoOptions(...)``: the one the simulator ranks
#: fastest at construction (profiled on the benchmark's batch; the choice is reported).
AUTO = "auto"
#: ``--strategies`` names of K-FAC strategies whose gradients DeAR averages instead of DDP
#: (``"dkfac+dear"``...): it gathers them before preconditioning (``gather_gradients``).
KFAC_WITH_DEAR: tuple[str, ...] = tuple(f"{strategy}+{DEAR}" for strategy in STRATEGIES)
#: ``--strategies`` name of ``strategy=auto`` choosing for DeAR's gradient averaging (it
#: simulates every candidate with DeAR's traffic: ``AutoOptions(dear_bucket_cap_mb=...)``).
AUTO_WITH_DEAR = f"{AUTO}+{DEAR}"
#: Everything ``--strategies`` accepts, in the order the configurations are measured.
STRATEGY_CHOICES: tuple[str, ...] = (DEAR, *STRATEGIES, *KFAC_WITH_DEAR, AUTO, AUTO_WITH_DEAR)
#: DeAR's bucket size: searched online (``"auto"``) over these MiB, this many timed steps per
#: size, inside the warm-up; the window times the size it kept.
DEAR_BUCKET_CAP_MB = "auto"
DEAR_AUTO_RANGE_MB = DEFAULT_AUTO_RANGE_MB
DEAR_AUTO_TRIAL_STEPS = 5
#: DeAR's exposed waits (``dear.timings()``); their sum is its ``grad_comm`` in the tables.
DEAR_WAITS: tuple[str, ...] = ("grad_reduce_scatter", "grad_all_gather")
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
    """One measured setup: DDP + SGD alone or with a K-FAC preconditioner, or DeAR + SGD.

    Attributes:
        key: Unique name in reports (``sgd``, ``dear``, ``dkfac_1_1``, ...).
        label: Name in tables and charts.
        strategy: The K-FAC strategy; ``None`` without K-FAC.
        grad_worker_fraction: KAISA's fraction (K-FAC only).
        fraction_label: The fraction as text, e.g. ``1/2``.
        factor_update_steps: K-FAC's factor update period.
        inv_update_steps: K-FAC's decomposition update period.
        gradient_sync: ``"ddp"`` (DistributedDataParallel) or ``"dear"`` (:class:`dkfac.DeAR`,
            which also takes the optimizer step).
    """

    key: str
    label: str
    strategy: str | None = None
    grad_worker_fraction: float = 1.0
    fraction_label: str = "1"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    gradient_sync: str = "ddp"

    @property
    def kfac(self) -> bool:
        """Whether this configuration builds a ``dkfac.KFACPreconditioner``."""
        return self.strategy is not None

    @property
    def dear(self) -> bool:
        """Whether DeAR averages the gradients and steps the optimizer (instead of DDP)."""
        return self.gradient_sync == DEAR

    @property
    def reference(self) -> bool:
        """Whether this is DDP + SGD, which every other configuration is compared with."""
        return not self.kfac and not self.dear

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
            "gradient_sync": self.gradient_sync,
        }


SGD = Configuration("sgd", "SGD (DDP)")
DEAR_SGD = Configuration(DEAR, "SGD (DeAR)", gradient_sync=DEAR)


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
    """SGD, then DeAR + SGD if chosen, then the chosen K-FAC strategies at every schedule.

    Per schedule, in the order of :data:`STRATEGIES`: ``dkfac``, the KAISA fractions of
    :func:`kaisa_fractions`, ``spd``, ``pad`` and ``dp``, then ``auto`` (:data:`AUTO`) and
    ``auto+dear`` (:data:`AUTO_WITH_DEAR`, key ``"auto_dear_{f}_{i}"``).
    ``dkfac``, ``spd``, ``pad``, ``dp`` and ``auto`` get one configuration each (key
    ``"{strategy}_{f}_{i}"``, label the strategy's name).
    KAISA gets one per fraction ``1/d``, key ``"kaisa_1of{d}_{f}_{i}"`` (:func:`strategy_key`).
    ``dear`` has no schedule: one configuration, :data:`DEAR_SGD`; ``"{strategy}+dear"``
    (:data:`KFAC_WITH_DEAR`) is the strategy with DeAR averaging the gradients (KAISA at
    ``1/P``), key its DDP row's with ``_dear`` before the schedule, e.g. ``"dkfac_dear_1_1"``
    or ``"kaisa_1of4_dear_1_1"``.

    Args:
        world_size: Number of workers ``P`` (it picks the KAISA fractions).
        strategies: Strategies to measure, from :data:`STRATEGY_CHOICES`; the others are left
            out.
        schedules: ``(factor_update_steps, inv_update_steps)`` pairs.

    Returns:
        The configurations, SGD first.

    """
    configs = [SGD]
    if DEAR in strategies:
        configs.append(DEAR_SGD)
    for f, i in schedules:
        for strategy in STRATEGIES:
            if strategy not in strategies:
                continue
            denominators = kaisa_fractions(world_size) if strategy == "kaisa" else [1]
            for d in denominators:
                configs.append(_kfac_configuration(strategy, d, f, i))
        for strategy in STRATEGIES:  # KAISA at its memory-optimal 1/P only
            if f"{strategy}+{DEAR}" in strategies:
                d = world_size if strategy == "kaisa" else 1
                configs.append(_kfac_configuration(strategy, d, f, i, DEAR))
        if AUTO in strategies:
            configs.append(Configuration(f"{AUTO}_{f}_{i}", AUTO, AUTO, 1.0, "1", f, i))
        if AUTO_WITH_DEAR in strategies:
            label, key = f"{AUTO} + DeAR", f"{AUTO}_{DEAR}_{f}_{i}"
            configs.append(Configuration(key, label, AUTO, 1.0, "1", f, i, DEAR))
    return configs


def strategy_key(strategy: str, denominator: int) -> str:
    """A strategy's name in row keys: ``kaisa_1of{d}`` for KAISA at fraction ``1/d``."""
    return f"kaisa_1of{denominator}" if strategy == "kaisa" else strategy


def _kfac_configuration(
    strategy: str, d: int, f: int, i: int, gradient_sync: str = "ddp"
) -> Configuration:
    """``strategy`` at ``(f, i)`` (KAISA at ``1/d``), keyed as :func:`configurations` says."""
    label = f"kaisa f=1/{d}" if strategy == "kaisa" else strategy
    name = strategy_key(strategy, d) + ("" if gradient_sync == "ddp" else f"_{gradient_sync}")
    return Configuration(
        f"{name}_{f}_{i}",
        label if gradient_sync == "ddp" else f"{label} + DeAR",
        strategy,
        1.0 / d,
        f"1/{d}" if strategy == "kaisa" else "1",
        f,
        i,
        gradient_sync=gradient_sync,
    )


def kfac_configuration(key: str, world_size: int) -> Configuration:
    """The K-FAC configuration that :func:`configurations` keys ``key`` at ``world_size``.

    Args:
        key: A row key, e.g. ``"dkfac_1_1"``, ``"kaisa_1of2_10_100"`` or ``"dkfac_dear_1_1"``.
        world_size: Number of workers ``P`` (it picks the KAISA fractions).

    Returns:
        The configuration, of any strategy of :data:`STRATEGY_CHOICES` with K-FAC.

    Raises:
        ValueError: ``key`` does not end in a schedule ``_<f>_<i>`` the bench can run
            (:func:`schedule_problem`), or no K-FAC configuration at ``world_size`` has it (the
            message lists those that do at its schedule).
    """
    parts = key.rsplit("_", 2)
    if len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        raise ValueError("expected <strategy>_<f>_<i>, e.g. dkfac_1_1")
    schedule = (int(parts[1]), int(parts[2]))
    problem = schedule_problem(*schedule)
    if problem is not None:
        raise ValueError(f"schedule ({schedule[0]},{schedule[1]}) {problem}")
    kfac = [c for c in configurations(world_size, STRATEGY_CHOICES, (schedule,)) if c.kfac]
    for config in kfac:
        if config.key == key:
            return config
    raise ValueError(
        f"no K-FAC configuration at P={world_size} has this key; choose from "
        f"{', '.join(c.key for c in kfac)}"
    )


def uses_dear(strategies: Sequence[str]) -> bool:
    """Whether any of ``strategies`` (``--strategies`` names) averages gradients with DeAR."""
    return any(s in (DEAR, AUTO_WITH_DEAR) or s in KFAC_WITH_DEAR for s in strategies)


def dear_settings(strategies: Sequence[str]) -> dict[str, Any] | None:
    """The DeAR options of every row that runs DeAR, for a report; ``None`` if none does.

    ``dear`` and each ``STRATEGY+dear`` alike search DeAR's bucket size with these options.
    """
    if not uses_dear(strategies):
        return None
    return {
        "bucket_cap_mb": DEAR_BUCKET_CAP_MB,
        "auto_range_mb": list(DEAR_AUTO_RANGE_MB),
        "auto_trial_steps": DEAR_AUTO_TRIAL_STEPS,
    }


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


def source_digest(source: Path | None = None) -> str:
    """SHA-256 of dkfac's Python sources (paths and contents), whatever git says.

    Names the code a measurement ran even where the commit cannot: a working tree with
    changes, or a copy whose ``.git`` is stale (the device tool's).

    Args:
        source: the package directory; default: the imported ``dkfac`` package.
    """
    directory = source or Path(dkfac.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment() -> dict[str, Any]:
    """Describe the software and machine the numbers were measured on, and the code's commit."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "torch_version": torch.__version__,
        "dkfac_version": dkfac.__version__,
        "git_commit": git_commit(),
        "source_sha256": source_digest(),
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(affinity(0)) if affinity is not None else None,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def schedule_problem(factor_steps: int, inverse_steps: int) -> str | None:
    """Why ``(factor_steps, inverse_steps)`` is no schedule, or ``None`` when it is one."""
    if factor_steps < 1 or inverse_steps < 1 or inverse_steps % factor_steps:
        return "needs steps >= 1 and inverse steps a multiple of the factor steps"
    return None


def parse_schedules(value: str) -> tuple[tuple[int, int], ...]:
    """``"f:i,f:i"`` as distinct ``(factor_steps, inverse_steps)`` pairs, checked.

    Raises:
        ConfigError: an item is not two integers >= 1 with ``i`` a multiple of ``f``, or
            there is none.
    """
    schedules: list[tuple[int, int]] = []
    for item in comma_separated(value):
        try:
            f, i = (int(part) for part in item.split(":"))
        except ValueError:
            raise ConfigError(
                f"--schedules: {item!r} is not factor_steps:inverse_steps (e.g. 10:100)"
            ) from None
        problem = schedule_problem(f, i)
        if problem is not None:
            raise ConfigError(f"--schedules: {item!r} {problem}")
        if (f, i) not in schedules:
            schedules.append((f, i))
    if not schedules:
        raise ConfigError("--schedules needs at least one factor_steps:inverse_steps pair")
    return tuple(schedules)
