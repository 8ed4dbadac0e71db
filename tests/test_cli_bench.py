"""``dkfac bench``: a minimal end-to-end run (JSON, PNG, table) and every bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from dkfac.cli.bench import options_from_args
from dkfac.cli.bench_configs import PHASES
from dkfac.cli.main import BENCH_MODELS, BENCH_NPROCS, build_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _torchrun_available() -> bool:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    return importlib.util.find_spec("torch.distributed.run") is not None


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _torchrun_available(), reason="needs torchrun and gloo")
def test_bench_quick_writes_json_chart_and_table(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--rounds", "1", "--warmup", "1", "--iters", "1"]
    assert main([*argv, "--iters-long", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "amort s/it" in printed and "kfac-pytorch 0.4.2 on this machine class" in printed
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
    } <= report.keys()
    assert report["settings"]["models"] == ["resnet20"]
    assert report["settings"]["nprocs"] == [2]
    assert report["settings"]["strategies"] == ["dkfac", "kaisa"]
    (launch,) = report["launches"]
    assert launch["ok"] is True
    # The workers run from the package, not from the benchmarks/ folder.
    assert launch["command"][5:7] == ["-m", "dkfac.cli.bench_worker"]
    keys = ["sgd", "dkfac_1_1", "kaisa_1of2_1_1", "dkfac_10_100", "kaisa_1of2_10_100"]
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

    png = out / "bench.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 1000


def test_bench_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.out == str(Path("runs") / "bench")
    options = options_from_args(args, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
    assert options.models == ("resnet20",)
    assert options.nprocs == (2,)
    assert options.strategies == ("dkfac", "kaisa")
    assert options.schedules == ((1, 1), (10, 100))
    assert (options.rounds, options.iters, options.iters_long) == (2, 10, 100)


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
        (["--nprocs", "0"], "--nprocs"),
        (["--nprocs", "2,-1"], "--nprocs"),
        (["--nprocs", "two"], "--nprocs"),
        (["--strategies", "adam"], "--strategies"),
        (["--strategies", "dkfac,sgdx"], "--strategies"),
        (["--schedules", "10:15"], "--schedules"),
        (["--schedules", "ten"], "--schedules"),
        (["--iters", "0"], "--iters"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(
    option: list[str], message: str, tmp_path: Path, capsys
) -> None:
    code = main(["bench", "--quick", *option, "--out", str(tmp_path / "bench")])
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dkfac: error: ") and message in lines[0]
    assert not (tmp_path / "bench").exists()  # refused before anything is launched or written
