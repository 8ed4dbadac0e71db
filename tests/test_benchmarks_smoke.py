"""Smoke tests of benchmarks/step_overhead.py, benchmarks/strategies.py and
benchmarks/network.py: they run end to end and write a complete JSON (and network.py its table
and chart)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from dkfac.bench.emulated_cluster import unavailable_reason
from dkfac.bench.options import BenchOptions, add_bench_options, options_from_args
from script_loader import load_benchmark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    for key in ("dkfac_1_1", "dkfac_10_100", "spd_1_1", "spd_10_100", "pad_10_100"):
        sent = rows[("resnet20", 2, key)]["bytes_per_step"]
        assert sent["factor"] > 0
        assert sent["grad"] == 0  # D-KFAC, SPD and amortised PAD send decompositions
    # PAD's share="auto": at (1,1) the preconditioned gradients are fewer bytes per step than
    # the decompositions, so its owners send those instead.
    sent = rows[("resnet20", 2, "pad_1_1")]["bytes_per_step"]
    assert sent["factor"] > 0 and sent["grad"] > 0 and sent["inverse"] == 0
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


def _load_network(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("network", monkeypatch)


def test_network_defaults_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load_network(monkeypatch)
    parser = bench.build_parser()
    full = bench.bench_options(parser.parse_args([]))
    assert full.models == ("resnet32", "transformer")
    assert full.nprocs == (2,)
    assert full.strategies == ("dear", "dkfac", "kaisa", "spd", "pad", "dp")
    assert full.schedules == ((1, 1), (10, 100))
    assert (full.rounds, full.warmup, full.iters, full.iters_long) == (2, 3, 10, 100)
    assert full.timeout == 6 * 3600  # slow links: longer than dkfac bench's hour
    assert full.network is None  # set per rate
    argv = ["--quick", "--models", "transformer", "--strategies", "dkfac,dear", "--rounds", "3"]
    argv += ["--warmup", "0", "--iters", "4", "--iters-long", "20", "--schedules", "1:1"]
    quick = bench.bench_options(parser.parse_args(argv))
    assert (quick.models, quick.nprocs, quick.strategies) == (
        ("transformer",),
        (2,),
        ("dear", "dkfac"),
    )
    assert (quick.rounds, quick.warmup, quick.iters, quick.iters_long) == (3, 0, 4, 20)
    assert quick.timeout == 300
    assert quick.schedules == ((1, 1),)
    rates = bench.parse_rates("300mbit, 30mbit,100mbit,30mbit")
    assert [text for text, _ in rates] == ["30mbit", "100mbit", "300mbit"]  # slowest first
    assert rates[0][1].rate_bit_s == 30e6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "100mbps"], "--rates: rate '100mbps'"),
        (["--rates", ","], "--rates needs at least one rate"),
        (["--strategies", "sgd"], "--strategies: unknown ['sgd']"),
        (["--models", "resnet99"], "--models"),
    ],
)
def test_network_refuses_bad_options(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = _load_network(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_network_says_why_without_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load_network(monkeypatch)
    monkeypatch.setattr(
        bench, "unavailable_reason", lambda: "ip netns add: Operation not permitted"
    )

    def no_run(options: BenchOptions) -> dict[str, Any]:
        raise AssertionError("nothing may be launched without an emulated cluster")

    monkeypatch.setattr(bench, "run_bench", no_run)
    assert bench.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "error: no emulated cluster on this machine: ip netns add: Operation not permitted"
    ]
    assert not (tmp_path / "out").exists()


def _summary_row(key: str, label: str, strategy: str | None, seconds: float) -> dict[str, Any]:
    """A summary row as run_bench makes it, with what the tables and the chart read."""
    row: dict[str, Any] = {
        "model": "resnet32",
        "nprocs": 2,
        "key": key,
        "label": label,
        "strategy": strategy,
        "factor_update_steps": None if strategy is None else int(key.split("_")[-2]),
        "inv_update_steps": None if strategy is None else int(key.split("_")[-1]),
        "amortized_s": seconds,
        "median_s": seconds,
        "overhead_pct": None if key == "sgd" else 0.0,
    }
    if key == "dear":
        row |= {"phase_s": {"grad_comm": 0.125}, "bytes_per_step": {"total": 2e6}}
    elif strategy is not None:
        phases = {"factor_comm": 0.25, "inverse_comm": 0.125, "grad_comm": 0.0}
        compute = {"factor_compute": 0.5, "inverse_compute": 0.25, "precondition": 0.125}
        row |= {"phase_s": phases | compute, "bytes_per_step": {"total": 8e6}}
        # in flight 1 s per step, 0.25 s of it waited for: 75% hidden
        overlap = {"in_flight_s": 1.0, "exposed_s": 0.25, "hidden_s": 0.75}
        row["overlap_s"] = {"factor_comm": overlap}
    return row


def test_network_tables_json_and_chart_from_faked_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    bench = _load_network(monkeypatch)
    monkeypatch.setattr(bench, "unavailable_reason", lambda: None)
    seen: list[float] = []

    def fake_run_bench(options: BenchOptions) -> dict[str, Any]:
        assert options.network is not None and options.nprocs == (2,)
        seen.append(options.network.rate_bit_s)
        slow = 1e8 / options.network.rate_bit_s  # 1 at 100 Mbit/s, 10 at 10 Mbit/s
        rows = [
            _summary_row("sgd", "SGD (DDP)", None, 1.0 * slow),
            _summary_row("dear", "SGD (DeAR)", None, 0.5 * slow),
            _summary_row("dkfac_1_1", "dkfac", "dkfac", 4.0 * slow),
        ]
        launch = {"nprocs": 2, "ok": True, "report": {"summary": {}}}
        return {"benchmark": "strategies", "launches": [launch], "summary": rows}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    out = tmp_path / "out"
    argv = ["--rates", "100mbit,10mbit", "--models", "resnet32", "--strategies", "dear,dkfac"]
    assert bench.main([*argv, "--schedules", "1:1", "--out", str(out)]) == 0
    assert seen == [1e7, 1e8]  # slowest first
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "ResNet-32, P=2: median s/iter per link rate (vs SGD (DDP) at that rate)" in lines
    header = lines[
        lines.index("ResNet-32, P=2: median s/iter per link rate (vs SGD (DDP) at that rate)") + 1
    ]
    assert header.split() == ["config", "(f,i)", "10", "Mbit/s", "100", "Mbit/s"]
    (dear,) = [line for line in lines if line.startswith("SGD (DeAR)") and "%" in line]
    assert dear.split() == ["SGD", "(DeAR)", "-", "5.0000", "(-50%)", "0.5000", "(-50%)"]
    assert "ResNet-32 at 10 Mbit/s: ms per iteration by phase" in lines
    at_10 = lines[lines.index("ResNet-32 at 10 Mbit/s: ms per iteration by phase") :]
    (kfac,) = [line for line in at_10[:6] if line.startswith("dkfac")]
    # median, factor_comm, inverse_comm, grad_comm, compute (0.5 + 0.25 + 0.125), MB/step,
    # factor collectives in flight (ms per step) and the share of it hidden
    assert kfac.split()[2:] == [
        "40000.0", "250.0", "125.0", "0.0", "875.0", "8.00", "1000.0", "75%"
    ]  # fmt: skip
    (sgd,) = [line for line in at_10[:6] if line.startswith("SGD (DDP)")]
    assert sgd.split()[3:] == ["10000.0", "-", "-", "-", "-", "-", "-", "-"]
    assert str(out / "network.json") in printed and str(out / "network.png") in printed

    result = json.loads((out / "network.json").read_text())
    assert result["benchmark"] == "network"
    assert [run["rate"] for run in result["runs"]] == ["10mbit", "100mbit"]
    assert [run["label"] for run in result["runs"]] == ["10 Mbit/s", "100 Mbit/s"]
    assert result["runs"][0]["report"]["launches"][0]["ok"] is True
    assert result["settings"]["rates"] == ["10mbit", "100mbit"]
    assert result["settings"]["network"][1] == {"rate_bit_s": 1e8, "delay_s": 0.0}
    assert [(row["rate"], row["key"]) for row in result["summary"]] == [
        (rate, key) for rate in ("10mbit", "100mbit") for key in ("sgd", "dear", "dkfac_1_1")
    ]
    assert result["summary"][0]["rate_bit_s"] == 1e7
    png = out / "network.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000


def test_network_exits_1_when_a_launch_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load_network(monkeypatch)
    monkeypatch.setattr(bench, "unavailable_reason", lambda: None)

    def failed_run_bench(options: BenchOptions) -> dict[str, Any]:
        return {"launches": [{"nprocs": 2, "ok": False}], "summary": []}

    monkeypatch.setattr(bench, "run_bench", failed_run_bench)
    out = tmp_path / "out"
    assert bench.main(["--quick", "--rates", "30mbit", "--out", str(out)]) == 1
    assert "launches failed at 30mbit" in capsys.readouterr().err
    assert json.loads((out / "network.json").read_text())["runs"][0]["rate"] == "30mbit"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_network_quick_run_writes_json_table_and_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("matplotlib")
    bench = _load_network(monkeypatch)
    out = tmp_path / "out"
    # Two configurations (DDP + SGD, DeAR + SGD) on ResNet-20, one rate.
    argv = ["--quick", "--rates", "1gbit", "--strategies", "dear", "--schedules", "1:1"]
    assert bench.main([*argv, "--warmup", "1", "--iters", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ResNet-20, P=2: median s/iter per link rate" in printed
    assert "ResNet-20 at 1 Gbit/s: ms per iteration by phase" in printed

    result = json.loads((out / "network.json").read_text())
    (run,) = result["runs"]
    assert run["rate"] == "1gbit" and run["link"] == {"rate_bit_s": 1e9, "delay_s": 0.0}
    (launch,) = run["report"]["launches"]
    assert launch["ok"] is True and launch["command"][:3] == ["ip", "netns", "exec"]
    assert run["report"]["settings"]["network"] == run["link"]
    rows = {row["key"]: row for row in result["summary"]}
    assert list(rows) == ["sgd", "dear"]
    assert all(row["rate"] == "1gbit" and row["median_s"] > 0 for row in rows.values())
    assert rows["dear"]["bytes_per_step"]["grad"] > 0
    png = out / "network.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000


@pytest.mark.slow
def test_gpu_overhead_quick_run_on_the_cpu_writes_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gpu_overhead.py end to end where there is no GPU (kfac-pytorch absent:
    reported as not measured), so the script the GPU sessions run cannot rot unseen."""
    bench = load_benchmark("gpu_overhead", monkeypatch)
    monkeypatch.setattr(bench, "kfac_pytorch_version", lambda: None)
    argv = ["--device", "cpu", "--quick", "--models", "resnet32", "--batch-size", "4"]
    assert bench.main([*argv, "--out", str(tmp_path), "--eigh-probe", "1"]) == 0
    report = json.loads((tmp_path / "gpu_overhead.json").read_text())
    assert report["kfac_pytorch"].startswith("not measured")
    entry = report["models"]["resnet32"]
    assert list(entry["summary"]) == [
        "sgd",
        *(
            f"{label}_{method}_{schedule}"
            for label in ("dkfac", "dkfac-bf16")
            for schedule in ("1_1", "10_100")
            for method in ("eigen", "inverse", "cholesky")
        ),
    ]
    assert all(row["median_s"] > 0 for row in entry["summary"].values())
    assert entry["verdicts"]["every_step_eigen"]["met"] is None  # no kfac-pytorch to compare
    assert entry["verdicts"]["amortised_inverse_bf16"]["target_pct"] == 10.0
    assert entry["eigh_probe"]["factors"] == 2 * 34  # ResNet-32: 33 convolutions and the head


