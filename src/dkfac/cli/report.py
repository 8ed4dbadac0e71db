"""Tables and plots of finished runs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dkfac.cli.run_metrics import RunResult


def first_epoch_reaching(result: RunResult, target: float) -> int | None:
    """The first epoch whose test accuracy is at least ``target``."""
    for summary in result.epochs:
        if summary["test_accuracy"] >= target:
            return int(summary["epoch"])
    return None


def seconds_to_target(result: RunResult, target: float) -> float | None:
    """Training wall time until the first epoch reaching ``target``."""
    for summary in result.epochs:
        if summary["test_accuracy"] >= target:
            return float(summary["seconds"])
    return None


def epoch_table(result: RunResult) -> str:
    """One line per epoch: losses, accuracies, time."""
    lines = [
        f"{'epoch':>5} {'train loss':>10} {'train acc':>9} {'test loss':>9} "
        f"{'test acc':>8} {'seconds':>8}"
    ]
    for s in result.epochs:
        lines.append(
            f"{s['epoch']:>5} {s['train_loss']:>10.4f} {s['train_accuracy']:>9.4f} "
            f"{s['test_loss']:>9.4f} {s['test_accuracy']:>8.4f} {s['seconds']:>8.1f}"
        )
    return "\n".join(lines)


def compare_table(results: Mapping[str, RunResult], target: float) -> str:
    """Side by side: final accuracy, epochs and seconds to ``target``, total time."""
    width = max(len(label) for label in results)
    lines = [
        f"{'configuration':<{width}}  final acc  epoch to {target:.0%}  "
        f"seconds to {target:.0%}  total s"
    ]
    for label, result in results.items():
        epoch = first_epoch_reaching(result, target)
        seconds = seconds_to_target(result, target)
        lines.append(
            f"{label:<{width}}  {result.final_accuracy:>9.4f}  "
            f"{'-' if epoch is None else epoch:>12}  "
            f"{'-' if seconds is None else f'{seconds:.1f}':>14}  "
            f"{result.seconds:>7.1f}"
        )
    return "\n".join(lines)


def write_plots(results: Mapping[str, RunResult], folder: Path) -> list[Path]:
    """Accuracy and loss against epoch and wall time, one line per run (PNG files)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label in (("test_accuracy", "test accuracy"), ("train_loss", "train loss")):
        figure, axes = plt.subplots(1, 2, figsize=(10, 4))
        for name, result in results.items():
            epochs = [s["epoch"] for s in result.epochs]
            values = [s[metric] for s in result.epochs]
            seconds = [s["seconds"] for s in result.epochs]
            axes[0].plot(epochs, values, marker="o", label=name)
            axes[1].plot(seconds, values, marker="o", label=name)
        axes[0].set_xlabel("epoch")
        axes[1].set_xlabel("training wall time (s)")
        for axis in axes:
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
            axis.legend()
        figure.suptitle(f"{label} of {', '.join(results)}")
        figure.tight_layout()
        path = folder / f"{metric}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
