"""The seed papers' ResNet-50 cluster script: its whole-worker memory and its saved profile.

Oracles: the tensors autograd saves for a linear layer and a ReLU, counted by hand; the
committed V100-like profile is the one the script derives (so ``dkfac simulate --profile``
predicts what docs/simulator.md reports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dkfac.cli.main import main
from dkfac.sim.flops import flop_profile, resnet50_work
from dkfac.sim.profile import ComputeProfile
from script_loader import load_benchmark

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_saved_activations_are_counted_once_per_storage_without_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = load_benchmark("seed_reproduction", monkeypatch)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    # Linear saves its input (the weight is the model's); ReLU its output, which the second
    # Linear saves again (one storage): 2x4 + 2x3 floats.
    assert seed.saved_activation_bytes(model, torch.randn(2, 4)) == 4 * (2 * 4 + 2 * 3)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_the_committed_v100_profile_is_the_one_the_script_derives(
    method: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seed = load_benchmark("seed_reproduction", monkeypatch)
    committed = ComputeProfile.load(RESULTS / f"profile_resnet50_v100_{method}.json")
    derived = flop_profile(
        resnet50_work(),
        seed.V100,
        seed.BATCH,
        other_grad_bytes=seed.BATCH_NORM_BYTES,
        inverse_method=method,
    )
    assert committed == derived
    if method == "inverse":  # and dkfac simulate reads it: SGD as docs/simulator.md says
        argv = ["simulate", "--profile", str(RESULTS / "profile_resnet50_v100_inverse.json")]
        argv += ["--network", "10gbit,50us", "--world-sizes", "64", "--strategies", "sgd"]
        assert main([*argv, "--out", str(tmp_path)]) == 0
        rows = json.loads((tmp_path / "simulate.json").read_text())["rows"]
        assert rows[0]["iteration_s"] == pytest.approx(0.230, abs=5e-4)
