"""The targets of ``dkfac bench`` come from a file: benchmarks/targets.json, its validation
(every kind of bad file), ``--targets`` on the command line, and a run without targets, which
evaluates nothing (workers faked: no process is launched)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

import dkfac.bench.command as bench_command
from dkfac.bench.configs import (
    PHASES,
    SCHEDULES,
    STRATEGY_CHOICES,
    Configuration,
    configurations,
    kfac_configuration,
)
from dkfac.bench.launch import Launch
from dkfac.bench.options import BenchOptions
from dkfac.bench.report import format_summary
from dkfac.bench.targets import (
    NO_TARGETS_LINE,
    BenchTargets,
    OverheadTarget,
    PipelinedTarget,
    load_targets,
)
from dkfac.bench.verdicts import evaluate_pipelined_target, evaluate_target
from dkfac.cli.main import main
from script_loader import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
TARGETS_FILE = ROOT / "benchmarks" / "targets.json"
RESULTS = ROOT / "benchmarks" / "results"


def test_the_repository_file_holds_the_reference_and_the_three_targets() -> None:
    targets = load_targets(TARGETS_FILE)
    assert targets.source_file == str(TARGETS_FILE)
    assert dataclasses.asdict(targets.reference) == {
        "library": "kfac-pytorch 0.4.2",
        "setting": "ResNet-20, batch 32, P=2, gloo, 1 thread/process",
        "sgd_s_per_iter": 0.242,
        "kfac_1_1_s_per_iter": 1.251,
        "overhead_s": 1.009,
        "line": "kfac-pytorch 0.4.2 on this machine class (ResNet-20, batch 32, P=2, gloo, 1 "
        "thread/process): SGD 0.242 s/iter, K-FAC (1,1) 1.251 s/iter -> overhead 1.009 s; "
        "target: dkfac overhead at (1,1), P=2 <= 0.505 s",
    }
    assert targets.overhead_target == OverheadTarget("resnet20", 2, "dkfac_1_1", 0.505)
    pipelined = targets.pipelined_target
    assert pipelined.as_verdict() == {
        "nprocs": 4,
        "schedule": [1, 1],
        "baseline": "dkfac",
        "strategies": ["spd", "pad"],
        "metric": "median_s",
        "min_speedup": 0.1,
    }
    assert pipelined.description.startswith("dkfac vs spd vs pad")
    dry = targets.dry_run_target
    assert (dry.source, dry.nprocs, dry.communication, dry.memory) == (
        "DP-KFAC paper, 64 GPUs",
        64,
        2.79,
        1.14,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        targets.overhead_target.max_overhead_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "name", ["strategies.json", "strategies_pipelined.json", "strategies_resnet20_p2_head.json"]
)
def test_the_file_reproduces_the_committed_verdicts(name: str) -> None:
    """The verdicts recorded before the targets moved to a file, from their own rows."""
    targets = load_targets(TARGETS_FILE)
    recorded = json.loads((RESULTS / name).read_text())
    assert recorded["reference"] == dataclasses.asdict(targets.reference)
    assert evaluate_target(recorded["summary"], targets.overhead_target) == recorded["target"]
    if "pipelined_target" in recorded:
        verdict = evaluate_pipelined_target(recorded["summary"], targets.pipelined_target)
        # The task wording ("issue") is no longer copied into the verdict.
        assert verdict == {k: v for k, v in recorded["pipelined_target"].items() if k != "issue"}


def _targets_json() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(TARGETS_FILE.read_text())
    return data


def _delete(section: str, key: str) -> Any:
    def edit(data: dict[str, Any]) -> None:
        del data[section][key]

    return edit


def _set(section: str, key: str, value: Any) -> Any:
    def edit(data: dict[str, Any]) -> None:
        data[section][key] = value

    return edit


def _drop_section(data: dict[str, Any]) -> None:
    del data["dry_run_target"]


def _extra_section(data: dict[str, Any]) -> None:
    data["targets"] = {}


def _section_not_object(data: dict[str, Any]) -> None:
    data["overhead_target"] = [0.505]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # A missing or unknown section or key.
        (_drop_section, "dry_run_target: missing key"),
        (_extra_section, "targets: unknown key"),
        (_section_not_object, "overhead_target = [0.505]: expected a JSON object"),
        (
            _delete("overhead_target", "max_overhead_s"),
            "overhead_target.max_overhead_s: missing key",
        ),
        (_delete("reference", "line"), "reference.line: missing key"),
        (_set("pipelined_target", "issue", "x"), "pipelined_target.issue: unknown key"),
        # A value of the wrong type.
        (_set("overhead_target", "max_overhead_s", "0.5"), "max_overhead_s = '0.5': expected a"),
        (_set("overhead_target", "nprocs", 2.0), "overhead_target.nprocs = 2.0: expected an int"),
        (_set("overhead_target", "nprocs", True), "overhead_target.nprocs = True: expected an"),
        (
            _set("pipelined_target", "schedule", [1]),
            "pipelined_target.schedule = [1]: needs two steps",
        ),
        (_set("pipelined_target", "strategies", "spd"), "pipelined_target.strategies = 'spd'"),
        (_set("dry_run_target", "memory", None), "dry_run_target.memory = None: expected a"),
        (_set("reference", "setting", 32), "reference.setting = 32: expected a string"),
        # A negative threshold or measurement.
        (_set("overhead_target", "max_overhead_s", -0.1), "max_overhead_s = -0.1: must be >= 0"),
        (_set("pipelined_target", "min_speedup", -0.05), "min_speedup = -0.05: must be >= 0"),
        (_set("dry_run_target", "communication", -2.79), "communication = -2.79: must be >= 0"),
        (_set("reference", "overhead_s", -1), "reference.overhead_s = -1.0: must be >= 0"),
        # An unknown strategy or model, or an impossible schedule or world size.
        (_set("pipelined_target", "baseline", "dkfacx"), "baseline = 'dkfacx': no K-FAC row"),
        (_set("pipelined_target", "strategies", ["spd", "pd"]), "strategies = 'pd': no K-FAC"),
        # KAISA without its fraction, or at one P = 4 does not run.
        (_set("pipelined_target", "strategies", ["kaisa"]), "strategies = 'kaisa': no K-FAC"),
        (_set("pipelined_target", "strategies", ["kaisa_1of8"]), "'kaisa_1of8': no K-FAC"),
        (_set("pipelined_target", "strategies", []), "strategies = []: needs at least one"),
        (_set("pipelined_target", "strategies", ["spd", "dkfac"]), "not the baseline itself"),
        (_set("pipelined_target", "strategies", ["spd", "spd"]), "each once"),
        (_set("overhead_target", "config", "dkfac"), "config = 'dkfac': expected <strategy>_"),
        (
            _set("overhead_target", "config", "dkfacx_1_1"),
            "config = 'dkfacx_1_1': no K-FAC configuration at P=2 has this key; choose from "
            "dkfac_1_1, kaisa_1of2_1_1, spd_1_1",
        ),
        # A row of another world size, or KAISA + DeAR without its fraction.
        (_set("overhead_target", "config", "kaisa_1of4_1_1"), "'kaisa_1of4_1_1': no K-FAC"),
        (_set("overhead_target", "config", "kaisa_dear_1_1"), "'kaisa_dear_1_1': no K-FAC"),
        (_set("reference", "overhead_s", 0.5), "overhead_s = 0.5: expected kfac_1_1 - sgd"),
        (_set("overhead_target", "config", "sgdx_1_1"), "config = 'sgdx_1_1': no K-FAC"),
        (_set("overhead_target", "model", "resnet99"), "model = 'resnet99': unknown model"),
        (_set("pipelined_target", "schedule", [10, 15]), "schedule = [10, 15]: needs steps >="),
        (_set("pipelined_target", "schedule", [0, 0]), "schedule = [0, 0]: needs steps >= 1"),
        (_set("overhead_target", "config", "dkfac_0_0"), "'dkfac_0_0': schedule (0,0) needs"),
        (_set("overhead_target", "config", "dkfac_10_15"), "'dkfac_10_15': schedule (10,15)"),
        (_set("pipelined_target", "metric", "mean_s"), "metric = 'mean_s': choose from median_s"),
        (_set("dry_run_target", "nprocs", 1), "dry_run_target.nprocs = 1: must be >= 2"),
    ],
)
def test_load_targets_refuses_a_bad_file_naming_it_and_the_key(
    edit: Any, message: str, tmp_path: Path
) -> None:
    data = _targets_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load_targets(path)
    text = str(error.value)
    assert text.startswith(f"targets file {path}: ") and message in text
    assert "\n" not in text


def test_an_unknown_row_name_lists_the_valid_ones(tmp_path: Path) -> None:
    data = _targets_json()
    data["pipelined_target"]["baseline"] = "adam"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    names = "dkfac, kaisa_1of4, kaisa_1of2, spd, pad, dp, dkfac_dear, kaisa_1of4_dear, spd_dear"
    with pytest.raises(ValueError, match=f"no K-FAC row at P=4; choose from {names}, "):
        load_targets(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object with reference, overhead_target"),
        ("", "not valid JSON"),
    ],
)
def test_load_targets_refuses_what_is_not_a_targets_object(
    text: str, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"targets file {path}: {message}")):
        load_targets(path)


def test_load_targets_refuses_a_file_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        load_targets(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_targets(tmp_path)  # a folder


def test_the_targets_validate_when_built_directly() -> None:
    with pytest.raises(ValueError, match="max_overhead_s = -1"):
        OverheadTarget("resnet20", 2, "dkfac_1_1", -1.0)
    with pytest.raises(ValueError, match="strategies = 'xyz': no K-FAC row at P=4"):
        PipelinedTarget(4, (1, 1), "dkfac", ("xyz",), "median_s", 0.1)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (None, "--targets: {path}: no such file"),
        ('{"reference": {}}', "--targets: targets file {path}: reference.library: missing key"),
    ],
)
def test_bench_refuses_a_missing_or_bad_targets_file(
    contents: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "targets.json"
    if contents is not None:
        path.write_text(contents)
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--targets", str(path), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dkfac: error: ") and message.format(path=path) in line
    assert not out.exists()  # refused before anything is launched or written


def _entry(config: Configuration, seconds: float) -> dict[str, Any]:
    """A worker's summary entry, with what the table and the verdicts read."""
    kfac = config.kfac
    compared = not config.reference
    return {
        **config.to_json(),
        "amortized_s": seconds,
        "median_s": seconds,
        "overhead_s": seconds - 0.25 if compared else None,
        "overhead_s_per_round": [seconds - 0.25] if compared else None,
        "overhead_pct": 100 * (seconds - 0.25) / 0.25 if compared else None,
        "phase_s": {name: 0.01 for name in PHASES} if kfac else {"grad_comm": 0.02},
        "bytes_per_step": {"total": 1e6, "factor": 1e6 if kfac else 0, "inverse": 0, "grad": 0},
        **({"kfac_memory_bytes": 2e6} if kfac else {}),
    }


