"""``dkfac train --tensorboard DIR``: the metrics.jsonl records as TensorBoard scalars.

Oracle: the run's own ``metrics.jsonl`` (what TensorBoard shows must be those numbers, at
those steps), read back through TensorBoard's own event reader.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dkfac.cli.config import TrainConfig
from dkfac.cli.main import main
from dkfac.cli.tensorboard_log import TensorBoardLog, scalars
from test_cli import QUICK, steps_of

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``directory``'s event files: ``tag -> [(step, value)]``."""
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_a_run_shows_its_metrics_in_tensorboard(tmp_path: Path) -> None:
    out, board = tmp_path / "run", tmp_path / "tb"
    argv = ["train", *QUICK, "--epochs", "2", "--nproc", "1", "--strategy", "dkfac"]
    assert main([*argv, "--out", str(out), "--tensorboard", str(board)]) == 0
    shown = read_scalars(board)
    steps = steps_of(out)
    assert len(steps) > 5
    for key in ("loss", "accuracy", "lr"):
        expected = [(s["step"], s[key]) for s in steps]
        assert [step for step, _ in shown[f"train/{key}"]] == [step for step, _ in expected]
        for (_, value), (_, wanted) in zip(shown[f"train/{key}"], expected, strict=True):
            assert value == pytest.approx(wanted, rel=1e-6)  # stored as float32
    phases = {f"kfac_seconds/{phase}" for phase in steps[0]["kfac_seconds"]}
    assert phases and phases <= set(shown)
    epochs = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("event") == "epoch"
    ]
    assert [(e["step"], e["test_accuracy"]) for e in epochs] == [
        (step, pytest.approx(value, rel=1e-6)) for step, value in shown["epoch/test_accuracy"]
    ]


def test_a_resumed_run_replaces_what_was_written_after_its_checkpoint(tmp_path: Path) -> None:
    # A crashed run wrote steps 1..10; its checkpoint is at step 5; the resumed run writes
    # 6..8 again with other values. TensorBoard must show 1..5 from the first and 6..8 from
    # the second, nothing of the first run's 6..10.
    first = TensorBoardLog(str(tmp_path))
    for step in range(1, 11):
        first.write({"step": step, "loss": float(step)})
    first.close()
    second = TensorBoardLog(str(tmp_path))
    second.resumed_at(5)
    for step in range(6, 9):
        second.write({"step": step, "loss": 100.0 + step})
    second.close()
    assert read_scalars(tmp_path)["train/loss"] == [
        *[(step, float(step)) for step in range(1, 6)],
        *[(step, 100.0 + step) for step in range(6, 9)],
    ]


def test_records_become_scalars_by_kind() -> None:
    step = {"step": 3, "epoch": 1, "loss": 0.5, "accuracy": 0.25, "lr": 0.1, "seconds": 0.01}
    step |= {"kfac_seconds": {"precondition": 0.002}, "comm_bytes": 64}
    assert scalars(step) == {
        "train/loss": 0.5,
        "train/accuracy": 0.25,
        "train/lr": 0.1,
        "train/seconds": 0.01,
        "kfac_seconds/precondition": 0.002,
        "kfac/comm_bytes": 64.0,
    }
    epoch = {"event": "epoch", "epoch": 2, "step": 9, "test_loss": 0.3, "device": "cpu"}
    assert scalars(epoch) == {"epoch/epoch": 2.0, "epoch/test_loss": 0.3}
    assert scalars({"event": "strategy", "step": 0, "strategy": "spd", "reason": "..."}) == {}


def test_without_the_package_the_option_is_refused_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    out = tmp_path / "run"
    for command in ("train", "compare"):
        argv = [command, *QUICK, "--nproc", "1", "--out", str(out)]
        assert main([*argv, "--tensorboard", str(tmp_path / "tb")]) == 2
        assert "pip install 'dkfac[tensorboard]'" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()
    # A saved configuration naming a TensorBoard folder still loads (to resume without it).
    assert TrainConfig(tensorboard="runs/tb").with_overrides({"tensorboard": ""}).tensorboard == ""


def test_compare_writes_each_run_beside_the_others(tmp_path: Path) -> None:
    out, board = tmp_path / "runs", tmp_path / "tb"
    argv = ["compare", *QUICK, "--epochs", "1", "--nproc", "1", "--out", str(out)]
    argv += ["--recipe", "none"]  # the plain K-FAC folder names below
    assert main([*argv, "--strategies", "none,local", "--tensorboard", str(board)]) == 0
    for folder in ("SGD", "SGD_K-FAC_local"):
        losses = [s["loss"] for s in steps_of(out / folder)]
        shown = [value for _, value in read_scalars(board / folder)["train/loss"]]
        assert shown == pytest.approx(losses, rel=1e-6)
    assert "kfac_seconds/precondition" in read_scalars(board / "SGD_K-FAC_local")
