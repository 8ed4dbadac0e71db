"""``dkfac bench``: a minimal end-to-end run (JSON, PNG, table), every bad input, the
configurations (DeAR + SGD among them) and models (the Transformer LM among them), and the
spd/pad vs dkfac target on hand-made rows."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dkfac
from dkfac.bench import emulated_cluster
from dkfac.bench.command import run_bench
from dkfac.bench.configs import (
    DEAR_AUTO_RANGE_MB,
    DEAR_SGD,
    INPUT_SHAPES,
    MODEL_LABELS,
    MODELS,
    NUM_CLASSES,
    PHASES,
    SGD,
    STRATEGIES,
    STRATEGY_CHOICES,
    TOKEN_VOCABULARIES,
    Configuration,
    configurations,
    environment,
    git_commit,
    mlp6,
    source_digest,
)
from dkfac.bench.models import LM_SEQ_LEN, LM_VOCAB, batch_loss, model_batch
from dkfac.bench.options import BenchOptions, options_from_args
from dkfac.bench.report import format_table, write_chart
from dkfac.bench.targets import PipelinedTarget, load_targets
from dkfac.bench.verdicts import evaluate_pipelined_target, format_pipelined_target
from dkfac.bench.window_reduction import reduce_window, summarize
from dkfac.bench.worker import make_batch
from dkfac.cli.config import ConfigError
from dkfac.cli.main import main
from dkfac.cli.parser import BENCH_MODELS, BENCH_NPROCS, build_parser
from dkfac.dear.bucket_search import power_of_two_sizes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TARGETS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "targets.json"
PIPELINED = load_targets(TARGETS_FILE).pipelined_target


def _torchrun_available() -> bool:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    return importlib.util.find_spec("torch.distributed.run") is not None


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not _torchrun_available(), reason="needs torchrun and gloo")
def test_bench_quick_writes_json_chart_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--rounds", "1", "--warmup", "1", "--iters", "1"]
    argv += ["--targets", str(TARGETS_FILE)]
    assert main([*argv, "--iters-long", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "amort s/it" in printed and "kfac-pytorch 0.4.2 on this machine class" in printed
    assert "target spd/pad vs dkfac (P=4, (1,1)" in printed
    assert "not evaluated (P=4 was not run)" in printed
    assert str(out / "bench.json") in printed and str(out / "bench.png") in printed

    report = json.loads((out / "bench.json").read_text())
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
    assert report["targets_file"] == str(TARGETS_FILE)
    assert report["settings"]["models"] == ["resnet20"]
    assert report["settings"]["nprocs"] == [2]
    assert report["settings"]["strategies"] == ["dkfac", "kaisa", "spd", "pad", "dp"]
    assert report["settings"]["input_shapes"] == {"resnet20": [3, 32, 32]}
    (launch,) = report["launches"]
    assert launch["ok"] is True
    # The workers run from the package, not from the benchmarks/ folder.
    assert launch["command"][5:7] == ["-m", "dkfac.bench.worker"]
    keys = ["sgd"]
    for schedule in ("1_1", "10_100"):
        keys += [f"{s}_{schedule}" for s in ("dkfac", "kaisa_1of2", "spd", "pad", "dp")]
    assert [row["key"] for row in report["summary"]] == keys
    for row in report["summary"]:
        assert {"model", "nprocs", "label", "strategy", "amortized_s", "median_s"} <= row.keys()
        assert row["model"] == "resnet20" and row["nprocs"] == 2
        assert row["amortized_s"] > 0
        if row["key"] == "sgd":
            assert row["overhead_s"] is None
        else:
            assert set(PHASES) <= row["phase_s"].keys()
            assert math.isfinite(row["overhead_s"])
    assert isinstance(report["target"]["met"], bool)
    pipelined = report["pipelined_target"]
    assert pipelined["evaluated"] is False and pipelined["met"] is None
    assert pipelined["reason"] == "P=4 was not run"

    png = out / "bench.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not _torchrun_available(), reason="needs torchrun and gloo")
def test_bench_times_the_transformer_lm_and_dear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--models", "transformer", "--strategies", "dear,dkfac,dkfac+dear"]
    argv += ["--schedules", "1:1", "--batch-size", "4", "--warmup", "1", "--iters", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Transformer LM (4x256); P in 2" in printed and "SGD (DeAR)" in printed

    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["token_vocabularies"] == {"transformer": 256}
    rows = {row["key"]: row for row in report["summary"]}
    assert list(rows) == ["sgd", "dear", "dkfac_1_1", "dkfac_dear_1_1"]
    dear = rows["dear"]
    assert dear["gradient_sync"] == "dear" and dear["strategy"] is None
    assert math.isfinite(dear["overhead_s"]) and math.isfinite(dear["overhead_pct"])
    assert dear["phase_s"]["grad_comm"] == pytest.approx(
        dear["phase_s"]["grad_reduce_scatter"] + dear["phase_s"]["grad_all_gather"]
    )
    # Reduce-scatter and all-gather each move every gradient once (13.2 MB in float32).
    gradient_bytes = 4 * sum(p.numel() for p in MODELS["transformer"]().parameters())
    assert dear["bytes_per_step"]["grad"] == pytest.approx(2 * gradient_bytes, rel=0.01)
    (window,) = [
        r["windows"]["transformer"]["dear"] for r in report["launches"][0]["report"]["rounds"]
    ]
    assert window["warmup"] > 1  # the bucket size search ran inside the warm-up
    low, high = DEAR_AUTO_RANGE_MB  # the size kept is a power-of-two size of the range
    assert dear["dear_bucket_cap_mb"][0] in power_of_two_sizes(low, high)
    assert rows["dkfac_1_1"]["bytes_per_step"]["factor"] > 0
    # K-FAC with DeAR: its factors, and DeAR's two halves for the gradients it gathers.
    both = rows["dkfac_dear_1_1"]
    assert (both["strategy"], both["gradient_sync"]) == ("dkfac", "dear")
    assert both["bytes_per_step"]["factor"] == rows["dkfac_1_1"]["bytes_per_step"]["factor"]
    assert both["bytes_per_step"]["grad"] >= 2 * gradient_bytes * 0.99
    assert both["dear_bucket_cap_mb"][0] in power_of_two_sizes(low, high)
    for row in rows.values():
        assert row["median_s"] > 0
    windows = report["launches"][0]["report"]["rounds"][0]["windows"]["transformer"]
    assert all(math.isfinite(w["final_loss"]) for w in windows.values())


def test_bench_on_a_machine_without_namespaces_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = "cannot create network namespaces (needs root or CAP_NET_ADMIN): denied"
    monkeypatch.setattr(emulated_cluster, "unavailable_reason", lambda: reason)
    code = main(["bench", "--quick", "--network", "100mbit", "--out", str(tmp_path / "b")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"dkfac: error: --network: {reason}"]


def test_bench_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.out == str(Path("runs") / "bench")
    options = options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
    assert options.models == ("resnet20",)
    assert options.nprocs == (2,)
    assert options.strategies == ("dkfac", "kaisa", "spd", "pad", "dp")
    assert options.schedules == ((1, 1), (10, 100))
    assert (options.rounds, options.iters, options.iters_long) == (2, 10, 100)
    assert options.targets is None  # measurements only unless --targets names a file


def test_bench_selects_strategies_and_schedules() -> None:
    argv = ["bench", "--strategies", "kaisa", "--schedules", "1:1", "--nprocs", "2,4"]
    options = options_from_args(
        build_parser().parse_args(argv), models=BENCH_MODELS, nprocs=BENCH_NPROCS
    )
    assert options.strategies == ("kaisa",)
    assert options.schedules == ((1, 1),)
    assert options.nprocs == (2, 4)
    worker_argv = options.worker_argv(Path("x.json"))
    assert worker_argv[worker_argv.index("--strategies") + 1] == "kaisa"
    assert worker_argv[worker_argv.index("--schedules") + 1] == "1:1"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--models", "resnet99"], "--models"),
        (["--models", "mlp7"], "--models"),
        (["--nprocs", "0"], "--nprocs"),
        (["--nprocs", "2,-1"], "--nprocs"),
        (["--nprocs", "two"], "--nprocs"),
        (["--strategies", "adam"], "--strategies"),
        (["--strategies", "dkfac,sgdx"], "--strategies"),
        (["--strategies", "ddp"], "--strategies"),
        (["--models", "transformer_lm"], "--models"),
        (["--schedules", "10:15"], "--schedules"),
        (["--schedules", "ten"], "--schedules"),
        (["--iters", "0"], "--iters"),
        *([(["--device", "cuda"], "--device cuda")] if not torch.cuda.is_available() else []),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(
    option: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if option[0] != "--device":  # as on a one-GPU machine, where --device auto logs its choice
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = main(["bench", "--quick", *option, "--out", str(tmp_path / "bench")])
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dkfac: error: ") and message in lines[0]
    assert not (tmp_path / "bench").exists()  # refused before anything is launched or written


@pytest.mark.parametrize(
    ("device", "gpus", "expected"),
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda"),  # a GPU per worker of the largest world size (2, 4: 4 needed)
        ("auto", 4, "cuda"),
        ("cpu", 4, "cpu"),
        ("cuda", 4, "cuda"),
    ],
)
def test_bench_runs_every_world_size_on_one_device(
    device: str, gpus: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    nprocs = "2" if gpus == 2 else "2,4"
    argv = ["bench", "--device", device, "--nprocs", nprocs]
    options = options_from_args(
        build_parser().parse_args(argv), models=BENCH_MODELS, nprocs=BENCH_NPROCS
    )
    assert options.device == expected
    worker_argv = options.worker_argv(Path("x.json"))
    assert worker_argv[worker_argv.index("--device") + 1] == expected
    assert options.settings()["backend"] == ("cpu:gloo,cuda:nccl" if expected == "cuda" else "gloo")


def test_an_emulated_cluster_and_a_dry_run_stay_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NCCL between processes of one machine would bypass the shaped link: CPU workers.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    parser = build_parser()
    for extra in (["--network", "50mbit"], ["--layers", "resnet50"]):
        args = parser.parse_args(["bench", *extra])
        options = options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
        assert options.device == "cpu"
        args = parser.parse_args(["bench", "--device", "cuda", *extra])
        with pytest.raises(ConfigError, match="--device cuda is not allowed with --network"):
            options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)


def test_bench_refuses_cuda_with_fewer_gpus_than_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(["bench", "--device", "cuda", "--nprocs", "2,4"])
    with pytest.raises(ConfigError, match=r"4 workers .* 2 GPU\(s\) .*--nprocs 2"):
        options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (no rehearsal)")
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _torchrun_available(), reason="needs torchrun")
def test_bench_times_sgd_and_kfac_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--device", "cuda", "--nprocs", "1", "--models", "resnet20"]
    argv += ["--strategies", "dkfac", "--schedules", "1:1", "--rounds", "1", "--warmup", "1"]
    assert main([*argv, "--iters", "2", "--iters-long", "2", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["device"] == "cuda"
    assert [row["key"] for row in report["summary"]] == ["sgd", "dkfac_1_1"]
    assert all(row["amortized_s"] > 0 for row in report["summary"])


def test_bench_selects_spd_and_pad() -> None:
    argv = ["bench", "--strategies", "pad,spd", "--schedules", "1:1"]
    options = options_from_args(
        build_parser().parse_args(argv), models=BENCH_MODELS, nprocs=BENCH_NPROCS
    )
    assert options.strategies == ("spd", "pad")  # the order of STRATEGIES
    worker_argv = options.worker_argv(Path("x.json"))
    assert worker_argv[worker_argv.index("--strategies") + 1] == "spd,pad"


def test_configurations_include_spd_pad_and_dp() -> None:
    assert STRATEGIES == ("dkfac", "kaisa", "spd", "pad", "dp")
    configs = configurations(4)
    keys = ["sgd"]
    for f, i in ((1, 1), (10, 100)):
        keys += [f"dkfac_{f}_{i}", f"kaisa_1of4_{f}_{i}", f"kaisa_1of2_{f}_{i}"]
        keys += [f"spd_{f}_{i}", f"pad_{f}_{i}", f"dp_{f}_{i}"]
    assert [c.key for c in configs] == keys
    by_key = {c.key: c for c in configs}
    for name in ("spd", "pad", "dp"):
        one, periodic = by_key[f"{name}_1_1"], by_key[f"{name}_10_100"]
        assert (one.label, one.strategy, one.grad_worker_fraction) == (name, name, 1.0)
        assert one.kfac and not one.periodic and one.schedule == "(1,1)"
        assert periodic.periodic and periodic.schedule == "(10,100)"
        assert periodic.to_json()["strategy"] == name
    only = configurations(2, strategies=("pad", "dkfac"), schedules=((1, 1),))
    assert [c.key for c in only] == ["sgd", "dkfac_1_1", "pad_1_1"]


def test_dear_is_one_configuration_after_sgd_without_kfac_or_schedule() -> None:
    with_dears = (*(f"{s}+dear" for s in STRATEGIES), "auto", "auto+dear")
    assert ("dear", *STRATEGIES, *with_dears) == STRATEGY_CHOICES
    configs = configurations(2, strategies=("dkfac", "dear"), schedules=((1, 1), (10, 100)))
    assert [c.key for c in configs] == ["sgd", "dear", "dkfac_1_1", "dkfac_10_100"]
    dear = configs[1]
    assert dear is DEAR_SGD and dear.label == "SGD (DeAR)"
    assert dear.dear and not dear.kfac and not dear.reference and not dear.periodic
    assert SGD.reference and not SGD.dear and not configs[2].reference
    assert dear.schedule == "-"
    assert dear.to_json() == {
        "key": "dear",
        "label": "SGD (DeAR)",
        "strategy": None,
        "grad_worker_fraction": None,
        "grad_worker_fraction_label": None,
        "factor_update_steps": None,
        "inv_update_steps": None,
        "inverse_method": None,
        "gradient_sync": "dear",
    }
    assert configs[2].to_json()["gradient_sync"] == SGD.to_json()["gradient_sync"] == "ddp"
    assert [c.key for c in configurations(4, strategies=("dear",))] == ["sgd", "dear"]
    # A K-FAC strategy with DeAR averaging its gradients (KAISA at 1/P), after the DDP ones;
    # its key is its DDP row's (KAISA's fraction included) with _dear before the schedule.
    with_dear = configurations(4, ("kaisa", "kaisa+dear", "pad+dear"), schedules=((1, 1),))
    assert [
        (c.key, c.label, c.strategy, c.grad_worker_fraction, c.gradient_sync)
        for c in with_dear[-2:]
    ] == [
        ("kaisa_1of4_dear_1_1", "kaisa f=1/4 + DeAR", "kaisa", 0.25, "dear"),
        ("pad_dear_1_1", "pad + DeAR", "pad", 1.0, "dear"),
    ]
    assert with_dear[1].key == "kaisa_1of4_1_1"  # the same KAISA row with DDP
    assert with_dear[-1].kfac and with_dear[-1].dear and not with_dear[-1].reference
    # strategy=auto choosing for DeAR's averaging: last, after auto with DDP.
    autos = configurations(2, ("auto+dear", "auto"), schedules=((10, 100),))[1:]
    assert [(c.key, c.label, c.strategy, c.gradient_sync) for c in autos] == [
        ("auto_10_100", "auto", "auto", "ddp"),
        ("auto_dear_10_100", "auto + DeAR", "auto", "dear"),
    ]
    for name in ("dkfac+dear", "auto+dear"):
        with pytest.raises(ConfigError, match="a dry run"):
            options_from_args(
                build_parser().parse_args(["bench", "--layers", "resnet50", "--strategies", name]),
                models=BENCH_MODELS,
                nprocs=BENCH_NPROCS,
            )


def test_bench_takes_dear_among_the_strategies() -> None:
    argv = ["bench", "--strategies", "kaisa,dear", "--models", "transformer,resnet32"]
    options = options_from_args(
        build_parser().parse_args(argv), models=BENCH_MODELS, nprocs=BENCH_NPROCS
    )
    assert options.strategies == ("dear", "kaisa")  # the order of STRATEGY_CHOICES
    assert options.models == ("transformer", "resnet32")
    worker_argv = options.worker_argv(Path("x.json"))
    assert worker_argv[worker_argv.index("--strategies") + 1] == "dear,kaisa"
    settings = json.loads(json.dumps(options.settings()))
    assert settings["input_shapes"] == {"transformer": [64], "resnet32": [3, 32, 32]}
    assert settings["token_vocabularies"] == {"transformer": 256}
    assert settings["dear"] == {
        "bucket_cap_mb": "auto",
        "auto_range_mb": [1 / 16, 64.0],  # DeAR's default
        "auto_trial_steps": 5,
    }
    default = options_from_args(
        build_parser().parse_args(["bench"]), models=BENCH_MODELS, nprocs=BENCH_NPROCS
    )
    assert default.settings()["dear"] is None and "dear" not in default.strategies
    # K-FAC rows with DeAR run it with the same options: recorded without the dear row too.
    kfac_only = options_from_args(
        build_parser().parse_args(["bench", "--strategies", "dkfac,kaisa+dear"]),
        models=BENCH_MODELS,
        nprocs=BENCH_NPROCS,
    )
    assert kfac_only.settings()["dear"] == options.settings()["dear"]


def test_a_dry_run_counts_the_kfac_strategies_only() -> None:
    argv = ["bench", "--layers", "resnet50", "--strategies", "dear"]
    with pytest.raises(ConfigError, match=r"a dry run \(--layers\) counts K-FAC strategies only"):
        options_from_args(build_parser().parse_args(argv), models=BENCH_MODELS, nprocs="2")
    argv = ["bench", "--layers", "resnet50", "--strategies", "dear,dp", "--nprocs", "4"]
    options = options_from_args(build_parser().parse_args(argv), models=BENCH_MODELS, nprocs="2")
    report = run_bench(options)
    assert report["settings"]["strategies"] == ["dp"]


def _raw_window(seconds: float, phases: dict[str, float], sent: dict[str, int]) -> dict[str, Any]:
    """One rank's raw window as time_window returns it (two iterations)."""
    return {
        "wall_s": 2 * seconds,
        "iter_s": [seconds, seconds],
        "phase_s": phases,
        "bytes_per_step": sent,
        "calls_per_step": {key: 1.0 for key in sent},
        "factor_bytes": 0,
        "inverse_bytes": 0,
        "final_loss": 2.0,
        "warmup_steps": 7,
        "cost_model": None,
        "fusion_buckets": 0,
        "dear_bucket_cap_mb": 2.0,
        "dear_tuning": [[1.0, 0.5], [2.0, 0.25]],
    }