@pytest.mark.slow
def test_gpu_overhead_runs_named_variants_in_channels_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--variant`` adds dkfac rows with more keywords (passed to the preconditioner) and
    ``--channels-last`` runs every row, SGD's too, in that format; a bad label is refused."""
    bench = load_benchmark("gpu_overhead", monkeypatch)
    monkeypatch.setattr(bench, "kfac_pytorch_version", lambda: None)
    seen: list[dict[str, object]] = []
    real = bench.dkfac.KFACPreconditioner

    def spy(model: nn.Module, **kwargs: object) -> object:
        first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        assert first.weight.is_contiguous(memory_format=torch.channels_last)
        seen.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(bench.dkfac, "KFACPreconditioner", spy)
    variant = 'dkfac-half={"statistics_fraction": 0.5, "precondition_precision": "bf16"}'
    argv = ["--device", "cpu", "--quick", "--models", "resnet32", "--batch-size", "4"]
    configs = "dkfac-half_inverse_10_100,dkfac_inverse_10_100"
    more = ["--channels-last", "--variant", variant, "--configs", configs, "--out", str(tmp_path)]
    assert bench.main([*argv, *more]) == 0
    report = json.loads((tmp_path / "gpu_overhead.json").read_text())
    assert report["channels_last"] is True
    assert report["variants"]["dkfac-half"] == {
        "statistics_fraction": 0.5,
        "precondition_precision": "bf16",
    }
    entry = report["models"]["resnet32"]
    assert list(entry["summary"]) == ["sgd", "dkfac_inverse_10_100", "dkfac-half_inverse_10_100"]
    assert entry["verdicts"]["amortised_inverse_half"]["target_pct"] == 10.0
    assert [k.get("statistics_fraction") for k in seen] == [None, 0.5]
    assert seen[1]["precondition_precision"] == "bf16"
    with pytest.raises(SystemExit):
        bench.parse_args(["--variant", "half={}"])