def _fake_run(
    monkeypatch: pytest.MonkeyPatch,
    targets: BenchTargets | None,
    strategies: tuple[str, ...] = ("dkfac",),
) -> tuple[dict[str, Any], str]:
    """``run_bench`` of ResNet-20 at P=2 with a faked launch; the report and its summary.

    SGD takes 0.25 s/iter, DeAR + SGD (``dear``) 0.125 (faster than DDP + SGD), K-FAC 0.5.
    """

    def fake_launch(nprocs: int, options: BenchOptions, folder: Path) -> Launch:
        entries = {
            config.key: _entry(config, {"sgd": 0.25, "dear": 0.125}.get(config.key, 0.5))
            for config in configurations(nprocs, strategies, options.schedules)
        }
        summary = {"resnet20": entries}
        return Launch(nprocs, ["torchrun"], 0, False, 1.0, [], {"summary": summary})

    monkeypatch.setattr(bench_command, "launch", fake_launch)
    options = BenchOptions(
        models=("resnet20",),
        nprocs=(2,),
        rounds=1,
        warmup=0,
        iters=1,
        iters_long=1,
        timeout=1.0,
        strategies=strategies,
        schedules=((1, 1),),
        targets=targets,
    )
    report = bench_command.run_bench(options)
    json.dumps(report)  # JSON-ready
    return report, format_summary(report)


