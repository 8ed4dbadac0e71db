"""Smoke tests of benchmarks/step_overhead.py and benchmarks/strategies.py: they run end to end
and write a complete JSON."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from dkfac.bench.options import add_bench_options, options_from_args
from script_loader import load_benchmark


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("step_overhead", monkeypatch)


@pytest.mark.slow
def test_step_overhead_quick_run_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load_script(monkeypatch)
    out = tmp_path / "x.json"
    argv = ["--quick", "--rounds", "1", "--warmup", "1", "--iters", "2", "--iters-short", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kfac-pytorch 0.4.2 measured on this machine class" in printed

    report = json.loads(out.read_text())
    assert {
        "environment",
        "settings",
        "configurations",
        "rounds",
        "summary",
        "reference",
        "targets",
    } <= report.keys()
    assert {"torch_version", "torch_num_threads", "cpu_count", "python_version", "platform"} <= (
        report["environment"].keys()
    )
    assert report["environment"]["torch_num_threads"] == 1

    keys = [c["key"] for c in report["configurations"]]
    assert keys == [
        "sgd",
        "kfac_eigen_1_1",
        "kfac_inverse_1_1",
        "kfac_eigen_10_100",
        "kfac_inverse_10_100",
    ]
    assert len(report["rounds"]) == 1
    windows = report["rounds"][0]["windows"]
    assert set(windows) == set(keys)
    for key, window in windows.items():
        assert window["iters"] == 2
        assert len(window["iter_s"]) == 2
        assert all(t > 0 for t in window["iter_s"])
        assert all(t > 0 for t in window["fwd_bwd_s"])
        assert all(t > 0 for t in window["opt_step_s"])
        if key != "sgd":
            assert all(t > 0 for t in window["pre_step_s"])
        assert window["wall_s"] > 0
        assert math.isfinite(window["final_loss"])

    summary = report["summary"]
    assert set(summary) == set(keys)
    for key, entry in summary.items():
        assert entry["amortized_s"] > 0
        assert entry["median_s"] > 0
        assert entry["fwd_bwd_s"] > 0
        if key == "sgd":
            assert entry["overhead_pct"] is None
        else:
            assert entry["pre_step_s"] > 0
            assert isinstance(entry["overhead_pct"], float)
            assert math.isfinite(entry["overhead_pct"])
    # Two iterations cannot cover an inverse period of 100: the verdicts must say so.
    for verdict in report["targets"].values():
        assert verdict["window_covers_whole_periods"] is False


def _torchrun_available() -> bool:
    """Whether ``python -m torch.distributed.run`` can start gloo workers here."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    return importlib.util.find_spec("torch.distributed.run") is not None


def _load_strategies(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("strategies", monkeypatch)


def test_strategies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load_strategies(monkeypatch)
    parser = argparse.ArgumentParser()
    add_bench_options(parser, models=bench.MODELS, nprocs=bench.NPROCS)
    full = options_from_args(parser.parse_args([]), models=bench.MODELS, nprocs=bench.NPROCS)
    assert full.models == ("resnet20", "resnet32", "mlp6")
    assert full.nprocs == (2, 4)
    assert full.strategies == ("dkfac", "kaisa", "spd", "pad", "dp")
    assert full.schedules == ((1, 1), (10, 100))
    quick = options_from_args(
        parser.parse_args(["--quick"]), models=bench.MODELS, nprocs=bench.NPROCS
    )
    assert (quick.models, quick.nprocs, quick.rounds) == (("resnet20",), (2,), 1)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not _torchrun_available(), reason="needs torchrun and gloo")
def test_strategies_quick_run_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load_strategies(monkeypatch)

    out = tmp_path / "strategies.json"
    # warm-up 1 + 10 long iterations: the (10,100) windows hold the factor update of step 10.
    argv = ["--quick", "--rounds", "1", "--warmup", "1", "--iters", "2", "--iters-long", "10"]
    assert bench.main([*argv, "--timeout", "180", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kfac-pytorch 0.4.2 on this machine class" in printed
    assert "dkfac ResNet-20 P=2 (1,1)" in printed
    assert "target spd/pad vs dkfac (P=4, (1,1)" in printed and "not evaluated" in printed

    report = json.loads(out.read_text())
    assert {
        "benchmark",
        "environment",
        "settings",
        "launches",
        "summary",
        "reference",
        "target",
        "pipelined_target",
    } <= report.keys()
    assert report["settings"]["nprocs"] == [2]
    assert report["settings"]["models"] == ["resnet20"]
    assert report["settings"]["input_shapes"] == {"resnet20": [3, 32, 32]}
    (launch,) = report["launches"]
    assert launch["nprocs"] == 2
    assert launch["ok"] is True
    assert launch["returncode"] == 0
    worker_report = launch["report"]
    assert worker_report["world_size"] == 2
    assert worker_report["environment"]["torch_num_threads"] == 1

    keys = ["sgd"]
    for schedule in ("1_1", "10_100"):
        keys += [f"{s}_{schedule}" for s in ("dkfac", "kaisa_1of2", "spd", "pad", "dp")]
    assert [c["key"] for c in worker_report["configurations"]] == keys
    (round_,) = worker_report["rounds"]
    windows = round_["windows"]["resnet20"]
    assert set(windows) == set(keys)
    for key, window in windows.items():
        expected_iters = 10 if key.endswith("_10_100") else 2
        assert window["iters"] == expected_iters
        assert len(window["iter_s"]) == expected_iters
        assert window["wall_s"] > 0
        assert math.isfinite(window["final_loss"])

    rows = {(r["model"], r["nprocs"], r["key"]): r for r in report["summary"]}
    assert set(rows) == {("resnet20", 2, key) for key in keys}
    for (_, _, key), row in rows.items():
        assert row["amortized_s"] > 0
        assert row["median_s"] > 0
        if key == "sgd":
            assert row["overhead_s"] is None
            continue
        assert math.isfinite(row["overhead_s"])
        assert math.isfinite(row["overhead_pct"])
        assert set(bench.PHASES) <= row["phase_s"].keys()
        assert {"total", "factor", "inverse", "grad"} <= row["bytes_per_step"].keys()
        assert row["bytes_per_step"]["total"] > 0
        assert row["kfac_memory_bytes"] > 0
    for key in ("dkfac_1_1", "dkfac_10_100", "spd_1_1", "spd_10_100", "pad_1_1", "pad_10_100"):
        sent = rows[("resnet20", 2, key)]["bytes_per_step"]
        assert sent["factor"] > 0
        assert sent["grad"] == 0  # D-KFAC, SPD and PAD send decompositions, never gradients
    assert rows[("resnet20", 2, "dkfac_1_1")]["bytes_per_step"]["inverse"] > 0
    for key in ("dp_1_1", "dp_10_100"):  # DP-KFAC: only preconditioned gradients travel
        sent = rows[("resnet20", 2, key)]["bytes_per_step"]
        assert sent["factor"] == 0 and sent["inverse"] == 0 and sent["grad"] > 0
    # P=2, f=1/2 is MEM-OPT: preconditioned gradients travel, decompositions do not.
    assert rows[("resnet20", 2, "kaisa_1of2_1_1")]["bytes_per_step"]["grad"] > 0

    target = report["target"]
    assert isinstance(target["measured_overhead_s"], float)
    assert isinstance(target["met"], bool)
    pipelined = report["pipelined_target"]
    assert (pipelined["evaluated"], pipelined["met"]) == (False, None)
    assert pipelined["reason"] == "P=4 was not run"