@pytest.mark.slow
def test_gpu_breakdown_quick_run_on_the_cpu_times_steps_and_decompositions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gpu_breakdown.py end to end on the CPU: step kinds, profiler tables, every
    decomposition variant (the host-CPU eigh only exists on a GPU machine)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("gpu_breakdown", monkeypatch)
    monkeypatch.setattr(bench, "kfac_pytorch_version", lambda: None)
    argv = ["--device", "cpu", "--quick", "--models", "resnet32", "--methods", "inverse"]
    options = ["--options", '{"statistics_precision": "bf16"}', "--channels-last"]
    assert bench.main([*argv, *options, "--steps", "112", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_breakdown.json").read_text())
    assert report["options"] == {"statistics_precision": "bf16"} and report["channels_last"]
    entry = report["models"]["resnet32"]
    steps = entry["steps_inverse"]
    assert steps["counted"] == {"plain": 9, "factors": 0, "decomposition": 0}  # 101 profiled
    assert steps["step_s"]["plain"] > 0 and steps["sgd_step_s"] > 0
    assert set(entry["decompositions_s"]) == {
        *(
            f"{kind}_{how}"
            for kind in ("eigh", "cholesky_inverse", "cholesky_factor", "inv_ex")
            for how in ("one_at_a_time", "batched_by_size")
        ),
        "triangular_solve_and_product_one_at_a_time",
    }
    assert len(entry["factor_sizes"]) == 2 * 34
    by_size = entry["cholesky_inverse_by_size"]
    sizes = entry["factor_sizes"]
    assert {int(d) for d in by_size} == {d for d in set(sizes) if sizes.count(d) > 1}
    assert all(row["count"] == sizes.count(int(d)) for d, row in by_size.items())
    assert all(row["one_at_a_time_s"] > 0 and row["batched_s"] > 0 for row in by_size.values())
    for kind in ("plain", "factors", "decomposition"):
        assert "Name" in (tmp_path / f"resnet32_inverse_{kind}.txt").read_text()


def test_step_launches_counts_the_products_of_each_kind_of_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/step_launches.py on the CPU: a plain step of ResNet-32's 34 layers makes two
    products per layer one at a time (oracle: 2 · 34 ``mm``), and fewer, batched, operator
    calls when equal shapes are stacked; the factor step's pass adds the statistics."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("step_launches", monkeypatch)
    out = tmp_path / "launches.json"
    argv = ["--device", "cpu", "--model", "resnet32", "--batch", "4", "--out", str(out)]
    variants = ["--variant", 'alone={"batched_preconditioning": false}']
    variants += ["--variant", 'batched={"batched_preconditioning": true}']
    assert bench.main([*argv, *variants]) == 0
    report = json.loads(out.read_text())
    alone, batched = report["variants"]["alone"], report["variants"]["batched"]
    assert alone["plain"]["kfac_step"]["top"]["mm"] == 2 * 34
    assert "bmm" in batched["plain"]["kfac_step"]["top"]
    assert batched["plain"]["kfac_step"]["ops"] < alone["plain"]["kfac_step"]["ops"]
    sgd_pass = report["sgd"]["forward_backward"]["ops"]
    assert alone["plain"]["forward_backward"]["ops"] == sgd_pass  # no capture on plain steps
    assert alone["factors"]["forward_backward"]["ops"] > sgd_pass


def test_pixel_grams_times_every_statistic_shape_of_a_pass_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/pixel_grams.py on the CPU: ResNet-32 has no unpadded 1x1 convolution, so its
    pixel Grams are the output gradients of its convolutions, one per Conv2d module (oracle:
    the module count); each shape is timed both ways in both precisions."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("pixel_grams", monkeypatch)
    out = tmp_path / "grams.json"
    argv = ["--device", "cpu", "--model", "resnet32", "--batch", "2", "--repeats", "1"]
    assert bench.main([*argv, "--out", str(out)], emit=lambda _: None) == 0
    report = json.loads(out.read_text())
    convs = sum(
        isinstance(m, torch.nn.Conv2d)
        for m in importlib.import_module("gpu_overhead").MODELS["resnet32"].build(10).modules()
    )
    assert sum(row["count"] for row in report["shapes"]) == convs
    assert {tuple(row["shape"][1:]) for row in report["shapes"]} == {
        (16, 32, 32),
        (32, 16, 16),
        (64, 8, 8),
    }
    for row in report["shapes"]:
        assert row["per_example_by_default"] == (row["shape"][1] < 64)
        assert all(
            row[p][path] > 0 for p in ("highest", "bf16") for path in ("copy", "per-example")
        )
    assert report["complete"] is True


def test_pixel_grams_keeps_the_shapes_it_measured_when_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device box may end the run: the JSON holds every shape measured before, marked
    incomplete (the GPU check had lost all of them)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("pixel_grams", monkeypatch)
    real, calls = bench.time_shape, []

    def cut_after_one_shape(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        if len({*calls}) > 1:
            raise KeyboardInterrupt  # what a box's signal looks like to the script
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "time_shape", cut_after_one_shape)
    out = tmp_path / "grams.json"
    argv = ["--device", "cpu", "--model", "resnet32", "--batch", "2", "--repeats", "1"]
    with pytest.raises(KeyboardInterrupt):
        bench.main([*argv, "--out", str(out)], emit=lambda _: None)
    report = json.loads(out.read_text())
    assert report["complete"] is False and len(report["shapes"]) == 1
    assert report["shapes"][0]["shape"] == list(calls[0])
    assert report["totals_ms"]["highest"]["copy"] > 0


def test_patch_grams_times_every_group_of_a_pass_every_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/patch_grams.py on the CPU, ResNet-32 on 8x8 images: its groups are the stride-1
    3x3 convolutions of one input shape (oracle: the modules, counted by their own settings and
    the stage each sits in), im2col by default on the last stages' 4x4 and 2x2 images (at most
    49 positions), each group timed every way in both precisions."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("patch_grams", monkeypatch)
    out = tmp_path / "grams.json"
    argv = ["--device", "cpu", "--model", "resnet32", "--batch", "2", "--image-size", "8"]
    assert bench.main([*argv, "--repeats", "1", "--out", str(out)], emit=lambda _: None) == 0
    report = json.loads(out.read_text())
    stride_1 = Counter(
        m.in_channels
        for m in importlib.import_module("gpu_overhead").MODELS["resnet32"].build(10).modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) and m.stride == (1, 1)
    )
    size = {3: 8, 16: 8, 32: 4, 64: 2}  # each width's image: the stages halve it
    assert {(tuple(row["shape"]), row["layers"]) for row in report["groups"]} == {
        ((2, channels, size[channels], size[channels]), count)
        for channels, count in stride_1.items()
    }
    ways = ("shifted", "chunks", "im2col")
    for row in report["groups"]:
        assert row["default_im2col"] == (row["shape"][2] <= 4)
        assert row["chunks"] == 1  # a CPU does not cut rows
        assert all(row[p][way] > 0 for p in ("highest", "bf16") for way in ways)
    assert report["complete"] is True