def test_a_run_without_targets_reports_measurements_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    report, printed = _fake_run(monkeypatch, None)
    assert [row["key"] for row in report["summary"]] == ["sgd", "dkfac_1_1"]
    assert report["targets_file"] is None
    assert (report["reference"], report["target"], report["pipelined_target"]) == (None,) * 3
    assert printed.count(NO_TARGETS_LINE) == 1 and "--targets FILE" in NO_TARGETS_LINE
    assert "kfac-pytorch" not in printed and "target" not in printed.replace(NO_TARGETS_LINE, "")
    assert "resnet20  2 dkfac" in printed  # the table is there


def test_a_run_with_targets_prints_the_target_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    report, printed = _fake_run(monkeypatch, load_targets(TARGETS_FILE))
    assert report["targets_file"] == str(TARGETS_FILE)
    assert report["reference"]["library"] == "kfac-pytorch 0.4.2"
    assert report["target"]["met"] is True and report["target"]["measured_overhead_s"] == 0.25
    assert report["pipelined_target"]["reason"] == "P=4 was not run"
    assert NO_TARGETS_LINE not in printed
    assert "kfac-pytorch 0.4.2 on this machine class" in printed
    assert (
        "measured: dkfac ResNet-20 P=2 (1,1) 0.500 s/iter, SGD 0.250 s/iter -> overhead 0.250 s "
        "(rounds: 0.250) <= 0.505 s: MET"
    ) in printed
    assert "target spd/pad vs dkfac (P=4, (1,1), >= 10% faster" in printed


