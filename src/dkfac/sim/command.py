"""``dkfac simulate``: predicted time per iteration of each strategy against the world size.

Options are validated in :class:`SimulateOptions`; :func:`run_simulation` returns the report
(JSON-ready), :func:`format_table` prints it and :func:`write_chart` plots time against P.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dkfac.sim.network import LinkModel
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.run import SGD, SimulatedCluster, SimulatedRun
from dkfac.sim.timeline import simulate
from dkfac.strategies.accounting import ACCOUNTED_STRATEGIES

#: Rows ``dkfac simulate`` predicts by default: the first-order baseline and every strategy.
DEFAULT_STRATEGIES: tuple[str, ...] = (SGD, *ACCOUNTED_STRATEGIES)


@dataclass(frozen=True)
class SimulateOptions:
    """What to simulate.

    Attributes:
        world_sizes: the ``P`` to predict, each at least 2.
        strategies: :data:`SGD` and K-FAC strategies.
        schedules: K-FAC ``(factor_update_steps, inv_update_steps)`` pairs.
        backend: ``"nccl"`` or ``"gloo"``.
        kaisa_fraction: KAISA's ``grad_worker_fraction``; ``None``: ``1/P`` at each P (KAISA's
            memory-optimal end, as the emulated-cluster benchmark runs it), at least ``1/P``.
        pad_share: PAD's ``share`` option.
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        bucket_cap_mb: the communicator's and the gradient buckets' cap (DDP's or DeAR's).
        gradient_sync: how every row averages its gradients: ``"ddp"`` or ``"dear"``.
    """

    world_sizes: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    schedules: tuple[tuple[int, int], ...] = ((1, 1), (10, 100))
    backend: str = "nccl"
    kaisa_fraction: float | None = None
    pad_share: str = "auto"
    inverse_method: str = "eigen"
    bucket_cap_mb: float = 25.0
    gradient_sync: str = "ddp"

    def __post_init__(self) -> None:
        SimulatedRun(SGD, gradient_sync=self.gradient_sync)  # validates
        if not self.world_sizes or min(self.world_sizes) < 2 or max(self.world_sizes) > 1024:
            raise ValueError(f"world sizes must lie in [2, 1024], got {list(self.world_sizes)}")
        unknown = sorted(set(self.strategies) - set(DEFAULT_STRATEGIES))
        if unknown or not self.strategies:
            raise ValueError(
                f"unknown strategies {unknown or '(none given)'}: expected some of "
                f"{', '.join(DEFAULT_STRATEGIES)}"
            )
        for f, i in self.schedules:
            SimulatedRun("dkfac", factor_update_steps=f, inv_update_steps=i)  # validates
        if self.kaisa_fraction is not None and not 0 < self.kaisa_fraction <= 1:
            raise ValueError(f"kaisa_fraction must lie in (0, 1], got {self.kaisa_fraction}")

    def runs(self, world_size: int) -> list[SimulatedRun]:
        """Every row at ``world_size``: SGD once, each K-FAC strategy at each schedule."""
        fraction = self.kaisa_fraction or 1.0 / world_size
        # A fraction the world cannot split into whole groups is rounded down to one that can;
        # the rows are labelled with the fraction used.
        groups = max(1, math.floor(world_size * fraction + 1e-9))
        while world_size % groups:
            groups -= 1
        fraction = groups / world_size
        runs = []
        sync, cap = self.gradient_sync, self.bucket_cap_mb
        for strategy in self.strategies:
            if strategy == SGD:
                runs.append(SimulatedRun(SGD, gradient_sync=sync, dear_bucket_cap_mb=cap))
                continue
            for f, i in self.schedules:
                runs.append(
                    SimulatedRun(
                        strategy,
                        grad_worker_fraction=fraction if strategy == "kaisa" else 1.0,
                        share=self.pad_share,
                        factor_update_steps=f,
                        inv_update_steps=i,
                        inverse_method=self.inverse_method,
                        gradient_sync=sync,
                        dear_bucket_cap_mb=cap,
                    )
                )
        return runs


def run_simulation(
    profile: ComputeProfile,
    link: LinkModel,
    options: SimulateOptions,
    *,
    model: str = "",
    network: str = "",
) -> dict[str, Any]:
    """Predict every row of ``options`` at every world size; the JSON-ready report."""
    rows = []
    for world_size in options.world_sizes:
        cap = options.bucket_cap_mb
        cluster = SimulatedCluster(world_size, link, options.backend, cap, cap)
        for run in options.runs(world_size):
            prediction = simulate(profile, cluster, run)
            rows.append(
                {
                    "world_size": world_size,
                    "label": run.label,
                    "run": asdict(run),
                    "iteration_s": prediction.iteration_s,
                    "steps": [asdict(step) for step in prediction.steps],
                }
            )
    return {
        "benchmark": "simulate",
        "model": model,
        "network": network,
        "link": asdict(link),
        "options": asdict(options),
        "profile": profile.to_dict(),
        "rows": rows,
    }


def format_table(report: Mapping[str, Any]) -> str:
    """Predicted ms per iteration: one row per configuration, one column per world size."""
    sizes = sorted({row["world_size"] for row in report["rows"]})
    labels = list(dict.fromkeys(_strip_fraction(row["label"]) for row in report["rows"]))
    cells = {
        (_strip_fraction(row["label"]), row["world_size"]): row["iteration_s"]
        for row in report["rows"]
    }
    sgd = {p: cells.get((SGD, p)) for p in sizes}
    header = f"{'configuration':24s}" + "".join(f"{f'P={p}':>16s}" for p in sizes)
    lines = [
        f"{report['model']} on {report['network']} ({report['options']['backend']}): predicted "
        "ms per iteration (x SGD's at the same P)",
        header,
        "-" * len(header),
    ]
    for label in labels:
        row = f"{label:24s}"
        for p in sizes:
            seconds, base = cells.get((label, p)), sgd.get(p)
            if seconds is None:
                row += f"{'-':>16s}"
            elif base and label != SGD:
                row += f"{f'{seconds * 1e3:.1f} ({seconds / base:.2f}x)':>16s}"
            else:
                row += f"{seconds * 1e3:>16.1f}"
        lines.append(row)
    return "\n".join(lines)


def _strip_fraction(label: str) -> str:
    """KAISA's row name without its fraction, which changes with P (``1/P`` by default)."""
    if label.startswith("kaisa f="):
        return "kaisa" + label[label.index(" (") :]
    return label