def test_dear_windows_report_its_waits_bytes_and_a_negative_overhead_when_faster() -> None:
    # Exact binary fractions: every difference below is exact.
    waits = {"grad_reduce_scatter": 0.125, "grad_all_gather": 0.0625, "update": 0.03125}
    dear_phases = waits | {"buffer_broadcast": 0.0, "grad_comm": 0.1875}
    sent = {"grad_reduce_scatter/reduce_scatter": 1000, "grad_all_gather/all_gather": 1000}
    sent_with_buffers = sent | {"buffer_broadcast/broadcast": 24}
    sgd = reduce_window(SGD, [_raw_window(1.0, {}, {})] * 2, warmup=3, iters=2)
    dear = reduce_window(
        DEAR_SGD,
        [_raw_window(0.75, dear_phases, sent), _raw_window(0.5, dear_phases, sent_with_buffers)],
        warmup=3,
        iters=2,
    )
    assert "phase_s" not in sgd and "kfac_memory_bytes" not in dear
    assert dear["warmup"] == 7 and dear["median_s"] == 0.75  # the slowest rank
    assert dear["dear_bucket_cap_mb"] == 2.0
    assert list(dear["phase_s"]) == [
        "grad_comm",
        "buffer_broadcast",
        "grad_all_gather",
        "grad_reduce_scatter",
        "update",
    ]
    assert dear["phase_s"]["grad_comm"] == 0.1875
    assert dear["bytes_per_step"] == {
        "total": 2012.0,
        "factor": 0.0,
        "inverse": 0.0,
        "grad": 2000.0,
        "other": 12.0,
    }
    rounds = [{"windows": {"resnet20": {"sgd": sgd, "dear": dear}}}]
    summary = summarize(["resnet20"], [SGD, DEAR_SGD], rounds)["resnet20"]
    assert summary["sgd"]["overhead_s"] is None
    entry = summary["dear"]
    assert entry["overhead_s"] == -0.25 and entry["overhead_pct"] == -25.0  # faster
    assert entry["phase_s"]["grad_comm"] == 0.1875
    assert entry["bytes_per_step"]["grad"] == 2000.0
    assert entry["dear_bucket_cap_mb"] == [2.0]
    assert "kfac_memory_bytes" not in entry and "whole_inverse_periods" not in entry
    json.dumps(summary)

    rows = [{"model": "transformer", "nprocs": 2, "key": k, **v} for k, v in summary.items()]
    table = format_table(rows)
    (line,) = [line for line in table.splitlines() if line.startswith("transformer  2 SGD (DeAR)")]
    cells = ["-", "0.7500", "0.7500", "-0.2500", "-25.0%", "-", "-", "187.5", "-", "-", "-"]
    assert line.split()[4:] == [*cells, "0.00", "-"]  # no K-FAC phases, no K-FAC memory
    assert "g_comm = its exposed reduce-scatter and all-gather waits" in table
    assert "SGD (DeAR): " not in format_table(rows[:1])