def test_dear_is_reported_against_sgd_and_leaves_the_targets_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    report, printed = _fake_run(monkeypatch, load_targets(TARGETS_FILE), ("dear", "dkfac"))
    assert [row["key"] for row in report["summary"]] == ["sgd", "dear", "dkfac_1_1"]
    assert report["settings"]["strategies"] == ["dear", "dkfac"]
    assert report["settings"]["dear"]["bucket_cap_mb"] == "auto"
    (line,) = [line for line in printed.splitlines() if line.startswith("resnet20  2 SGD (DeAR)")]
    assert "-0.1250" in line and "-50.0%" in line  # faster than DDP + SGD: negative
    assert "+ DDP or DeAR;" in printed and "timed iterations 1 (SGD, DeAR, (1,1))" in printed
    # The targets read the K-FAC rows and the DDP + SGD reference, never DeAR's.
    assert report["target"]["measured_sgd_s_per_iter"] == 0.25
    assert report["target"]["measured_overhead_s"] == 0.25 and report["target"]["met"] is True


@pytest.mark.parametrize(
    ("strategy", "key", "label"),
    [
        ("dkfac+dear", "dkfac_dear_1_1", "dkfac + DeAR"),
        ("kaisa+dear", "kaisa_1of2_dear_1_1", "kaisa f=1/2 + DeAR"),
        ("kaisa", "kaisa_1of2_1_1", "kaisa f=1/2"),
    ],
)
def test_a_target_names_any_kfac_row_by_its_key(
    strategy: str, key: str, label: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _targets_json()
    data["overhead_target"]["config"] = key
    path = tmp_path / "targets.json"
    path.write_text(json.dumps(data))
    report, printed = _fake_run(monkeypatch, load_targets(path), (strategy,))
    assert [row["key"] for row in report["summary"]] == ["sgd", key]
    assert report["target"]["config"] == key
    assert report["target"]["measured_overhead_s"] == 0.25 and report["target"]["met"] is True
    assert f"measured: {label} ResNet-20 P=2 (1,1) 0.500 s/iter, SGD 0.250 s/iter" in printed
    # The rows with DeAR record its options in the settings, without the dear row too.
    assert (report["settings"]["dear"] is None) == ("+dear" not in strategy)


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_every_kfac_row_of_a_run_can_be_a_target(nprocs: int) -> None:
    for config in configurations(nprocs, STRATEGY_CHOICES, SCHEDULES):
        if config.kfac:
            assert OverheadTarget("resnet20", nprocs, config.key, 0.5).config == config.key
            assert kfac_configuration(config.key, nprocs) == config


def test_the_benchmark_script_checks_the_repository_targets_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_benchmark("strategies", monkeypatch)
    # Relative to where the script runs: reports carry no machine-specific directory.
    assert not bench.DEFAULT_TARGETS.is_absolute()
    assert bench.DEFAULT_TARGETS.resolve() == TARGETS_FILE.resolve()
    assert load_targets(bench.DEFAULT_TARGETS).source_file == str(bench.DEFAULT_TARGETS)
