"""Smoke test of benchmarks/step_overhead.py: it runs end to end and writes a complete JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_overhead.py"


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("step_overhead_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


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