def test_the_summary_keeps_one_rounds_whole_overlap_split() -> None:
    # Three rounds whose parts have different medians (in flight 1, 2, 4 s; exposed 0.5, 1.5,
    # 0.25 s): the summary takes the median round's split whole, so hidden / in flight is
    # that round's 25%, not a ratio of medians taken from different rounds.
    dkfac = Configuration("dkfac_1_1", "dkfac", "dkfac")
    sgd = reduce_window(SGD, [_raw_window(1.0, {}, {})] * 2, warmup=3, iters=2)
    rounds = []
    for flight, exposed in ((1.0, 0.5), (2.0, 1.5), (4.0, 0.25)):
        raw = _raw_window(2.0, {"factor_comm": exposed}, {"factor_comm/allreduce": 8})
        split = {"in_flight_s": flight, "exposed_s": exposed, "hidden_s": flight - exposed}
        raw["overlap_s"] = {"factor_comm": split}
        window = reduce_window(dkfac, [raw, raw], warmup=3, iters=2)
        assert window["overlap_s"] == {"factor_comm": split}  # both ranks alike: their mean
        rounds.append({"windows": {"resnet20": {"sgd": sgd, "dkfac_1_1": window}}})
    entry = summarize(["resnet20"], [SGD, dkfac], rounds)["resnet20"]["dkfac_1_1"]
    assert entry["overlap_s"] == {
        "factor_comm": {"in_flight_s": 2.0, "exposed_s": 1.5, "hidden_s": 0.5}
    }