def write_chart(report: Mapping[str, Any], path: Path) -> Path | None:
    """Predicted seconds per iteration against P, one line per configuration (log-log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    by_label: dict[str, list[tuple[int, float]]] = {}
    for row in report["rows"]:
        by_label.setdefault(_strip_fraction(row["label"]), []).append(
            (row["world_size"], row["iteration_s"])
        )
    for label, points in by_label.items():
        xs, ys = zip(*sorted(points), strict=True)
        axes.plot(xs, ys, marker="o", label=label, linestyle="--" if label == SGD else "-")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("workers P")
    axes.set_ylabel("predicted seconds per iteration")
    axes.set_title(f"{report['model']} on {report['network']} ({report['options']['backend']})")
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _integers(parts: Sequence[str], text: str, expected: str) -> list[int]:
    """``parts`` as integers; a ValueError naming ``text`` and the ``expected`` form if not."""
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"{text!r}: expected {expected}") from None


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"2,4,8"``, or a range ``"2-64"``: the low end and its doublings up to the high end.

    Raises:
        ValueError: not integers, or a range whose ends are not ``1 <= LOW <= HIGH``.
    """
    if "-" not in text:
        return tuple(_integers([p for p in text.split(",") if p], text, "P,P,... or LOW-HIGH"))
    low, high = _integers(text.split("-", 1), text, "LOW-HIGH")
    if not 1 <= low <= high:
        raise ValueError(f"{text!r}: a range LOW-HIGH needs 1 <= LOW <= HIGH")
    sizes, p = [], low
    while p <= high:
        sizes.append(p)
        p *= 2
    return tuple(sizes)


def parse_schedules(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:1,10:100"`` as ``((1, 1), (10, 100))`` (``"5"``: ``(5, 5)``)."""
    pairs = []
    for part in text.split(","):
        f, _, i = part.partition(":")
        factor, inverse = _integers([f, i or f], part, "FACTOR:INVERSE steps, e.g. 10:100")
        pairs.append((factor, inverse))
    return tuple(pairs)


def strategies_of(text: str) -> tuple[str, ...]:
    """A comma-separated list, as :class:`SimulateOptions` takes it."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def profile_models() -> Sequence[str]:
    """Models ``--profile-here`` can build (the benchmark's)."""
    from dkfac.bench.models import MODELS

    return tuple(MODELS)
