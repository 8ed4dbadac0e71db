"""strategy=dkfac.AutoOptions(...): the strategy chosen at construction, and what it runs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.cli.main import main
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel, CubicCost
from dkfac.sim.choice import candidates, rank_candidates
from dkfac.sim.network import LinkModel
from dkfac.sim.profile import ComputeProfile, LayerProfile
from dkfac.sim.run import SimulatedCluster, SimulatedRun

#: A link of 100 kB/s with 1 ms per step: slow enough that traffic decides the choice.
SLOW = ClusterCostModel(AlphaBeta(2e-3, 1e-5), CubicCost(1e-4, 1e-9))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def profile() -> ComputeProfile:
    """The model above as a hand-written profile (times in seconds)."""
    layers = (
        LayerProfile("0", 9, 16, 0.01, 0.02, 0.03, 0.001, 0.001, 0.001, 4 * 9 * 16),
        LayerProfile("2", 17, 4, 0.02, 0.0, 0.01, 0.001, 0.001, 0.001, 4 * 17 * 4),
    )
    return ComputeProfile(
        device="test",
        batch_size=16,
        forward_s=0.02,
        backward_s=0.03,
        optimizer_s=0.001,
        factor_update_s=0.001,
        decomposition={},
        layers=layers,
        pack_bytes_per_s=1e8,
    )


def expected_choice() -> tuple[str, float, float]:
    """The fastest candidate by the simulator, computed here from the same inputs."""
    given = profile()
    given = ComputeProfile(**{**given.__dict__, "decomposition": {"eigen": SLOW.decomposition}})
    cluster = SimulatedCluster(2, LinkModel.from_allreduce_fit(SLOW.collective, 2), "gloo")
    best = rank_candidates(given, cluster, candidates(SimulatedRun("dkfac"), 2))[0]
    return best.candidate.run.strategy, best.candidate.run.grad_worker_fraction, best.iteration_s


def chosen_with_a_given_profile(rank: int, world_size: int) -> dict:
    net = model()
    pre = dkfac.KFACPreconditioner(
        net, strategy=dkfac.AutoOptions(profile=profile(), cost_model=SLOW)
    )
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    F.cross_entropy(net(x), torch.arange(16) % 4).backward()
    pre.step()
    plan = pre.plan()
    comm = pre._strategy.comm
    out = {"plan": plan, "repr": repr(pre).splitlines()[0], "cap": comm.bucket_cap_bytes}
    pre.remove()
    return out


def test_auto_runs_the_strategy_the_simulator_ranks_fastest() -> None:
    strategy, fraction, seconds = expected_choice()
    for out in run_workers(chosen_with_a_given_profile, 2, timeout=90):
        chosen = out["plan"]["chosen"]
        assert out["plan"]["strategy"] == strategy == chosen["strategy"]
        assert f"strategy={strategy!r}" in out["repr"]
        best = chosen["ranking"][0]
        assert best["iteration_s"] == pytest.approx(seconds)
        assert best["grad_worker_fraction"] == fraction
        assert out["cap"] == int(best["bucket_cap_mb"] * 2**20)
        assert [r["iteration_s"] for r in chosen["ranking"]] == sorted(
            r["iteration_s"] for r in chosen["ranking"]
        )
        assert "strategy=auto chose" in chosen["reason"]
        if strategy in ("spd", "pad"):  # planned with the cost model auto was given
            assert out["plan"]["cost_model"]["beta_s_per_byte"] == pytest.approx(1e-5)


def chosen_with_a_measured_profile(rank: int, world_size: int) -> dict:
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.arange(16) % 4
    torch.manual_seed(123)
    options = dkfac.AutoOptions(example=(x, y), loss_fn=F.cross_entropy, cost_model=SLOW)
    pre = dkfac.KFACPreconditioner(net, strategy=options)
    drawn = torch.rand(3)
    after = net.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    grads = [p.grad for p in net.parameters()]
    chosen = pre.plan()["chosen"]
    pre.remove()
    return {"unchanged": unchanged, "drawn": drawn, "grads": grads, "chosen": chosen}


def test_auto_profiles_a_copy_and_leaves_the_model_and_random_state_alone() -> None:
    torch.manual_seed(123)
    reference = torch.rand(3)
    results = run_workers(chosen_with_a_measured_profile, 2, timeout=120)
    for out in results:
        assert out["unchanged"] and all(g is None for g in out["grads"])
        assert torch.equal(out["drawn"], reference)  # the generator was not advanced
        assert out["chosen"]["profile"]["layers"] == 2
        assert out["chosen"]["strategy"] in ("dkfac", "kaisa", "spd", "pad", "dp")
    assert results[0]["chosen"]["label"] == results[1]["chosen"]["label"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs what to profile"),
        ({"example": (torch.zeros(1), torch.zeros(1))}, "needs what to profile"),
        ({"profile": profile(), "strategies": ("sgd",)}, "auto chooses among"),
        ({"profile": profile(), "bucket_caps_mb": ()}, "caps > 0"),
        ({"profile": profile(), "profile_steps": 0}, "profile_steps=0"),
    ],
)
def test_auto_options_refuse_what_cannot_be_chosen_with(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dkfac.AutoOptions(**kwargs)


def test_auto_refuses_the_options_it_chooses_and_needs_a_process_group() -> None:
    auto = dkfac.AutoOptions(profile=profile())
    for extra in ({"grad_worker_fraction": 0.5}, {"bucket_cap_mb": 4.0}):
        with pytest.raises(ValueError, match="not allowed with strategy='auto'"):
            dkfac.KFACPreconditioner(model(), strategy=auto, **extra)
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed"):
        dkfac.KFACPreconditioner(model(), strategy=auto)


def test_dkfac_train_strategy_auto_says_what_it_chose(tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "digits", "--batch-size", "32"]
    argv += ["--steps-per-epoch", "3", "--epochs", "1", "--nproc", "2", "--strategy", "auto"]
    assert main([*argv, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    chosen = [r for r in records if r.get("event") == "strategy"]
    assert len(chosen) == 1 and chosen[0]["strategy"] in ("dkfac", "kaisa", "spd", "pad", "dp")
    assert chosen[0]["reason"].startswith(f"strategy=auto chose {chosen[0]['label']}")
    assert [r["event"] for r in records if "event" in r][-1] == "epoch"  # it trained
