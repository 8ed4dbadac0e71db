"""Train a workload until it reaches its target or its time budget: one run of time-to-target.

The clock counts training only (forward, backward, K-FAC, the optimizer and, on several
workers, their communication), not building the model and the preconditioner (SPD/PAD's
calibration, ``AutoOptions``' choice) and not measuring; it stops while the metric is
measured on the test split, every ``eval_every`` steps or about every ``budget / 200``
seconds when steps are slow (:func:`window_steps`). A run ends at the first measurement that
meets the target, when the training seconds pass the budget, or when the loss or the metric
stops being finite (counted as a divergence). Every method starts from the same initial
weights for a seed and sees the same batches in the same order: the seed fixes both.

On ``P`` workers (``spawn_workers``, gloo) each takes its ``1/P`` of every global batch, DDP
averages the gradients, and K-FAC runs the named strategy; the measurement, the training
seconds and whether the loss stayed finite are rank 0's, broadcast, so every rank stops
together.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dkfac
from dkfac.adaptive import LossFunction
from dkfac.bench.target_report import lost_progress
from dkfac.bench.workloads import Workload, load_workload
from dkfac.cli.local_workers import spawn_workers
from dkfac.recipes import RECIPES

__all__ = [
    "KFAC_RECORD_KEYS",
    "Method",
    "Trace",
    "kfac_method",
    "run_method",
    "train_to_target",
    "window_steps",
]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
#: SGD's momentum in every run (with and without K-FAC).
MOMENTUM = 0.9


@dataclass(frozen=True)
class Method:
    """An optimizer and its learning rate, with or without K-FAC.

    Attributes:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"`` (PyTorch's defaults).
        lr: the learning rate.
        kfac: precondition with :class:`dkfac.KFACPreconditioner`.
        kfac_options: its keyword arguments (empty: the recipe's, or the library's
            defaults); ``lr`` is always the optimizer's current rate.
        name: what tables call it (default: built from the fields).
        recipe: the name of a :mod:`dkfac.recipes` function whose keyword arguments
            ``kfac_options`` change (empty: none).
    """

    optimizer: str
    lr: float
    kfac: bool = False
    kfac_options: tuple[tuple[str, Any], ...] = ()
    name: str = ""
    recipe: str = ""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: expected one of {OPTIMIZERS}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r}: expected a finite number > 0")
        if self.recipe and self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r}: expected one of {sorted(RECIPES)}")
        if self.recipe and not self.kfac:
            raise ValueError(f"recipe={self.recipe!r} needs kfac=True: it configures K-FAC")

    @property
    def label(self) -> str:
        """``name``, or e.g. ``"sgd lr=0.1"`` / ``"sgd+kfac lr=0.1"``."""
        if self.name:
            return self.name
        return f"{self.optimizer}{'+kfac' if self.kfac else ''} lr={self.lr:g}"


#: The keys of one ``--kfac`` configuration of ``benchmarks/time_to_target.py``.
KFAC_RECORD_KEYS = ("optimizer", "lr", "options", "name", "recipe")


def kfac_method(record: Any) -> Method:
    """A K-FAC :class:`Method` from one ``--kfac`` configuration (parsed JSON).

    Raises:
        ValueError: not a table, a key it does not know (it would be ignored: a run of
            something else than asked), ``optimizer`` or ``lr`` missing, or ``options`` not
            a table.
    """
    if not isinstance(record, dict):
        raise ValueError(f"--kfac {record!r}: expected a table of {', '.join(KFAC_RECORD_KEYS)}")
    unknown = sorted(set(record) - set(KFAC_RECORD_KEYS))
    if unknown:
        raise ValueError(
            f"--kfac: {', '.join(map(repr, unknown))} is not allowed: expected only "
            f'{", ".join(KFAC_RECORD_KEYS)} (KFACPreconditioner\'s keywords, "adaptive" '
            'included, go in "options")'
        )
    missing = [key for key in ("optimizer", "lr") if key not in record]
    if missing:
        raise ValueError(f"--kfac {record!r}: {' and '.join(missing)} missing")
    options = record.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f'--kfac: "options" {options!r} is not allowed: expected a table')
    optimizer, lr = record["optimizer"], float(record["lr"])
    return Method(
        optimizer,
        lr,
        kfac=True,
        kfac_options=tuple(sorted(options.items())),
        name=record.get("name", f"dkfac ({optimizer} lr={lr:g})"),
        recipe=record.get("recipe", ""),
    )


@dataclass
class Trace:
    """What one run did: its measurements against training seconds and steps.

    Attributes:
        points: ``(training seconds, steps, metric)`` at every measurement (the first at 0).
        reached_s: training seconds at the first measurement meeting the target (``None``:
            not reached).
        reached_step: the steps at that measurement.
        diverged: the loss or the metric stopped being finite.
        collapsed: a measurement lost more than half of the way to the target the run had
            made (:func:`~dkfac.bench.target_report.lost_progress`; the run goes on), and
            it did not diverge.
        train_s: training seconds in all.
    """

    points: list[tuple[float, int, float]] = field(default_factory=list)
    reached_s: float | None = None
    reached_step: int | None = None
    diverged: bool = False
    collapsed: bool = False
    train_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "points": [list(p) for p in self.points],
            "reached_s": self.reached_s,
            "reached_step": self.reached_step,
            "diverged": self.diverged,
            "collapsed": self.collapsed,
            "train_s": self.train_s,
        }


def kfac_keywords(method: Method, loss_fn: LossFunction) -> dict[str, Any]:
    """The preconditioner's keyword arguments of a K-FAC method (without ``lr``/``strategy``).

    Its recipe's, then its ``kfac_options``: an ``"adaptive"`` entry there is ``True`` (the
    defaults, or the recipe's options), ``AdaptiveOptions``' keywords (JSON, even none: over
    the recipe's options, if it has any), or ``False``/``None`` (no adaptive K-FAC).

    Args:
        method: the method.
        loss_fn: the workload's training loss.
    """
    keywords = RECIPES[method.recipe](loss_fn) if method.recipe else {}
    given = dict(method.kfac_options)
    switched = "adaptive" in given
    adaptive = given.pop("adaptive", None)
    keywords.update(given)
    if adaptive is True or isinstance(adaptive, dict):
        changes = adaptive if isinstance(adaptive, dict) else {}
        base = keywords.get("adaptive")
        keywords["adaptive"] = (
            replace(base, **changes)
            if isinstance(base, dkfac.AdaptiveOptions)
            else dkfac.AdaptiveOptions(loss_fn=loss_fn, **changes)
        )
    elif adaptive is False or (switched and adaptive is None):
        keywords.pop("adaptive", None)
    elif switched:
        raise ValueError(
            f'"adaptive": {adaptive!r} is not allowed: expected true, false, null or a table of '
            "AdaptiveOptions' keywords"
        )
    return keywords


def resolved_keywords(method: Method) -> dict[str, Any]:
    """:func:`kfac_keywords` as a record: the adaptive options as their fields but the loss.

    The benchmark's record keeps it beside the configuration as given: ``"adaptive": true``
    or a recipe mean whatever the defaults were at the run's commit. ``strategy`` is not in
    it: each run takes the benchmark's ``--strategy`` on several workers, ``"local"`` on one.
    """
    keywords = kfac_keywords(method, lambda outputs, targets: outputs)
    options = keywords.get("adaptive")
    if options is not None:
        keywords["adaptive"] = {
            f.name: getattr(options, f.name) for f in fields(options) if f.name != "loss_fn"
        }
    return keywords


def _optimizer(method: Method, model: nn.Module) -> torch.optim.Optimizer:
    if method.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=method.lr, momentum=MOMENTUM)
    return torch.optim.AdamW(model.parameters(), lr=method.lr)


def _agreed(
    workload: Workload, model: nn.Module, world: int, train_s: float, loss_finite: bool
) -> tuple[float, float, bool]:
    """Rank 0's metric on the test split, training seconds and loss finiteness, on every rank.

    Every rank decides to stop (target, budget, divergence) and how long the next window is
    from these same numbers; with each rank's own clock and batch loss they could disagree,
    and a rank that stops leaves the others waiting in DDP's allreduce.
    """
    was_training = model.training
    model.eval()
    with torch.no_grad():
        value = workload.measure(model, workload.test)
    model.train(was_training)
    agreed = torch.tensor([value, train_s, float(loss_finite)], dtype=torch.float64)
    if world > 1:
        dist.broadcast(agreed, 0)
    return float(agreed[0]), float(agreed[1]), bool(agreed[2])


def window_steps(workload: Workload, budget_s: float, train_s: float, steps: int) -> int:
    """Steps until the next measurement: ``eval_every``, fewer when steps are slow.

    A run reaches its target at a measurement, so a window of slow steps would add up to its
    length to the time reported; windows are kept near ``budget_s / 200`` seconds (at least
    one step) from the mean step time so far. The first window is one step.
    """
    if steps == 0:
        return 1
    per_step = train_s / steps
    return max(1, min(workload.eval_every, int(budget_s / 200 / per_step) if per_step else 1))


def train_to_target(
    workload: Workload,
    method: Method,
    seed: int,
    budget_s: float | None = None,
    *,
    strategy: str = "dkfac",
) -> Trace:
    """One run on this process (its rank of the process group, if there is one).

    Args:
        workload: the task.
        method: the optimizer, its rate, K-FAC or not.
        seed: the initial weights' and the batch order's seed.
        budget_s: training seconds after which the run stops unreached (``None``: the
            workload's).
        strategy: K-FAC's strategy on several workers (one worker: ``"local"``).
    """
    budget = workload.budget_s if budget_s is None else budget_s
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    _check_split(workload, world)
    torch.manual_seed(seed)
    model = workload.build()
    trained: nn.Module = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = _optimizer(method, model)
    pre = None
    if method.kfac:
        options = kfac_keywords(method, workload.loss_fn)
        options.setdefault("strategy", strategy if world > 1 else "local")
        pre = dkfac.KFACPreconditioner(
            trained, lr=lambda _: float(optimizer.param_groups[0]["lr"]), **options
        )
    inputs, targets = workload.train
    order = torch.Generator().manual_seed(seed)
    share = workload.batch_size // world
    trace = Trace(points=[(0.0, 0, _agreed(workload, model, world, 0.0, True)[0])])
    steps, permutation, position = 0, torch.randperm(len(inputs), generator=order), 0
    while trace.train_s < budget:
        tick = time.perf_counter()
        finite = True
        for _ in range(window_steps(workload, budget, trace.train_s, steps)):
            if position + workload.batch_size > len(permutation):
                permutation, position = torch.randperm(len(inputs), generator=order), 0
            batch = permutation[position : position + workload.batch_size]
            mine = batch[rank * share : (rank + 1) * share]
            position += workload.batch_size
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(trained(inputs[mine]), targets[mine])
            loss.backward()  # type: ignore[no-untyped-call]
            if pre is not None and pre.config.adaptive is not None:
                pre.step(inputs[mine], targets[mine])
            elif pre is not None:
                pre.step()
            optimizer.step()
            steps += 1
            finite = finite and math.isfinite(float(loss.detach()))
        elapsed = trace.train_s + time.perf_counter() - tick
        value, trace.train_s, finite = _agreed(workload, model, world, elapsed, finite)
        trace.points.append((trace.train_s, steps, value))
        if not (math.isfinite(value) and finite):
            trace.diverged = True
            break
        if workload.reached(value):
            trace.reached_s, trace.reached_step = trace.train_s, steps
            break
    # A run that diverged counts once, as diverged.
    trace.collapsed = not trace.diverged and lost_progress(trace.points, workload.target)
    if pre is not None:
        pre.remove()
    return trace


def _check_split(workload: Workload, world: int) -> None:
    """Refuse a global batch that ``world`` workers cannot share equally."""
    if workload.batch_size % world:
        raise ValueError(f"batch {workload.batch_size} does not split over {world} workers")


def _worker(
    workload_name: str,
    method: Method,
    seed: int,
    budget_s: float | None,
    strategy: str,
    batch_size: int | None,
) -> Any:
    # One process in a process group of one runs strategy="local" on purpose.
    warnings.filterwarnings("ignore", "strategy='local' in a process group")
    workload = load_workload(workload_name, batch_size)
    trace = train_to_target(workload, method, seed, budget_s, strategy=strategy)
    return trace.as_dict()


def run_method(
    workload_name: str,
    method: Method,
    seed: int,
    budget_s: float | None = None,
    *,
    world_size: int = 1,
    strategy: str = "dkfac",
    batch_size: int | None = None,
) -> dict[str, Any]:
    """One run on ``world_size`` fresh processes, one intra-op thread each; rank 0's trace.

    ``batch_size`` replaces the workload's global batch (``None``: its own).
    """
    workload = load_workload(workload_name, batch_size)  # a bad batch fails here, not in workers
    _check_split(workload, world_size)
    args = (workload_name, method, seed, budget_s, strategy, batch_size)
    limit = workload.budget_s if budget_s is None else budget_s
    results = spawn_workers(_worker, world_size, 1, args, timeout=limit * 4 + 300)
    return dict(results[0])