def test_gram_blocks_times_every_wide_statistic_gram_forms_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gram_blocks.py on the CPU, ResNet-32 on 8x8 images, batch 96: its shapes are
    the statistics at least 256 columns wide that ``gram`` forms there (oracle: the modules'
    own settings: the patches of the 3x3 convolutions of 32 and 64 input channels, 288 and
    576 columns, that take im2col: the strided one, and those whose output has at most 49
    positions, the last stages' 4x4 and 2x2; the others take shifted products), 96·4·4 = 1536
    or 96·2·2 = 384 rows each, so in blocks by default, each timed both ways in both
    precisions."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("gram_blocks", monkeypatch)
    out = tmp_path / "blocks.json"
    argv = ["--device", "cpu", "--model", "resnet32", "--batch", "96", "--image-size", "8"]
    assert bench.main([*argv, "--repeats", "1", "--out", str(out)], emit=lambda _: None) == 0
    report = json.loads(out.read_text())
    want: Counter[tuple[int, int]] = Counter()
    size = {16: 8, 32: 4, 64: 2}  # each width's output image
    for m in importlib.import_module("gpu_overhead").MODELS["resnet32"].build(10).modules():
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) and m.in_channels >= 32:
            im2col = m.stride != (1, 1) or size[m.out_channels] ** 2 <= 49
            if im2col:
                want[(96 * size[m.out_channels] ** 2, m.in_channels * 9)] += 1
    assert {(r["rows"], r["columns"]): r["layers"] for r in report["shapes"]} == dict(want)
    assert all(r["stack"] == 1 for r in report["shapes"])  # no per-example products here
    assert {r["columns"] for r in report["shapes"]} == {288, 576}
    for row in report["shapes"]:
        assert row["default_blocks"] and row["rows"] in (384, 1536)
        assert all(row[p][way] > 0 for p in ("highest", "bf16") for way in bench.WAYS)
    assert report["complete"] is True