def test_the_chart_marks_only_ddp_sgd_as_the_reference(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    base = {"model": "resnet20", "nprocs": 2, "strategy": None, "phase_s": {}}
    rows = [
        base | {"key": "sgd", "label": "SGD (DDP)", "amortized_s": 1.0, "overhead_pct": None},
        base
        | {
            "key": "dear",
            "label": "SGD (DeAR)",
            "amortized_s": 0.75,
            "overhead_pct": -25.0,
            "phase_s": {"grad_comm": 0.125},
        },
    ]
    path = write_chart(rows, tmp_path / "bench.png")
    assert path is not None and path.read_bytes()[:8] == PNG_MAGIC


def test_every_model_has_an_input_shape_and_a_label() -> None:
    assert set(MODELS) == set(INPUT_SHAPES) == set(MODEL_LABELS)
    assert list(MODELS) == ["resnet20", "resnet32", "mlp6", "transformer"]
    assert MODEL_LABELS["mlp6"] == "MLP-6 (1024 wide)"
    assert INPUT_SHAPES["resnet32"] == (3, 32, 32) and INPUT_SHAPES["mlp6"] == (1024,)
    assert INPUT_SHAPES["transformer"] == (64,) and TOKEN_VOCABULARIES == {"transformer": 256}


def test_the_transformer_lm_has_factors_of_the_asked_widths_and_takes_a_token_batch() -> None:
    torch.manual_seed(0)
    net = MODELS["transformer"](num_classes=NUM_CLASSES)  # built as every model; no classes
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    block = [(256, 256)] * 4 + [(256, 1024), (1024, 256)]
    assert [(m.in_features, m.out_features) for m in linears] == block * 4 + [(256, LM_VOCAB)]

    x, y = model_batch("transformer", 3, 1007)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, LM_SEQ_LEN)
    assert int(x.min()) >= 0 and int(x.max()) < LM_VOCAB
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the next tokens
    assert torch.equal(x, model_batch("transformer", 3, 1007)[0])  # drawn from the seed
    with torch.no_grad():
        logits = net(x)
    assert logits.shape == (3, LM_SEQ_LEN, LM_VOCAB)
    # Near-uniform predictions at initialisation: about log(vocabulary) per token.
    assert abs(float(batch_loss(logits, y)) - math.log(LM_VOCAB)) < 0.5
    pre = dkfac.KFACPreconditioner(net, strategy="local")
    try:
        assert len(pre.layers) == 4 * 6 + 1 + 2  # and the token and position embeddings
    finally:
        pre.remove()


