"""The dkfac command end to end: train, resume, compare, and every bad input."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data.distributed import DistributedSampler

import dkfac
import dkfac.cli.checkpoint as checkpoint_module
import dkfac.cli.commands as commands_module
import dkfac.cli.execution as execution_module
import dkfac.cli.launch as launch_module
from dkfac.cli.checkpoint import CheckpointError, load_checkpoint, rng_state, save_atomic
from dkfac.cli.commands import compare_strategies
from dkfac.cli.config import ConfigError, TrainConfig
from dkfac.cli.config_files import load_config_file
from dkfac.cli.config_resolution import RESUME_MAY_CHANGE, resolve_config
from dkfac.cli.device import (
    LocalSlot,
    Precision,
    backend_for,
    local_slot,
    resolve_device,
    slurm_task_counts,
)
from dkfac.cli.launch import ExternalRank, external_rank, join_external
from dkfac.cli.local_workers import WorkerError, spawn_local
from dkfac.cli.lr_schedule import EpochLR, ProgressSchedule
from dkfac.cli.main import main, missing_dependency_message
from dkfac.cli.parser import build_parser
from dkfac.cli.rank_logging import configure_logging
from dkfac.cli.report import compare_table, write_plots
from dkfac.cli.run_checkpoint import placement_layout, restore_checkpoint
from dkfac.cli.run_metrics import RunResult, truncate_metrics
from dkfac.cli.sampling import EpochSampler
from dkfac.cli.train import run_training
from dkfac.cli.training_setup import _build_preconditioner, run_device

# The module, not the `main` function that dkfac.cli re-exports under the same name.
main_module = importlib.import_module("dkfac.cli.main")

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
    # Step lines: the accuracy of that batch; epoch lines: K-FAC phases summed over the epoch.
    assert all(s["accuracy"] in {k / 32 for k in range(33)} for s in steps)
    for epoch in epochs:
        mine = [s for s in steps if s["epoch"] == epoch["epoch"]]
        assert epoch["comm_bytes"] == sum(s["comm_bytes"] for s in mine) > 0
        for phase, seconds in epoch["kfac_seconds"].items():
            assert seconds == pytest.approx(sum(s["kfac_seconds"][phase] for s in mine))
    assert is_png(out / "plots" / "test_accuracy.png") and is_png(out / "plots" / "train_loss.png")
    assert (out / "checkpoint.pt").is_file()
    assert "test acc" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("strategy", "grad_sync"),
    [
        ("dkfac", "ddp"),
        pytest.param("kaisa", "ddp", marks=pytest.mark.slow),
        pytest.param("pad", "ddp", marks=pytest.mark.slow),
        ("none", "dear"),
    ],
)
def test_resume_reproduces_the_uninterrupted_run(
    tmp_path: Path, strategy: str, grad_sync: str
) -> None:
    common = [
        *QUICK,
        "--epochs",
        "2",
        "--nproc",
        "2",
        "--strategy",
        strategy,
        "--grad-sync",
        grad_sync,
        *(["--grad-worker-fraction", "0.5"] if strategy == "kaisa" else []),
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


@pytest.mark.parametrize("strategy", ["none", "dkfac"])
def test_dear_grad_sync_trains_as_ddp(tmp_path: Path, strategy: str) -> None:
    """Same losses step by step (float32: summation order differs), with and without K-FAC."""
    common = [*QUICK, "--epochs", "1", "--nproc", "2", "--strategy", strategy]
    runs = {}
    for sync in ("ddp", "dear"):
        out = tmp_path / sync
        assert main(["train", *common, "--grad-sync", sync, "--out", str(out)]) == 0
        runs[sync] = steps_of(out)
    assert [s["step"] for s in runs["dear"]] == list(range(1, 7))
    for got, want in zip(runs["dear"], runs["ddp"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (got, want)


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
    # 2 -> 1: the epoch's 6 global batches of 2 x 32 are 384 examples of its order; 5 steps
    # consumed 320, so one worker continues with the remaining 64 (2 steps of 32), and every
    # example of the epoch is seen once (before the fix it restarted its own shard at batch
    # 5: 352 examples, some twice).
    assert main(["train", *common, "--nproc", "2", "--stop-after-steps", "5"]) == 0
    assert main(["train", *common, "--nproc", "1", "--resume"]) == 0
    steps = [s["step"] for s in steps_of(out)]
    assert steps == list(range(1, 14))  # 5 + 2 steps, then the second epoch's 6 of 32
    assert [e["train_examples"] for e in epochs_of(out)] == [384, 192]
    # 1 -> 2: 4 of 6 steps of 32 consumed 128 of the epoch's 192; two workers take the
    # remaining 64 as one global batch.
    out2 = tmp_path / "run2"
    common[-1] = str(out2)
    assert main(["train", *common, "--nproc", "1", "--stop-after-steps", "4"]) == 0
    assert main(["train", *common, "--nproc", "2", "--resume"]) == 0
    assert [s["step"] for s in steps_of(out2)] == list(range(1, 12))  # 4 + 1, then 6
    assert [e["train_examples"] for e in epochs_of(out2)] == [192, 384]


def test_a_resumed_run_continues_its_cosine_on_another_world_size(tmp_path: Path) -> None:
    # 1347 digits, batch 32 per worker: 42 steps an epoch on one worker, 21 on two. Stopped
    # 8 steps into the second epoch of one worker and resumed on two, the remaining 17 steps
    # (1088 of the epoch's 1344 examples, 64 a step) must continue the cosine where it stood.
    # Oracle: the cosine of the epochs done, counted in examples, at each step's start. (A
    # schedule counted in steps put every resumed step past two workers' 42 at rate 0.)
    out = tmp_path / "run"
    common = ["--model", "mlp", "--dataset", "digits", "--batch-size", "32", "--log-every", "1"]
    common += ["--epochs", "2", "--strategy", "none", "--lr", "0.1", "--schedule", "cosine"]
    common += ["--out", str(out)]
    assert main(["train", *common, "--nproc", "1", "--stop-after-steps", "50"]) == 0
    assert main(["train", *common, "--nproc", "2", "--resume"]) == 0
    starts = [(k // 42) + (k % 42) * 32 / 1344 for k in range(50)]
    starts += [1 + (256 + j * 64) / 1344 for j in range(17)]
    steps = steps_of(out)
    assert [s["step"] for s in steps] == list(range(1, 68))
    for record, start in zip(steps, starts, strict=True):
        want = 0.1 * 0.5 * (1 + math.cos(math.pi * start / 2))
        assert record["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), record
    assert steps[-1]["lr"] > 1e-4  # the last step still trains


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
@pytest.mark.parametrize("warmup", [0.0, 1.0, 0.5])
def test_the_progress_schedule_is_the_step_schedule_at_a_fixed_world(
    schedule: str, warmup: float
) -> None:
    # Oracle: the schedule counted in optimizer steps, as it was before progress replaced it
    # (warm-up (s+1)/W, cosine of (s-W)/(T-W), x0.1 from T/2 and from 3T/4), at 7 steps an
    # epoch over 4 epochs: on one world size both must give every step the same rate.
    per_epoch, epochs = 7, 4
    total, ramp = epochs * per_epoch, warmup * per_epoch
    curve = ProgressSchedule(schedule, epochs, warmup)
    for step in range(total):
        if ramp and step < ramp:  # capped at 1: 3.5 steps of warm-up made step 3 x1.14
            want = min(1.0, (step + 1) / ramp)
        elif schedule == "cosine":
            want = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - ramp) / (total - ramp))))
        elif schedule == "step":
            want = 0.1 ** sum(step >= total * point for point in (0.5, 0.75))
        else:
            want = 1.0
        got = curve.factor(step / per_epoch, (step + 1) / per_epoch)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (step, got, want)


def test_a_schedule_restores_an_old_step_counted_state_and_refuses_one_without_rates() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    schedule = EpochLR(optimizer, ProgressSchedule("cosine", 2))
    other = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.3)
    old = torch.optim.lr_scheduler.LambdaLR(other, lambda _: 1.0)
    schedule.load_state_dict(old.state_dict())  # a checkpoint of the step-counted schedule
    assert schedule.base_lrs == [0.3]
    schedule.set(0.0, 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3) == schedule.get_last_lr()[0]
    schedule.set(1.0, 1.5)  # halfway through a 2-epoch cosine
    again = EpochLR(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.7), schedule.schedule)
    again.load_state_dict(schedule.state_dict())
    assert again.base_lrs == [0.3] and again.get_last_lr() == pytest.approx([0.15])
    with pytest.raises(ValueError, match="no base rate for each"):
        schedule.load_state_dict({"base_lrs": [0.1, 0.2]})


def test_resume_continues_the_saved_run_and_refuses_flags_that_would_change_it(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    # A run that is not the defaults: 2 epochs of an MLP, stopped after 5 steps.
    argv = ["train", *QUICK, "--epochs", "2", "--nproc", "1", "--out", str(out)]
    assert main([*argv, "--stop-after-steps", "5"]) == 0
    saved = (out / "config.toml").read_text()
    capsys.readouterr()
    # What would change the run is refused, naming the flag, and nothing is overwritten.
    assert main(["train", "--out", str(out), "--resume", "--lr", "0.2", "--model", "cnn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dkfac: error: --resume continues the run saved in") and "\n" not in err
    assert "--lr 0.2 (saved: 0.05)" in err and "--model 'cnn' (saved: 'mlp')" in err
    assert (out / "config.toml").read_text() == saved
    # The README's form: only --out and --resume; the saved 2 epochs of the MLP go on.
    assert main(["train", "--out", str(out), "--resume", "--nproc", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming {out} with its saved configuration; changed: nproc 1 -> 2" in printed
    assert [e["epoch"] for e in epochs_of(out)] == [1, 2]
    resumed = (out / "config.toml").read_text()
    assert 'model = "mlp"' in resumed and "epochs = 2" in resumed and "nproc = 2" in resumed
    assert "stop_after_steps = 0" in resumed  # the stop was the interrupted run's


def test_resume_on_another_world_size_gathers_factors_held_by_their_owners() -> None:
    # PAD-KFAC keeps each factor on its owner only: rank 0 saved A, rank 1 saved G.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = EpochLR(optimizer, ProgressSchedule("constant", 1))
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
        "position": 192,
        "budget": 384,
        "step": 7,
        "world_size": 2,
    }
    restore_checkpoint(saved, model, optimizer, scheduler, pre, rank=0, world=1)
    assert pre.steps == 7
    restored_a, restored_g = pre.factors()["0"]
    assert torch.equal(restored_a, a) and torch.equal(restored_g, g)


def test_resume_under_another_layout_on_the_same_world_size_gathers_the_factors() -> None:
    # Saved by PAD with owners placed one way (rank 0 held A, rank 1 held G); resumed on as
    # many ranks by a preconditioner whose plan differs (here: every rank holds both). Loading
    # rank 0's own state would lose G; the layout saved with it says to gather instead.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = EpochLR(optimizer, ProgressSchedule("constant", 1))
    pre = dkfac.KFACPreconditioner(model)
    a, g = torch.eye(4) * 2, torch.eye(2) * 3
    old_layout = [("0", "A", 0, 0), ("0", "G", 1, 1), ("share", None)]  # not this plan's
    ranks = [
        {"pre": {"version": 1, "steps": 7, "inverse_method": "eigen", "layers": layers}}
        | {"rng": rng_state(), "totals": torch.zeros(3), "layout": old_layout}
        for layers in ({"0": {"A": a, "G": None}}, {"0": {"A": None, "G": g}})
    ]
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "ranks": ranks,
        "epoch": 0,
        "batch": 3,
        "position": 192,
        "budget": 384,
        "step": 7,
        "world_size": 2,
    }
    restore_checkpoint(saved, model, optimizer, scheduler, pre, rank=0, world=2)
    restored_a, restored_g = pre.factors()["0"]
    assert torch.equal(restored_a, a) and torch.equal(restored_g, g)
    # The same checkpoint with this plan's layout is this rank's own state: no gathering.
    for entry in ranks:
        entry["layout"] = placement_layout(pre)
    pre = dkfac.KFACPreconditioner(model)
    restore_checkpoint(saved, model, optimizer, scheduler, pre, rank=0, world=2)
    assert pre.layers[0].g is None and torch.equal(pre.layers[0].a, a)  # rank 0's own, as saved


def test_compare_runs_every_listed_strategy_with_plots(tmp_path: Path, capsys) -> None:
    argv = ["compare", *QUICK, "--epochs", "1", "--nproc", "1", "--out", str(tmp_path)]
    argv += ["--recipe", "none"]  # plain K-FAC (compare's default recipe: test_cli_recipe.py)
    assert main([*argv, "--strategies", "none,local,dkfac"]) == 0
    text = capsys.readouterr().out
    rows = [line.split()[0] for line in text.splitlines()[1:4]]
    assert rows == ["SGD", "SGD+K-FAC", "SGD+K-FAC"] and "final acc" in text.splitlines()[0]
    assert "SGD+K-FAC (local)" in text and "SGD+K-FAC (dkfac)" in text
    folders = {"SGD": "none", "SGD_K-FAC_local": "local", "SGD_K-FAC_dkfac": "dkfac"}
    for folder, strategy in folders.items():
        assert f'strategy = "{strategy}"' in (tmp_path / folder / "config.toml").read_text()
        (epoch,) = epochs_of(tmp_path / folder)
        assert ("comm_bytes" in epoch) == (strategy != "none")
    assert is_png(tmp_path / "plots" / "test_accuracy.png")


def test_compare_default_strategies_and_table_of_n_runs(tmp_path: Path) -> None:
    assert compare_strategies(None, TrainConfig()) == ("none", "dkfac")
    assert compare_strategies(None, TrainConfig(strategy="none", nproc=1)) == ("none", "local")
    assert compare_strategies(None, TrainConfig(strategy="kaisa")) == ("none", "kaisa")
    assert compare_strategies(" none, dkfac,dp", TrainConfig()) == ("none", "dkfac", "dp")
    for bad in ("none,magic", "none,none", ""):
        with pytest.raises(ConfigError, match="--strategies"):
            compare_strategies(bad, TrainConfig())
    runs = {
        name: RunResult(
            epochs=[
                {"epoch": e, "test_accuracy": acc * e, "train_loss": 1.0 / e, "seconds": 2.0 * e}
                for e in (1, 2)
            ],
            seconds=4.0,
        )
        for name, acc in (("A", 0.3), ("B", 0.45), ("C", 0.5), ("D", 0.2))
    }
    table = compare_table(runs, 0.9).splitlines()
    assert [line.split()[0] for line in table[1:]] == ["A", "B", "C", "D"]
    assert table[2].split()[2:4] == ["2", "4.0"] and table[1].split()[2:4] == ["-", "-"]
    assert all(is_png(path) for path in write_plots(runs, tmp_path))


def test_no_arguments_print_the_help_and_compare_keeps_its_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(main_module, "cmd_compare", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(sys, "argv", ["dkfac"])
    assert main() == 0 and main([]) == 0
    assert seen == [] and capsys.readouterr().out.count("usage: dkfac") == 2
    assert main(["compare"]) == 0
    args = seen[0]
    assert args.strategies is None and args.nproc is None and args.strategy is None
    config = resolve_config(args)
    assert compare_strategies(args.strategies, config) == ("none", "dkfac")
    assert (config.nproc, config.dataset) == (2, "digits")


def test_version_module_entry_abbreviations_and_the_defaults_help_shows(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dkfac {dkfac.__version__}"
    module = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "dkfac", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (module.returncode, module.stdout.strip(), module.stderr) == (
        0,
        f"dkfac {dkfac.__version__}",
        "",
    )
    # An abbreviation is an error, not another option (--damp would have meant --damping).
    assert main(["train", "--damp", "0.1"]) == 2
    assert "unrecognized arguments: --damp" in capsys.readouterr().err
    assert main(["train", "--target-accuracy", "0.9"]) == 2  # only compare reports a target
    capsys.readouterr()
    for command, out in (("train", "runs/train"), ("compare", "runs/compare")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"(default: {out!r})" in text, command  # the folder the command writes
        assert "(choices: none, local, dkfac, kaisa, spd, pad, dp, auto)" in text
    assert "(default: 0.95)" in text  # compare's target


def test_compare_on_other_ranks_returns_without_reporting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, restore_logging: None
) -> None:
    # Rank 1 of a torchrun job: the runs give it no results; it must neither fail nor report.
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    runs: list[Any] = []
    monkeypatch.setattr(
        commands_module, "execute_runs", lambda configs, labels: runs.append(labels)
    )
    assert main(["compare", *QUICK, "--out", str(tmp_path)]) == 0
    assert runs == [["SGD", "SGD+adaptive K-FAC (dkfac)"]]  # compare's default recipe
    assert capsys.readouterr().out == ""
    assert not list(tmp_path.rglob("config.toml"))  # rank 0 writes the files
    assert logging.getLogger().level == logging.WARNING


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--model", "vgg"], "vgg"),
        (["train", "--dataset", "imagenet"], "imagenet"),
        (["train", "--strategy", "magic"], "--strategy 'magic'"),
        (
            ["train", "--nproc", "3", "--strategy", "kaisa", "--grad-worker-fraction", "0.5"],
            "--grad-worker-fraction 0.5 is not allowed with --nproc 3: fraction·P must be an "
            "integer dividing P (allowed: 1/3, 3/3)",
        ),
        (
            ["train", "--strategy", "spd", "--grad-worker-fraction", "0"],
            "--grad-worker-fraction 0.0 is not allowed: expected a number in (0, 1]",
        ),
        (
            ["train", "--strategy", "dkfac", "--grad-worker-fraction", "0.5"],
            "--grad-worker-fraction is not allowed with --strategy dkfac: only kaisa read it",
        ),
        (
            ["train", "--grad-accumulation", "2", "--adaptive"],
            "--grad-accumulation 2 is not allowed with --adaptive",
        ),
        (["train", "--grad-accumulation", "0"], "--grad-accumulation 0 is not allowed"),
        (
            ["train", "--adaptive", "--adaptive-model-fraction", "0"],
            "--adaptive-model-fraction 0.0 is not allowed: expected a number in (0, 1]",
        ),
        (
            ["train", "--adaptive-model-fraction", "0.5"],
            "--adaptive-model-fraction is not allowed without --adaptive",
        ),
        (
            ["train", "--adaptive-damping-decay", "0.9"],
            "--adaptive-damping-decay is not allowed without --adaptive",
        ),
        (
            ["train", "--adaptive", "--adaptive-damping-decay", "1.5"],
            "--adaptive-damping-decay: damping_decay=1.5 is not allowed: expected a number in "
            "(0, 1)",
        ),
        (
            ["train", "--adaptive", "--adaptive-damping-interval", "0"],
            "--adaptive-damping-interval: damping_interval=0 is not allowed",
        ),
        (
            ["train", "--adaptive", "--adaptive-min-damping", "0"],
            "--adaptive-min-damping: min_damping=0.0 is not allowed",
        ),
        (
            ["train", "--adaptive", "--adaptive-min-model-targets", "0"],
            "--adaptive-min-model-targets: min_model_targets=0 is not allowed: expected an "
            "integer >= 1",
        ),
        (
            ["train", "--adaptive-min-model-targets", "64"],
            "--adaptive-min-model-targets is not allowed without --adaptive",
        ),
        (
            ["train", "--adaptive", "--adaptive-min-damping", "0.5"],
            "--damping 0.3 is not allowed with --adaptive: expected a number in "
            "[--adaptive-min-damping 0.5, 1000.0]",
        ),
        (
            ["train", "--adaptive", "--adaptive-trusted-decrease", "0"],
            "--adaptive-trusted-decrease: trusted_decrease=0.0 is not allowed: expected a "
            "finite number > 0, or never (",
        ),
        (
            ["train", "--adaptive", "--adaptive-trusted-decrease", "sometimes"],
            "--adaptive-trusted-decrease 'sometimes' is not allowed: expected a number > 0 or "
            "never",
        ),
        (
            ["train", "--adaptive-trusted-decrease", "never"],
            "--adaptive-trusted-decrease is not allowed without --adaptive",
        ),
        (
            ["train", "--statistics-fraction", "1.5"],
            "--statistics-fraction 1.5 is not allowed: expected a number in (0, 1]",
        ),
        (
            ["train", "--nproc", "2", "--batch-size", "200", "--grad-accumulation", "4"],
            "x 4 micro-batches (at most --batch-size 168)",
        ),
        (["train", "--inv-update-steps", "3", "--factor-update-steps", "2"], "multiple"),
        (
            ["train", "--factor-update-steps", "auto"],
            "--factor-update-steps auto is not allowed with --inv-update-steps 1",
        ),
        (
            ["train", "--inv-update-steps", "often"],
            "--inv-update-steps 'often' is not allowed: expected an integer >= 1 or auto",
        ),
        (["train", "--factor-update-steps", "0"], "--factor-update-steps 0 is not allowed"),
        (["train", "--lr", "-1"], "--lr"),
        (["train", "--grad-sync", "nccl"], "--grad-sync 'nccl'"),
        (["train", "--grad-sync", "dear", "--bucket-mb", "0"], "--bucket-mb '0' is not allowed"),
        (["train", "--bucket-mb", "auto"], "--bucket-mb auto is not allowed with --grad-sync ddp"),
        (
            ["train", "--bucket-mb", " AUTO "],
            "--bucket-mb auto is not allowed with --grad-sync ddp",
        ),
        (["train", "--strategy", "local", "--nproc", "2"], "drift apart"),
        (["train", "--model", "transformer"], "transformer"),
        (["train", "--dataset", "cifar10", "--data-root", "/nonexistent/cifar"], "data_batch_1"),
        (["train", "--config", "/nonexistent.toml"], "no such file"),
        (["train", "--out", "/proc/version/run"], "cannot write"),
        (["train", "--nproc", "1", "--batch-size", "5000"], "at most --batch-size 1347"),
        (["train", "--nproc", "2", "--batch-size", "700"], "too few for 2 worker(s)"),
        (["train", "--dataset", "synthetic", "--dataset-option", "shape=3,0,4"], "shape="),
        (["train", "--dataset-option", "bogus=1"], "bogus not accepted by dataset 'digits'"),
        (["train", "--dataset-option", "shape"], "expected KEY=VALUE"),
        (["compare", "--strategies", "none,magic"], "--strategies 'none,magic'"),
        (["compare", "--strategies", "dkfac,dkfac"], "given twice"),
        (["compare", "--strategies", "dkfac", "--strategy", "kaisa"], "--strategies"),
        (["compare", "--strategies", "none,local", "--nproc", "2"], "drift apart"),
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


def test_update_intervals_are_integers_or_auto_from_flags_and_files(tmp_path: Path) -> None:
    config = TrainConfig(factor_update_steps=" AUTO ", inv_update_steps="auto")
    assert (config.factor_update_steps, config.inv_update_steps) == ("auto", "auto")
    assert TrainConfig(factor_update_steps="2", inv_update_steps=4.0).inv_update_steps == 4
    for bad in (0, -2, 1.5, True, "", "2.5", "autox"):
        with pytest.raises(ConfigError, match="is not allowed: expected an integer >= 1 or auto"):
            TrainConfig(inv_update_steps=bad)
    args = build_parser().parse_args(
        ["train", "--factor-update-steps", "auto", "--inv-update-steps", "auto"]
    )
    resolved = resolve_config(args)
    assert (resolved.factor_update_steps, resolved.inv_update_steps) == ("auto", "auto")
    # config.toml writes them back as the file option reads them.
    path = tmp_path / "config.toml"
    path.write_text(resolved.to_toml())
    again = TrainConfig().with_overrides(load_config_file(str(path)))
    assert (again.factor_update_steps, again.inv_update_steps) == ("auto", "auto")
    assert TrainConfig().with_overrides({"inv_update_steps": 10}).inv_update_steps == 10


def test_train_with_auto_intervals_chooses_them(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [*QUICK, "--epochs", "1", "--nproc", "2", "--strategy", "dkfac", "--out", str(out)]
    auto = ["--factor-update-steps", "auto", "--inv-update-steps", "auto"]
    assert main(["train", *argv, *auto, "--checkpoint-every", "6"]) == 0
    assert [s["step"] for s in steps_of(out)] == list(range(1, 7))
    assert 'factor_update_steps = "auto"' in (out / "config.toml").read_text()
    # Chosen at step 5 of 6 (factors every 2 steps while measuring, two timed decompositions
    # after the first), and saved with the run on every rank.
    saved = load_checkpoint(out)
    assert saved is not None
    for rank in saved["ranks"]:
        factor, inverse = rank["pre"]["intervals"]["chosen"]
        assert factor >= 1 and inverse >= 1 and inverse % factor == 0


@pytest.mark.parametrize("text", ["auto", "AUTO", " Auto ", "\tauto\n"])
def test_bucket_mb_auto_in_any_case_with_spaces(text: str) -> None:
    assert TrainConfig(grad_sync="dear", bucket_mb=text).bucket_cap_mb == "auto"
    with pytest.raises(ConfigError, match="--bucket-mb auto is not allowed with --grad-sync ddp"):
        TrainConfig(grad_sync="ddp", bucket_mb=text)
    assert TrainConfig(grad_sync="dear", bucket_mb=" 12.5 ").bucket_cap_mb == 12.5
    for bad in ("autox", "au to", "", "inf", "nan"):
        with pytest.raises(ConfigError, match="is not allowed: expected a number of MiB > 0"):
            TrainConfig(grad_sync="dear", bucket_mb=bad)


def test_resume_without_checkpoint_and_unknown_config_keys(tmp_path: Path, capsys) -> None:
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "no saved run in" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.toml").write_text(TrainConfig(model="mlp").to_toml())
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


def sleep_until_stopped() -> None:
    time.sleep(600)


def one_fails_one_waits_one_hangs() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(0.5)  # the others are in place first
        raise RuntimeError("disk on fire")
    if rank == 2:
        sleep_until_stopped()
    dist.barrier()


def test_every_workers_outcome_is_reported_not_only_the_first() -> None:
    # Rank 1 fails; rank 0, waiting for it in a collective, fails in turn; rank 2 never
    # returns and is stopped, its stack showing where it was.
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        spawn_local(one_fails_one_waits_one_hangs, 3, threads=1)
    assert time.monotonic() - started < 60
    error = caught.value
    assert error.rank == 1 and "disk on fire" in error.summary
    by_rank = {failure.rank: failure for failure in error.failures}
    assert sorted(by_rank) == [0, 1, 2] and error.failures[0].rank == 1
    assert "Traceback" in by_rank[0].details and "barrier" in by_rank[0].details
    assert by_rank[2].summary == "still running when rank 1 failed; stopped"
    assert "sleep_until_stopped" in by_rank[2].details
    report = error.report()
    for rank in range(3):
        assert f"--- rank {rank}:" in report
    assert report.index("--- rank 1:") < report.index("--- rank 0:")


def test_console_script_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dkfac", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "--grad-worker-fraction" in done.stdout


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_rank_0_logs_info_and_other_ranks_only_prefixed_warnings(
    capsys, restore_logging: None
) -> None:
    log = logging.getLogger("dkfac.cli.train")
    configure_logging(1)
    log.info("epoch 1/2")
    log.warning("slow peer")
    configure_logging(0)  # replaces the handler: one line per record
    log.info("epoch 2/2")
    assert capsys.readouterr().err.splitlines() == [
        "[rank 1] WARNING dkfac.cli.train: slow peer",
        "epoch 2/2",
    ]


def test_backend_follows_the_run_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    # On a GPU one group serves NCCL for CUDA tensors and gloo for the host's agreements.
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert run_device(TrainConfig(device="cpu")) == torch.device("cpu")
    assert run_device(TrainConfig()) == torch.device("cpu")  # auto, and torch sees no GPU
    # auto takes the GPUs when every local worker has one (torch made to see two).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run_device(TrainConfig(), LocalSlot(1, 2)) == torch.device("cuda", 1)
    assert run_device(TrainConfig(device="cpu"), LocalSlot(1, 2)) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    joined: list[str] = []

    def join(rank: ExternalRank, threads: int, backend: str, timeout: float) -> None:
        joined.append(backend)
        raise RuntimeError("stop before training")

    monkeypatch.setattr(execution_module, "join_external", join)
    with pytest.raises(RuntimeError, match="stop before training"):
        execution_module.execute(TrainConfig(model="mlp"))
    assert joined == ["gloo"]


def test_device_choice_takes_the_gpu_of_the_local_rank_or_says_why_not() -> None:
    assert resolve_device("cuda", LocalSlot(3, 4), cuda_count=4) == torch.device("cuda", 3)
    assert resolve_device("auto", LocalSlot(3, 4), cuda_count=4) == torch.device("cuda", 3)
    # auto falls back to the CPU when some local worker would have no GPU of its own.
    assert resolve_device("auto", LocalSlot(0, 2), cuda_count=1) == torch.device("cpu")
    assert resolve_device("auto", LocalSlot(0, 1), cuda_count=0) == torch.device("cpu")
    assert resolve_device("cpu", LocalSlot(0, 1), cuda_count=8) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"--device cuda is not allowed here: .* sees no GPU"):
        resolve_device("cuda", LocalSlot(0, 1), cuda_count=0)
    with pytest.raises(ValueError, match="with 2 workers on this machine: it has 1 GPU"):
        resolve_device("cuda", LocalSlot(0, 2), cuda_count=1)


def test_local_slot_from_torchrun_slurm_and_local_workers() -> None:
    torchrun = {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "SLURM_LOCALID": "0"}
    assert local_slot(torchrun) == LocalSlot(2, 4)
    assert local_slot({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x3)"}) == LocalSlot(1, 2)
    assert local_slot({}, default_world=3) == LocalSlot(0, 3)
    # Without --ntasks-per-node Slurm still gives the step's per-node list: this node's entry.
    step = {"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}
    assert local_slot(step, default_world=2) == LocalSlot(1, 3)
    assert slurm_task_counts("4(x2),3") == [4, 4, 3] and slurm_task_counts("8") == [8]


def test_device_and_amp_refusals_name_what_to_use_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # also on a GPU machine
    with pytest.raises(ConfigError, match="--device cuda is not allowed here"):
        run_device(TrainConfig(device="cuda"))
    with pytest.raises(ConfigError, match=r"--amp fp16 is not allowed on the CPU: .* bf16"):
        run_device(TrainConfig(amp="fp16"))
    with pytest.raises(
        ConfigError, match=r"--plain-step-graphs is not allowed on the CPU: .* --device cuda"
    ):
        run_device(TrainConfig(plain_step_graphs=True))
    with pytest.raises(ConfigError, match="--device 'tpu' is not allowed: choose one of auto"):
        TrainConfig(device="tpu")
    with pytest.raises(ConfigError, match="--amp fp16 is not allowed with --adaptive"):
        TrainConfig(amp="fp16", adaptive=True)
    with pytest.raises(ConfigError, match="--amp fp16 is not allowed with --grad-sync dear"):
        TrainConfig(amp="fp16", grad_sync="dear")
    with pytest.raises(ConfigError, match="--loader-workers -2 is not allowed"):
        TrainConfig(loader_workers=-2)


def test_external_rank_from_torchrun_and_slurm_environments() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "node0", "LOCAL_RANK": "1"}
    assert external_rank(torchrun) == ExternalRank(3, 4, "torchrun")
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    assert external_rank(slurm) == ExternalRank(5, 8, "slurm")
    assert external_rank({**slurm, **torchrun}).launcher == "torchrun"  # torchrun inside srun
    assert external_rank({}) is None
    assert external_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one task
    assert external_rank({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no rendezvous address


def test_join_external_under_slurm_sets_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    monkeypatch.setattr(launch_module.os, "environ", environ)  # the whole process environment
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        launch_module.dist,
        "init_process_group",
        lambda backend, rank, world_size, timeout, store: calls.append(
            (backend, rank, world_size, timeout.total_seconds(), store)
        ),
    )
    outside = external_rank()
    assert outside == ExternalRank(1, 2, "slurm")
    join_external(outside, torch.get_num_threads(), "gloo", collective_timeout=45.0)
    assert calls == [("gloo", 1, 2, 45.0, None)]  # the job's own store: no torchrun attempts
    assert {
        name: environ[name] for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    } == {
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }


def test_save_atomic_keeps_the_previous_checkpoint_when_writing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_atomic({"step": 1, "weights": torch.ones(3)}, tmp_path)

    def broken_save(payload: Any, stream: Any) -> None:
        stream.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        save_atomic({"step": 2, "weights": torch.zeros(3)}, tmp_path)
    monkeypatch.undo()
    saved = load_checkpoint(tmp_path)
    assert saved is not None and saved["step"] == 1 and torch.equal(saved["weights"], torch.ones(3))
    # A write that fails on the disk (fsync) leaves no temporary and the checkpoint intact.
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        save_atomic({"step": 3, "weights": torch.zeros(3)}, tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.sha256"]
    assert load_checkpoint(tmp_path)["step"] == 1  # type: ignore[index]


class NotACheckpoint:
    pass


def test_the_last_two_checkpoints_are_kept_and_a_damaged_one_is_detected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2, 3):
        save_atomic({"step": step}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.prev.pt",
        "checkpoint.prev.pt.sha256",
        "checkpoint.pt",
        "checkpoint.pt.sha256",
    ]
    assert load_checkpoint(tmp_path) == {"step": 3}
    newest = tmp_path / "checkpoint.pt"
    data = newest.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "corrupted": data[:100] + bytes([data[100] ^ 0xFF]) + data[101:],
    }
    for kind, content in damaged.items():
        newest.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dkfac.cli.checkpoint"):
            assert load_checkpoint(tmp_path) == {"step": 2}, kind
        (line,) = [r.getMessage() for r in caplog.records]
        assert "checkpoint.pt: its SHA-256 does not match" in line and "truncated or" in line
        assert line.endswith("using " + str(tmp_path / "checkpoint.prev.pt") + " instead")
    # Both damaged: nothing usable is an error that names both.
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint: .*checkpoint.pt: .*prev"):
        load_checkpoint(tmp_path)
    # Only plain data is read back (torch.load weights_only=True): no arbitrary objects.
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"step": 1, "x": NotACheckpoint()}, other / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"cannot be read .*Weights only load failed"):
        load_checkpoint(other)


def dkfac_command(*argv: str) -> subprocess.CompletedProcess[str]:
    """``dkfac ARGV`` in a process of its own: its workers' output is captured too."""
    return subprocess.run(
        [sys.executable, "-m", "dkfac", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_resume_after_a_damaged_checkpoint_uses_the_previous_one_and_ends_the_same(
    tmp_path: Path,
) -> None:
    common = ["train", *QUICK, "--epochs", "2", "--nproc", "1", "--checkpoint-every", "2"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main([*common, "--out", str(full)]) == 0
    assert main([*common, "--out", str(parts), "--stop-after-steps", "5"]) == 0
    newest = parts / "checkpoint.pt"  # step 5; the previous one is step 4
    newest.write_bytes(newest.read_bytes()[:-300])  # a write cut short
    done = dkfac_command("train", "--out", str(parts), "--resume")
    assert done.returncode == 0, done.stderr
    assert "its SHA-256 does not match" in done.stderr
    assert "checkpoint.prev.pt instead" in done.stderr
    keys = ("step", "loss", "lr")
    assert [[s[k] for k in keys] for s in steps_of(parts)] == [
        [s[k] for k in keys] for s in steps_of(full)
    ]
    assert epochs_of(parts)[-1]["test_loss"] == epochs_of(full)[-1]["test_loss"]
    # Nothing usable: one line, exit code 2.
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (parts / name).write_bytes(b"not a checkpoint")
    done = dkfac_command("train", "--out", str(parts), "--resume")
    assert done.returncode == 2
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("dkfac:")]
    assert line.startswith("dkfac: error: no usable checkpoint:") and "prev.pt" in line


def test_checkpoint_every_n_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train", *QUICK, "--epochs", "2", "--steps-per-epoch", "5", "--strategy", "local"]
    args = build_parser().parse_args(
        [*argv, "--nproc", "1", "--checkpoint-every", "3", "--out", str(tmp_path)]
    )
    config = resolve_config(args)
    assert config.checkpoint_every == 3
    written: list[tuple[int, int, int]] = []

    def recording_save(payload: dict[str, Any], folder: Path) -> Path:
        written.append((payload["step"], payload["epoch"], payload["batch"]))
        return save_atomic(payload, folder)

    monkeypatch.setattr("dkfac.cli.run_checkpoint.save_atomic", recording_save)
    run_training(config)  # in this process: one rank, no process group
    # Every 3 steps (epoch, batch within it), and at both epoch ends.
    assert written == [(3, 0, 3), (5, 1, 0), (6, 1, 1), (9, 1, 4), (10, 2, 0)]


def test_a_crash_in_a_worker_is_exit_code_1_with_its_error(tmp_path: Path, capsys) -> None:
    assert main(["train", *QUICK, "--nproc", "1", "--epochs", "1", "--out", str(tmp_path)]) == 0
    torch.save({"model": {}}, tmp_path / "checkpoint.pt")  # intact, not this model's weights
    (tmp_path / "checkpoint.pt.sha256").unlink()  # as an older dkfac wrote them
    code = main(["train", *QUICK, "--nproc", "1", "--resume", "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "dkfac: worker 0 failed: RuntimeError: Error(s) in loading state_dict" in err
    assert "Traceback" in err and "Missing key(s)" in err


def test_bad_input_found_by_a_worker_is_one_line_and_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Without the parent's check, the worker refuses the batch size itself.
    monkeypatch.setattr(execution_module, "_check_before_start", lambda configs, world: None)
    argv = ["train", "--model", "mlp", "--nproc", "1", "--batch-size", "5000"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dkfac: error: --batch-size 5000") and "\n" not in err, err


def test_worker_errors_map_to_exit_codes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys):
    def failing(cause: BaseException) -> Any:
        def execute(*args: Any, **kwargs: Any) -> None:
            raise WorkerError(1, f"{type(cause).__name__}: {cause}", "Traceback ...", cause)

        return execute

    argv = ["train", "--model", "mlp", "--out", str(tmp_path)]
    cases = [
        (ConfigError("--lr 5 is not allowed\n on rank 1"), 2, "dkfac: error: --lr 5 is not"),
        (ModuleNotFoundError("No module named 'tqdm'", name="tqdm"), 2, "pip install tqdm"),
        (RuntimeError("disk on fire"), 1, "dkfac: worker 1 failed: RuntimeError: disk on fire"),
        # A plain ValueError in a worker is a bug, not bad input: its traceback is shown.
        (ValueError("zip() argument 2 is shorter"), 1, "ValueError: zip() argument 2"),
    ]
    for cause, code, message in cases:
        monkeypatch.setattr(commands_module, "execute", failing(cause))
        assert main(argv) == code
        err = capsys.readouterr().err
        assert message in err and (code == 1) == ("Traceback" in err), err
        assert code == 1 or len(err.strip().splitlines()) == 1


def test_missing_optional_dependencies_say_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    assert main(["train", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dkfac: error:") and "\n" not in err and "pip install" in err, err
    plots = missing_dependency_message(
        ModuleNotFoundError("No module named 'x'", name="matplotlib")
    )
    assert "pip install matplotlib" in plots and "dkfac[cli]" in plots
    assert "scikit-learn" in missing_dependency_message(ModuleNotFoundError(name="sklearn.base"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    commands_module._print_plots({"run": RunResult()}, tmp_path / "plots")
    assert "plots: skipped" in capsys.readouterr().out and not (tmp_path / "plots").exists()


@pytest.mark.parametrize(
    "argv",
    [["train", "--epochs", "abc"], ["compare", "--lr", "fast"], ["train", "--nope"], ["fly"]],
)
def test_parser_errors_are_one_line(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    prog = "dkfac" if argv[0] == "fly" or "--nope" in argv else f"dkfac {argv[0]}"
    assert err.startswith(f"{prog}: error: ") and "\n" not in err and "usage" not in err, err


def test_toml_config_overridden_by_flags_on_the_synthetic_dataset(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        'model = "mlp"\ndataset = "synthetic"\nepochs = 4\nbatch_size = 16\nsteps_per_epoch = 2\n'
        "[dataset_options]\nshape = [2, 4, 4]\nnum_classes = 3\ntrain_size = 64\n"
    )
    out = tmp_path / "run"
    argv = ["train", "--config", str(config), "--epochs", "1", "--nproc", "1", "--out", str(out)]
    argv += ["--dataset-option", "shape=3,4,4", "--dataset-option", "test-size=24"]
    assert main(argv) == 0
    text = (out / "config.toml").read_text()
    assert "epochs = 1" in text and "batch_size = 16" in text and 'dataset = "synthetic"' in text
    options = "dataset_options = { num_classes = 3, shape = [3, 4, 4], test_size = 24, "
    assert options + "train_size = 64 }" in text
    # The written file is a valid config: reading it back gives the same configuration.
    resolved = TrainConfig().with_overrides(load_config_file(str(out / "config.toml")))
    assert resolved.dataset_kwargs == {
        "num_classes": 3,
        "shape": (3, 4, 4),
        "test_size": 24,
        "train_size": 64,
    }
    assert [e["epoch"] for e in epochs_of(out)] == [1]
    assert len(steps_of(out)) == 0  # log_every 10 > 2 steps


def test_npz_dataset_through_the_cli(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    out = tmp_path / "run"
    argv = ["train", "--dataset", "npz", "--data-root", str(tmp_path / "data.npz"), "--nproc", "1"]
    argv += ["--model", "mlp", "--epochs", "2", "--batch-size", "8", "--strategy", "local"]
    assert main([*argv, "--dataset-option", "test_fraction=0.25", "--out", str(out)]) == 0
    epochs = epochs_of(out)
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["step"] == 2 * (72 // 8)


@pytest.mark.parametrize("size", [103, 128])
def test_epoch_sampler_resumes_at_the_exact_example_on_any_number_of_ranks(size: int) -> None:
    full = EpochSampler(size, 1, 0, seed=3)
    full.set_epoch(2)
    order = full.order().tolist()
    for world in (1, 2, 3):
        # From the start: what DistributedSampler(shuffle, drop_last) yields, rank by rank.
        for rank in range(world):
            ours = EpochSampler(size, world, rank, seed=3)
            ours.set_epoch(2)
            theirs = DistributedSampler(
                range(size), num_replicas=world, rank=rank, seed=3, drop_last=True
            )
            theirs.set_epoch(2)
            assert list(ours) == list(theirs)
        # From any position: the ranks together continue the order exactly once.
        for start in (0, 1, 40, size - 2):
            shares = []
            for rank in range(world):
                sampler = EpochSampler(size, world, rank, seed=3)
                sampler.set_epoch(2, start)
                shares.append(list(sampler))
                assert len(shares[-1]) == len(sampler) == (size - start) // world
            taken = [shares[r][i] for i in range(len(shares[0])) for r in range(world)]
            assert taken == order[start : start + len(taken)]
    with pytest.raises(ValueError, match="start=200"):
        full.set_epoch(0, 200)


def test_adaptive_trains_and_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    out = tmp_path / "adaptive"
    argv = ["train", "--model", "cnn", "--dataset", "digits", "--strategy", "local"]
    adaptive = ["--adaptive", "--adaptive-model-fraction", "0.5"]
    assert main([*argv, "--nproc", "1", "--epochs", "1", *adaptive, "--out", str(out)]) == 0
    written = (out / "config.toml").read_text()
    assert "adaptive = true" in written and "adaptive_model_fraction = 0.5" in written
    # One epoch of adaptive K-FAC (about 45 steps of 32 digits, the quadratic model's
    # curvature from 16 of each) learns the task.
    assert epochs_of(out)[-1]["test_accuracy"] > 0.9
    with pytest.raises(ConfigError, match="--adaptive is not allowed with --strategy none"):
        TrainConfig(adaptive=True, strategy="none")
    with pytest.raises(ConfigError, match="--adaptive is not allowed with --grad-sync dear"):
        TrainConfig(adaptive=True, grad_sync="dear")
    with pytest.raises(ConfigError, match="option adaptive = 'false' is not allowed"):
        TrainConfig().with_overrides({"adaptive": "false"})  # a string is not a boolean
    assert TrainConfig().with_overrides({"adaptive": True}).adaptive is True


def test_grad_accumulation_trains_as_the_batch_its_micro_batches_make(tmp_path: Path) -> None:
    """--batch-size 8 --grad-accumulation 4 sees the same 32 examples per step per worker as
    --batch-size 32 (the loader takes a step's examples, split in four): the oracle is that
    run, to float32 round-off (the sums are ordered differently)."""
    common = [*QUICK[:4], "--nproc", "2", "--epochs", "1", "--steps-per-epoch", "4"]
    common += ["--log-every", "1", "--strategy", "dkfac", "--damping", "0.03"]
    runs = {}
    for name, extra in (
        ("big", ["--batch-size", "32"]),
        ("micro", ["--batch-size", "8", "--grad-accumulation", "4"]),
    ):
        out = tmp_path / name
        assert main(["train", *common, *extra, "--out", str(out)]) == 0
        runs[name] = (steps_of(out), load_checkpoint(out))
    (big_steps, big), (micro_steps, micro) = runs["big"], runs["micro"]
    assert [s["step"] for s in micro_steps] == [1, 2, 3, 4]
    for one, other in zip(big_steps, micro_steps, strict=True):
        assert one["loss"] == pytest.approx(other["loss"], rel=1e-5)
        assert one["accuracy"] == other["accuracy"]
    assert big is not None and micro is not None
    for key, tensor in big["model"].items():
        torch.testing.assert_close(micro["model"][key], tensor, rtol=1e-4, atol=1e-6)
    # K-FAC accumulated the four micro-batches' statistics (else the factors would differ).
    mine, theirs = micro["ranks"][0]["pre"]["layers"], big["ranks"][0]["pre"]["layers"]
    for name in theirs:
        for side in ("A", "G"):
            torch.testing.assert_close(mine[name][side], theirs[name][side], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("statistics_precision", "bf16"),
        ("statistics_fraction", 0.25),
        ("precondition_precision", "bf16"),
        ("conv_patches", "shifted"),
    ],
)
def test_a_statistics_option_reaches_the_preconditioner_and_the_saved_config(
    tmp_path: Path, name: str, value: object
) -> None:
    argv = ["train", *QUICK, "--nproc", "1", "--epochs", "1", "--out", str(tmp_path)]
    assert main([*argv, f"--{name.replace('_', '-')}", str(value)]) == 0
    saved = load_config_file(str(tmp_path / "config.toml"))
    assert saved[name] == value
    # What the workers build from it (they run in their own processes).
    config = TrainConfig().with_overrides(saved)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = EpochLR(opt, ProgressSchedule("constant", 1))
    pre = _build_preconditioner(
        config, "local", model, scheduler, Precision("none", torch.device("cpu"))
    )
    assert getattr(pre.config, name) == value


def test_plain_step_graphs_reaches_the_preconditioner_and_may_change_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--plain-step-graphs`` (refused on the CPU, tested above) is the preconditioner's
    ``plain_step_graphs``; a resumed run may turn it on or off (the same arithmetic)."""
    import dkfac.preconditioner

    class AnyDevice:  # the graph's capture, allowed here (this machine has no GPU)
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def release(self) -> None:
            pass

    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", AnyDevice)
    args = build_parser().parse_args(["train", "--plain-step-graphs"])
    config = resolve_config(args)
    assert config.plain_step_graphs
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = EpochLR(opt, ProgressSchedule("constant", 1))
    pre = _build_preconditioner(
        config, "local", model, scheduler, Precision("none", torch.device("cpu"))
    )
    assert pre.config.plain_step_graphs and isinstance(pre._plain._graphs, AnyDevice)
    pre.remove()
    assert "plain_step_graphs" in RESUME_MAY_CHANGE
    # Another way to form the same Grams (to round-off): a run short of memory may resume
    # with the shifted products.
    assert "conv_patches" in RESUME_MAY_CHANGE


def test_the_adaptive_damping_rule_reaches_adaptive_options() -> None:
    # Unset, the command's rule is the library's; set, each flag reaches its field.
    for given, expected in [
        ({}, (1, 0.5, 1e-4, 0.25, 32)),
        (
            {"adaptive_damping_interval": 5, "adaptive_damping_decay": 0.95},
            (5, 0.95, 1e-4, 0.25, 32),
        ),
        ({"adaptive_min_damping": 1e-9}, (1, 0.5, 1e-9, 0.25, 32)),
        ({"adaptive_trusted_decrease": " Never "}, (1, 0.5, 1e-4, None, 32)),
        ({"adaptive_trusted_decrease": "0.5"}, (1, 0.5, 1e-4, 0.5, 32)),
        ({"adaptive_min_model_targets": 64}, (1, 0.5, 1e-4, 0.25, 64)),
    ]:
        config = TrainConfig(adaptive=True, **given)  # type: ignore[arg-type]
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = EpochLR(opt, ProgressSchedule("constant", 1))
        pre = _build_preconditioner(
            config, "local", model, scheduler, Precision("none", torch.device("cpu"))
        )
        options = pre.config.adaptive
        assert options is not None
        rule = (options.damping_interval, options.damping_decay, options.min_damping)
        assert (*rule, options.trusted_decrease, options.min_model_targets) == expected
        pre.remove()


@pytest.mark.parametrize(("value", "expected"), [("never", None), ("0.1", 0.1)])
def test_the_trusted_decrease_survives_the_saved_config(
    tmp_path: Path, value: str, expected: float | None
) -> None:
    # "never" has no TOML of its own (no null): it is saved as the word and read back as None.
    argv = ["train", *QUICK, "--nproc", "1", "--epochs", "1", "--out", str(tmp_path)]
    argv += ["--adaptive", "--damping", "0.03", "--adaptive-trusted-decrease", value]
    assert main(argv) == 0
    saved = load_config_file(str(tmp_path / "config.toml"))
    assert saved["adaptive_trusted_decrease"] == ("never" if expected is None else expected)
    config = TrainConfig().with_overrides(saved)
    assert config.adaptive_rule["trusted_decrease"] == expected


def test_truncated_metrics_keep_what_preceded_the_checkpoint_and_no_earlier_resumption(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    written = [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.9},
        {"event": "epoch", "step": 2},
        {"event": "strategy", "step": 2, "resumed": True},  # a first resumption at step 2
        {"step": 3, "loss": 0.8},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in written))
    truncate_metrics(path, 3)  # a later checkpoint: the resumption at 2 happened before it
    assert [json.loads(line) for line in path.read_text().splitlines()] == written
    truncate_metrics(path, 2)  # the same checkpoint again: its earlier resumption goes too
    assert [json.loads(line) for line in path.read_text().splitlines()] == written[:3]


def test_a_resumed_run_reads_its_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["train", *QUICK, "--epochs", "2", "--steps-per-epoch", "2", "--strategy", "auto"]
    argv += ["--nproc", "1", "--out", str(tmp_path)]
    assert main([*argv, "--stop-after-steps", "2"]) == 0
    reads: list[Path] = []
    read = checkpoint_module._read_verified

    def counting_read(path: Path) -> dict[str, Any]:
        reads.append(path)
        return read(path)

    monkeypatch.setattr(checkpoint_module, "_read_verified", counting_read)
    # --strategy auto builds its chooser in a process group: one of one rank, in this process.
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        result = run_training(resolve_config(build_parser().parse_args(argv)), resume=True)
    finally:
        torch.distributed.destroy_process_group()
    # Read once (--strategy auto's kept choice and the restore share it), and it resumed.
    assert reads == [tmp_path / "checkpoint.pt"] and len(result.epochs) == 2