def test_host_time_thins_the_model_and_times_every_kind_of_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/host_time.py: the thinned model keeps every layer (kinds, kernels, strides)
    with its channels divided, and the amortised time weighs the step kinds' medians by a
    (10, 100) schedule's shares (oracle: 0.9, 0.09 and 0.01 of the three sums)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("host_time", monkeypatch)
    model = bench.MODELS["resnet32"].build(10)
    thin = bench.thinned(bench.MODELS["resnet32"].build(10), 8)
    pairs = list(zip(model.modules(), thin.modules(), strict=True))
    assert all(type(a) is type(b) for a, b in pairs)
    for wide, narrow in pairs:
        if isinstance(wide, torch.nn.Conv2d):
            assert (narrow.kernel_size, narrow.stride, narrow.padding) == (
                wide.kernel_size,
                wide.stride,
                wide.padding,
            )
            assert narrow.out_channels == wide.out_channels // 8
    calls: list[tuple[int, int]] = []  # (step, run) in the order taken
    iteration = bench.TimedRun.iteration

    def recorded(run: Any, step: int, recorded: bool) -> None:
        calls.append((step, id(run)))
        iteration(run, step, recorded)

    monkeypatch.setattr(bench.TimedRun, "iteration", recorded)
    out = tmp_path / "host.json"
    argv = ["--models", "resnet32", "--steps", "100", "--gpu-paths", "--rounds", "2"]
    argv += ["--variant", "dkfac={}", "--variant", 'hooks={"batched_statistics": false}']
    assert bench.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["models"]["resnet32"]
    # Two rounds, each timing every run; each cell their median (here: the mean).
    assert [list(timed) for timed in result["rounds"]] == [["sgd", "dkfac", "hooks"]] * 2
    # Interleaved: each round's three runs take step s before any takes s + 1, 200 steps
    # each (the warm-up window, then the timed ones); from one step of a kind to the next of
    # that kind (plain, factors, decomposition) the order rotates.
    first_round = calls[: 3 * 200]
    assert [step for step, _ in first_round] == [s for s in range(200) for _ in range(3)]
    order = [[run for _, run in first_round[3 * s : 3 * s + 3]] for s in range(200)]
    assert len(set(order[0])) == 3
    for kind in ("plain", "factors", "decomposition"):
        steps = [s for s in range(200) if bench.kind_of(s) == kind]
        for earlier, later in itertools.pairwise(steps):
            assert order[later] == order[earlier][1:] + order[earlier][:1], (kind, later)
    first, second = (timed["dkfac"]["plain"]["kfac_step"] for timed in result["rounds"])
    assert result["variants"]["dkfac"]["plain"]["kfac_step"] == pytest.approx((first + second) / 2)
    kinds = result["variants"]["dkfac"]
    assert set(kinds) == {"plain", "factors", "decomposition"}
    sums = {kind: sum(parts.values()) for kind, parts in kinds.items()}
    expected = 0.9 * sums["plain"] + 0.09 * sums["factors"] + 0.01 * sums["decomposition"]
    assert result["amortised_ms"]["dkfac"] == pytest.approx(expected)
    assert result["amortised_ms"]["sgd"] == pytest.approx(sum(result["sgd"]["plain"].values()))