def test_batch_loss_is_the_mean_cross_entropy_per_sample_or_per_token() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4,))
    torch.testing.assert_close(
        batch_loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels)
    )
    tokens, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    per_token = [
        torch.nn.functional.cross_entropy(tokens[n, t : t + 1], targets[n, t : t + 1])
        for n in range(2)
        for t in range(5)
    ]
    torch.testing.assert_close(batch_loss(tokens, targets), torch.stack(per_token).mean())


def test_mlp6_builds_and_takes_a_batch_of_its_shape() -> None:
    torch.manual_seed(0)
    net = MODELS["mlp6"](num_classes=NUM_CLASSES)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(1024, 1024)] * 5 + [
        (1024, NUM_CLASSES)
    ]
    assert sum(isinstance(m, nn.ReLU) for m in net.modules()) == 5
    assert [m.out_features for m in mlp6(num_classes=3).modules() if isinstance(m, nn.Linear)][
        -1
    ] == 3

    x, y = make_batch(4, 1000, INPUT_SHAPES["mlp6"])
    assert x.shape == (4, 1024) and y.shape == (4,)
    assert int(y.min()) >= 0 and int(y.max()) < NUM_CLASSES
    with torch.no_grad():
        assert net(x).shape == (4, NUM_CLASSES)
    # K-FAC finds all six layers (no step: eigendecompositions of 1025x1025 are slow).
    pre = dkfac.KFACPreconditioner(net, strategy="local")
    try:
        assert len(pre.layers) == 6
    finally:
        pre.remove()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_environment_records_the_commit_of_the_measured_code(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "module.py").write_text("x = 1\n")
    assert git_commit(package) is None  # not a git checkout
    git("init", "-q")
    assert git_commit(package) is None  # in a checkout, but not tracked (an installed copy)
    git("add", "pkg")
    git("commit", "-q", "-m", "code")
    assert git_commit(package) == git("rev-parse", "HEAD")
    assert environment()["git_commit"] == git_commit()  # dkfac's own source


