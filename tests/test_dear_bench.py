"""benchmarks/dear.py runs end to end (torchrun, 2 workers) and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dear.py"


@pytest.mark.slow
def test_quick_run_writes_table_json_and_traces(tmp_path: Path) -> None:
    out = tmp_path / "dear.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "median s/it" in done.stdout
    report = json.loads(out.read_text())
    configs = [row["config"] for row in report["summary"]]
    assert configs == ["DDP", "DeAR 25 MB", "DeAR auto"]
    auto = report["summary"][2]
    measured = [size for size, _ in auto["tuning"]]
    assert measured == [1.0, 8.0, 16.0, 32.0]  # MLP-6's distinct layouts in 1-64 MiB
    assert auto["bucket_mb"][0] in measured
    for row in report["summary"][1:]:
        assert {"grad_reduce_scatter", "grad_all_gather"} <= row["waits_ms"].keys()
    traces = sorted(p.name for p in tmp_path.glob("dear_trace_mlp6_P2_*.json"))
    assert traces == ["dear_trace_mlp6_P2_DeAR_25_MB.json", "dear_trace_mlp6_P2_DeAR_auto.json"]


def test_verdict_compares_with_ddp_of_the_same_round(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("dear", monkeypatch)

    def row(config: str, round_index: int, seconds: float) -> dict[str, object]:
        return {
            "model": "mlp6",
            "nprocs": 4,
            "config": config,
            "round": round_index,
            "median_s": seconds,
            "phases_ms": {"forward": 1.0, "backward": 1.0, "step": 1.0, "total": 3.0},
            "waits_ms": {},
            "bucket_mb": 25.0,
            "tuning": [],
        }

    rows = [
        row("DDP", 0, 1.0),
        row("DDP", 1, 2.0),
        row("DeAR 25 MB", 0, 0.8),  # 1.25x faster in round 0
        row("DeAR 25 MB", 1, 1.9),  # 1.05x in round 1: median of the ratios = 1.15x
        row("DeAR auto", 0, 1.0),
        row("DeAR auto", 1, 2.0),
    ]
    summary = bench.summarise(rows)
    speedups = {r["config"]: r["speedup_vs_ddp"] for r in summary}
    assert speedups["DeAR 25 MB"] == pytest.approx((1.25 + 2.0 / 1.9) / 2)
    verdicts = bench.verdicts(summary)
    assert verdicts[0].endswith("1.15x: MET")
    assert verdicts[1].endswith("1.00x: NOT MET")