def test_host_time_takes_the_graph_path_without_replaying_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--graphs-without-replay``: a ``plain_step_graphs`` variant captures once per
    decomposition interval and its other plain steps replay (nothing); without the flag such
    a variant is refused on the CPU, as the library refuses it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("host_time", monkeypatch)
    import dkfac.preconditioner

    graphs = dkfac.preconditioner.CudaGraphs
    argv = ["--models", "resnet32", "--steps", "100", "--gpu-paths"]
    argv += ["--variant", 'graphs={"plain_step_graphs": true}']
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        bench.main(argv)
    replays: list[int] = []
    capture = bench.ReplayLaunchingNothing.capture

    def counted(self: Any, compute: Any, device: torch.device) -> Any:
        outputs, replay = capture(self, compute, device)

        def replayed() -> None:
            replays.append(1)
            replay()

        return outputs, replayed

    monkeypatch.setattr(bench.ReplayLaunchingNothing, "capture", counted)
    out = tmp_path / "host.json"
    assert bench.main([*argv, "--graphs-without-replay", "--out", str(out)]) == 0
    assert dkfac.preconditioner.CudaGraphs is graphs  # replaced only while timing
    result = json.loads(out.read_text())["models"]["resnet32"]
    assert set(result["variants"]["graphs"]) == {"plain", "factors", "decomposition"}
    # 200 steps, decompositions at 0 and 100 (eager), captured at 1 and 101 (and replayed
    # there), every other step replayed.
    assert len(replays) == 198