def test_the_source_digest_names_the_code_whatever_git_says(tmp_path: Path) -> None:
    # Oracle: hashlib over the same (path, contents) sequence, written out here; any change
    # of a file's contents or name changes it, other files do not.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not code")
    expected = hashlib.sha256()
    for name, text in (("a.py", "x = 1\n"), ("sub/b.py", "y = 2\n")):
        expected.update(name.encode() + b"\0" + text.encode() + b"\0")
    first = source_digest(package)
    assert first == expected.hexdigest()
    (package / "notes.txt").write_text("changed")
    assert source_digest(package) == first
    (package / "sub" / "b.py").write_text("y = 3\n")
    assert source_digest(package) != first
    assert environment()["source_sha256"] == source_digest()  # dkfac's own source


def test_make_batch_uses_each_models_shape_and_the_seed() -> None:
    x, y = make_batch(2, 1007, INPUT_SHAPES["resnet20"])
    generator = torch.Generator().manual_seed(1007)
    expected_x = torch.randn(2, 3, 32, 32, generator=generator)
    expected_y = torch.randint(0, NUM_CLASSES, (2,), generator=generator)
    assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    again, _ = make_batch(2, 1007, INPUT_SHAPES["mlp6"])
    assert again.shape == (2, 1024)
    assert torch.equal(again, make_batch(2, 1007, (1024,))[0])


