"""The dkfac command end to end: train, resume, compare, and every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dkfac
from dkfac.cli.launch import WorkerError, spawn_local
from dkfac.cli.main import main
from dkfac.cli.train import restore_checkpoint

pytest.importorskip("sklearn")

QUICK = [
    "--model",
    "mlp",
    "--dataset",
    "digits",
    "--batch-size",
    "32",
    "--log-every",
    "1",
    "--steps-per-epoch",
    "6",
]


def epochs_of(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line).get("event") == "epoch"]


def steps_of(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "event" not in json.loads(line)]


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_train_writes_config_metrics_plots_and_checkpoint(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(
        ["train", *QUICK, "--epochs", "2", "--nproc", "2", "--strategy", "dkfac", "--out", str(out)]
    )
    assert code == 0
    assert 'strategy = "dkfac"' in (out / "config.toml").read_text()
    epochs = epochs_of(out)
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert all(0.0 <= e["test_accuracy"] <= 1.0 for e in epochs)
    steps = steps_of(out)
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(s["comm_bytes"] > 0 and "factor_compute" in s["kfac_seconds"] for s in steps)
    assert is_png(out / "plots" / "test_accuracy.png") and is_png(out / "plots" / "train_loss.png")
    assert (out / "checkpoint.pt").is_file()
    assert "test acc" in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "pad"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, strategy: str) -> None:
    common = [
        *QUICK,
        "--epochs",
        "2",
        "--nproc",
        "2",
        "--strategy",
        strategy,
        "--grad-worker-fraction",
        "0.5",
        "--inv-update-steps",
        "4",
        "--schedule",
        "cosine",
    ]
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main(["train", *common, "--out", str(full)]) == 0
    assert main(["train", *common, "--out", str(parts), "--stop-after-steps", "9"]) == 0
    assert [s["step"] for s in steps_of(parts)] == list(range(1, 10))
    assert main(["train", *common, "--out", str(parts), "--resume"]) == 0
    keys = ("step", "loss", "lr")
    assert [[s[k] for k in keys] for s in steps_of(parts)] == [
        [s[k] for k in keys] for s in steps_of(full)
    ]
    keys = ("epoch", "train_loss", "test_loss", "test_accuracy")
    assert [[e[k] for k in keys] for e in epochs_of(parts)] == [
        [e[k] for k in keys] for e in epochs_of(full)
    ]


def test_resume_on_a_different_world_size(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [
        *QUICK,
        "--epochs",
        "2",
        "--strategy",
        "dkfac",
        "--inv-update-steps",
        "4",
        "--out",
        str(out),
    ]
    assert main(["train", *common, "--nproc", "2", "--stop-after-steps", "5"]) == 0
    assert main(["train", *common, "--nproc", "1", "--resume"]) == 0
    steps = [s["step"] for s in steps_of(out)]
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[-1] == 12


def test_resume_on_another_world_size_gathers_factors_held_by_their_owners() -> None:
    # PAD-KFAC keeps each factor on its owner only: rank 0 saved A, rank 1 saved G.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    pre = dkfac.KFACPreconditioner(model)
    a, g = torch.eye(4) * 2, torch.eye(2) * 3
    states = [
        {"version": 1, "steps": 7, "inverse_method": "eigen", "layers": {"0": {"A": a, "G": None}}},
        {"version": 1, "steps": 7, "inverse_method": "eigen", "layers": {"0": {"A": None, "G": g}}},
    ]
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "ranks": [{"pre": state, "rng": None, "totals": torch.zeros(3)} for state in states],
        "epoch": 0,
        "batch": 3,
        "step": 7,
        "world_size": 2,
    }
    restore_checkpoint(saved, model, optimizer, scheduler, pre, rank=0, world=1)
    assert pre.steps == 7
    restored_a, restored_g = pre.factors()["0"]
    assert torch.equal(restored_a, a) and torch.equal(restored_g, g)


def test_compare_reports_both_runs_with_plots(tmp_path: Path, capsys) -> None:
    code = main(["compare", *QUICK, "--epochs", "1", "--nproc", "1", "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "SGD " in text and "SGD+K-FAC (dkfac)" in text and "final acc" in text
    assert is_png(tmp_path / "plots" / "test_accuracy.png")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--model", "vgg"], "vgg"),
        (["train", "--dataset", "imagenet"], "imagenet"),
        (["train", "--strategy", "magic"], "--strategy 'magic'"),
        (
            ["train", "--nproc", "3", "--strategy", "kaisa", "--grad-worker-fraction", "0.5"],
            "--grad-worker-fraction",
        ),
        (["train", "--inv-update-steps", "3", "--factor-update-steps", "2"], "multiple"),
        (["train", "--lr", "-1"], "--lr"),
        (["train", "--strategy", "local", "--nproc", "2"], "drift apart"),
        (["train", "--model", "transformer"], "transformer"),
        (["train", "--dataset", "cifar10", "--data-root", "/nonexistent/cifar"], "data_batch_1"),
        (["train", "--config", "/nonexistent.toml"], "no such file"),
        (["train", "--out", "/proc/version/run"], "cannot write"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(
    argv: list[str], message: str, tmp_path: Path, capsys
) -> None:
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dkfac: error:") and "\n" not in err and message in err, err


def test_resume_without_checkpoint_and_unknown_config_keys(tmp_path: Path, capsys) -> None:
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text('model = "mlp"\nlearning_rate = 0.1\n')
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "x")]) == 2
    assert "learning_rate" in capsys.readouterr().err


def test_config_file_values_are_overridden_by_flags(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: mlp\nepochs: 5\nsteps-per-epoch: 2\nbatch_size: 16\n")
    out = tmp_path / "run"
    assert (
        main(["train", "--config", str(config), "--epochs", "1", "--nproc", "1", "--out", str(out)])
        == 0
    )
    text = (out / "config.toml").read_text()
    assert "epochs = 1" in text and 'model = "mlp"' in text and "batch_size = 16" in text


def failing_worker() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("disk on fire")
    dist.barrier()


def test_a_crashing_worker_stops_all_and_shows_its_error() -> None:
    with pytest.raises(WorkerError) as caught:
        spawn_local(failing_worker, 2, threads=1)
    assert caught.value.rank == 1 and "disk on fire" in str(caught.value)
    assert "Traceback" in caught.value.details


def test_console_script_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dkfac.cli.main", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "--grad-worker-fraction" in done.stdout