def test_settings_record_the_input_shape_of_every_model() -> None:
    options = BenchOptions(
        models=("resnet20", "mlp6"),
        nprocs=(2, 4),
        rounds=1,
        warmup=0,
        iters=1,
        iters_long=1,
        timeout=1.0,
    )
    settings = json.loads(json.dumps(options.settings()))
    assert "input_shape" not in settings
    assert settings["input_shapes"] == {"resnet20": [3, 32, 32], "mlp6": [1024]}
    assert settings["strategies"] == ["dkfac", "kaisa", "spd", "pad", "dp"]


def _row(
    model: str, nprocs: int, key: str, median_s: float, phase_s: dict[str, float] | None = None
) -> dict[str, Any]:
    """A summary row as summary_rows makes it, with only what the targets read."""
    strategy = None if key == "sgd" else key.split("_")[0]
    return {
        "model": model,
        "nprocs": nprocs,
        "key": key,
        "label": strategy or "SGD (DDP)",
        "strategy": strategy,
        "factor_update_steps": None if strategy is None else int(key.split("_")[-2]),
        "inv_update_steps": None if strategy is None else int(key.split("_")[-1]),
        "amortized_s": median_s,
        "median_s": median_s,
        "phase_s": {name: 0.0 for name in PHASES} | (phase_s or {}),
    }


# Exact binary fractions, so every difference below is exact in floating point.
DKFAC_PHASES = {
    "factor_comm": 0.125,
    "factor_compute": 0.25,
    "inverse_compute": 0.25,
    "inverse_comm": 0.125,
    "precondition": 0.0625,
}
SPD_PHASES = DKFAC_PHASES | {"factor_comm": 0.0625}
PAD_PHASES = DKFAC_PHASES | {"factor_comm": 0.25}


def _pipelined_rows() -> list[dict[str, Any]]:
    return [
        # P=2 is not part of the target: a slow spd here must not count.
        _row("mlp6", 2, "dkfac_1_1", 1.0),
        _row("mlp6", 2, "spd_1_1", 10.0),
        _row("mlp6", 4, "sgd", 0.125),
        _row("mlp6", 4, "dkfac_1_1", 1.25, DKFAC_PHASES),
        _row("mlp6", 4, "spd_1_1", 1.0, SPD_PHASES),
        _row("mlp6", 4, "pad_1_1", 1.25, PAD_PHASES),
        # (10,100) is not part of the target either.
        _row("mlp6", 4, "dkfac_10_100", 1.0),
        _row("mlp6", 4, "spd_10_100", 0.5),
        _row("resnet32", 4, "dkfac_1_1", 0.5),
        _row("resnet32", 4, "spd_1_1", 0.25),
        _row("resnet32", 4, "pad_1_1", 1.0),
    ]


def test_pipelined_target_met_and_not_met() -> None:
    verdict = evaluate_pipelined_target(_pipelined_rows(), PIPELINED)
    assert verdict["evaluated"] is True and verdict["reason"] is None
    assert verdict["met"] is False  # pad misses on both models
    compared = {(c["model"], c["strategy"]): c for c in verdict["comparisons"]}
    assert list(compared) == [
        ("mlp6", "spd"),
        ("mlp6", "pad"),
        ("resnet32", "spd"),
        ("resnet32", "pad"),
    ]
    speedups = {pair: c["speedup"] for pair, c in compared.items()}
    assert speedups == {
        ("mlp6", "spd"): 0.25,  # 1.25 / 1.0 - 1
        ("mlp6", "pad"): 0.0,  # 1.25 / 1.25 - 1
        ("resnet32", "spd"): 1.0,  # 0.5 / 0.25 - 1
        ("resnet32", "pad"): -0.5,  # 0.5 / 1.0 - 1
    }
    assert {pair: c["met"] for pair, c in compared.items()} == {
        ("mlp6", "spd"): True,
        ("mlp6", "pad"): False,
        ("resnet32", "spd"): True,
        ("resnet32", "pad"): False,
    }
    spd = compared[("mlp6", "spd")]
    assert (spd["key"], spd["baseline_key"]) == ("spd_1_1", "dkfac_1_1")
    assert (spd["strategy_s"], spd["baseline_s"]) == (1.0, 1.25)
    # other = median_s minus every recorded phase: 1.25 - 0.8125 and 1.0 - 0.75.
    assert spd["baseline_phase_s"] == DKFAC_PHASES | {"other": 0.4375}
    assert spd["phase_s"] == SPD_PHASES | {"other": 0.25}
    assert spd["phase_delta_s"] == {
        "factor_comm": -0.0625,
        "factor_compute": 0.0,
        "inverse_compute": 0.0,
        "inverse_comm": 0.0,
        "precondition": 0.0,
        "other": -0.1875,
    }
    json.dumps(verdict)  # stored as is in the report

    text = format_pipelined_target(verdict)
    lines = text.splitlines()
    assert lines[0].startswith(
        "target spd/pad vs dkfac (P=4, (1,1), >= 10% faster per factor-update iteration): "
        "NOT MET (2 of 4)"
    )
    assert lines[1] == (
        "target spd vs dkfac, MLP-6 (1024 wide), P=4, (1,1): 1.000 vs 1.250 s/iter -> 25.0% "
        "faster (>= 10%): MET; factor_comm 125.0 -> 62.5 ms (-62.5), factor_compute 250.0 -> "
        "250.0 ms (+0.0), inverse_compute 250.0 -> 250.0 ms (+0.0), inverse_comm 125.0 -> 125.0 "
        "ms (+0.0), precondition 62.5 -> 62.5 ms (+0.0), other 437.5 -> 250.0 ms (-187.5)"
    )
    # 1.25 s would have to be at most 1.25 / 1.1 s: 113.6 ms short; factor_comm got slower.
    assert lines[2].startswith(
        "target pad vs dkfac, MLP-6 (1024 wide), P=4, (1,1): 1.250 vs 1.250 s/iter -> 0.0% "
        "faster (>= 10%): NOT MET (113.6 ms/iter short; slower: factor_comm +125.0 ms); "
        "factor_comm 125.0 -> 250.0 ms (+125.0)"
    )
    assert "ResNet-32, P=4, (1,1): 0.250 vs 0.500 s/iter -> 100.0% faster" in lines[3]
    assert "ResNet-32, P=4, (1,1): 1.000 vs 0.500 s/iter -> 50.0% slower" in lines[4]
    assert "NOT MET (545.5 ms/iter short; slower: other +500.0 ms)" in lines[4]
    assert len(lines) == 5


def test_pipelined_target_all_met() -> None:
    rows = [r for r in _pipelined_rows() if r["key"] != "pad_1_1"]
    verdict = evaluate_pipelined_target(rows, PIPELINED)
    assert verdict["met"] is True
    assert [(c["model"], c["strategy"]) for c in verdict["comparisons"]] == [
        ("mlp6", "spd"),
        ("resnet32", "spd"),
    ]
    assert "MET (2 of 2)" in format_pipelined_target(verdict).splitlines()[0]


def test_a_pipelined_target_compares_kaisa_and_dear_rows_by_their_names() -> None:
    target = PipelinedTarget(4, (1, 1), "kaisa_1of2", ("spd_dear", "kaisa_1of4"), "median_s", 0.1)
    rows = [
        _row("mlp6", 4, "kaisa_1of2_1_1", 1.25),
        _row("mlp6", 4, "kaisa_1of4_1_1", 1.0),
        _row("mlp6", 4, "spd_1_1", 0.25),  # spd without DeAR is not compared
        _row("mlp6", 4, "spd_dear_1_1", 2.5),
    ]
    verdict = evaluate_pipelined_target(rows, target)
    compared = {
        c["strategy"]: (c["key"], c["baseline_key"], c["speedup"]) for c in verdict["comparisons"]
    }
    assert compared == {
        "spd_dear": ("spd_dear_1_1", "kaisa_1of2_1_1", -0.5),
        "kaisa_1of4": ("kaisa_1of4_1_1", "kaisa_1of2_1_1", 0.25),
    }
    assert verdict["met"] is False


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([], "P=4 was not run"),
        ([_row("resnet20", 2, "dkfac_1_1", 1.0), _row("resnet20", 2, "spd_1_1", 0.5)], "P=4"),
        (
            [_row("mlp6", 4, "sgd", 0.1), _row("mlp6", 4, "dkfac_1_1", 1.0)],
            "dkfac and spd/pad at (1,1) were not both run at P=4",
        ),
        (
            [_row("mlp6", 4, "spd_1_1", 1.0), _row("mlp6", 4, "pad_10_100", 1.0)],
            "dkfac and spd/pad at (1,1) were not both run at P=4",
        ),
    ],
)
def test_pipelined_target_not_evaluated(rows: list[dict[str, Any]], reason: str) -> None:
    verdict = evaluate_pipelined_target(rows, PIPELINED)
    assert verdict["evaluated"] is False and verdict["met"] is None
    assert verdict["comparisons"] == []
    assert reason in verdict["reason"]
    text = format_pipelined_target(verdict, quick=True)
    assert text == (
        "target spd/pad vs dkfac (P=4, (1,1), >= 10% faster per factor-update iteration): "
        f"not evaluated ({verdict['reason']})"
    )
