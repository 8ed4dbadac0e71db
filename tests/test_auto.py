"""strategy=dkfac.AutoOptions(...): the strategy chosen at construction, and what it runs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.auto import agree_on_profile
from dkfac.cli.checkpoint import load_checkpoint, save_atomic
from dkfac.cli.main import main
from dkfac.comm import StepRecorder
from dkfac.comm.communicator import Communicator
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel, CubicCost
from dkfac.sim.choice import AUTO_BUCKET_CAPS_MB, candidates, rank_candidates
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


def expected_choice(
    ddp_bucket_cap_mb: float = 25.0, dear_bucket_cap_mb: float | None = None
) -> tuple[str, float, float]:
    """The fastest candidate by the simulator, computed here from the same inputs."""
    given = profile()
    given = ComputeProfile(**{**given.__dict__, "decomposition": {"eigen": SLOW.decomposition}})
    link = LinkModel.from_allreduce_fit(SLOW.collective, 2)
    cluster = SimulatedCluster(2, link, "gloo", ddp_bucket_cap_mb=ddp_bucket_cap_mb)
    template = SimulatedRun("dkfac")
    if dear_bucket_cap_mb is not None:
        template = SimulatedRun(
            "dkfac", gradient_sync="dear", dear_bucket_cap_mb=dear_bucket_cap_mb
        )
    best = rank_candidates(given, cluster, candidates(template, 2))[0]
    return best.candidate.run.strategy, best.candidate.run.grad_worker_fraction, best.iteration_s


def chosen_with_a_given_profile(
    rank: int, world_size: int, ddp_cap_mb: float = 25.0, dear_cap_mb: float | str | None = None
) -> dict:
    net = model()
    options = dkfac.AutoOptions(
        profile=profile(),
        cost_model=SLOW,
        ddp_bucket_cap_mb=ddp_cap_mb,
        dear_bucket_cap_mb=dear_cap_mb,
    )
    pre = dkfac.KFACPreconditioner(net, strategy=options)
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


def test_auto_simulates_ddp_with_the_bucket_cap_it_is_given() -> None:
    """A DDP cap below one layer's gradient sends the layers in separate allreduces."""
    _, _, seconds = expected_choice(ddp_bucket_cap_mb=1e-4)
    assert seconds != pytest.approx(expected_choice()[2])  # the cap changes the prediction
    for out in run_workers(chosen_with_a_given_profile, 2, args=(1e-4,), timeout=90):
        assert out["plan"]["chosen"]["ranking"][0]["iteration_s"] == pytest.approx(seconds)


@pytest.mark.parametrize(("given", "simulated"), [(1e-4, 1e-4), ("auto", 2.0)])
def test_auto_simulates_dear_when_dear_averages_the_gradients(
    given: float | str, simulated: float
) -> None:
    """DeAR's cap as given; its online search ("auto") at the middle of its range, 2 MiB.

    Below one layer's gradient (1e-4 MiB) DeAR's buckets split and its traffic differs from
    DDP's; at 2 MiB this model's gradients are one bucket, as long at P = 2 as DDP's.
    """
    strategy, _, seconds = expected_choice(dear_bucket_cap_mb=simulated)
    if simulated < 1:
        assert seconds != pytest.approx(expected_choice()[2])  # DeAR's traffic is not DDP's
    for out in run_workers(chosen_with_a_given_profile, 2, args=(25.0, given), timeout=90):
        chosen = out["plan"]["chosen"]
        assert chosen["ranking"][0]["iteration_s"] == pytest.approx(seconds)
        assert chosen["strategy"] == strategy and chosen["gradient_sync"] == "dear"
        assert " dear " in chosen["label"]


def chosen_with_a_measured_profile(
    rank: int, world_size: int, autocast: torch.dtype | None = None
) -> dict:
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.arange(16) % 4
    torch.manual_seed(123)
    options = dkfac.AutoOptions(
        example=(x, y), loss_fn=F.cross_entropy, cost_model=SLOW, autocast=autocast
    )
    pre = dkfac.KFACPreconditioner(net, strategy=options)
    drawn = torch.rand(3)
    after = net.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    grads = [p.grad for p in net.parameters()]
    chosen = pre.plan()["chosen"]
    pre.remove()
    return {"unchanged": unchanged, "drawn": drawn, "grads": grads, "chosen": chosen}


def test_auto_profiles_the_statistics_with_the_preconditioners_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The measured statistics must cost what the run's will: the same fraction and precision.
    seen: dict[str, Any] = {}

    def measured(*args: Any, kfac_options: dict[str, Any], **kwargs: Any) -> None:
        seen.update(kfac_options)
        raise RuntimeError("stop after the options are seen")

    monkeypatch.setattr("dkfac.auto.measure_profile", measured)
    options = dkfac.AutoOptions(
        example=(torch.randn(4, 8), torch.arange(4)), loss_fn=F.cross_entropy
    )
    config = dkfac.config.KFACConfig(
        statistics_fraction=0.25, statistics_precision="bf16", precondition_precision="bf16"
    )
    with pytest.raises(RuntimeError, match="stop after"):
        options._measure(model(), config, torch.device("cpu"))
    assert seen["statistics_fraction"] == 0.25 and seen["statistics_precision"] == "bf16"
    assert seen["precondition_precision"] == "bf16"


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_auto_profiles_a_copy_and_leaves_the_model_and_random_state_alone(
    autocast: torch.dtype | None,
) -> None:
    torch.manual_seed(123)
    reference = torch.rand(3)
    results = run_workers(chosen_with_a_measured_profile, 2, args=(autocast,), timeout=120)
    for out in results:
        assert out["unchanged"] and all(g is None for g in out["grads"])
        assert torch.equal(out["drawn"], reference)  # the generator was not advanced
        assert out["chosen"]["profile"]["layers"] == 2
        # Profiled under the training's autocast (measure_profile's test shows it runs so).
        expected = None if autocast is None else "bfloat16"
        assert out["chosen"]["profile"]["autocast"] == expected
        assert out["chosen"]["strategy"] in ("dkfac", "kaisa", "spd", "pad", "dp")
    assert results[0]["chosen"]["label"] == results[1]["chosen"]["label"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs what to profile"),
        ({"example": (torch.zeros(1), torch.zeros(1))}, "needs what to profile"),
        ({"profile": profile(), "strategies": ("sgd",)}, "auto chooses among"),
        ({"profile": profile(), "bucket_caps_mb": ()}, "caps > 0"),
        ({"profile": profile(), "measure_steps": 0}, "measure_steps=0"),
        ({"profile": profile(), "dear_bucket_cap_mb": 0.0}, "dear_bucket_cap_mb"),
        ({"profile": profile(), "dear_bucket_cap_mb": "big"}, "dear_bucket_cap_mb"),
        ({"profile": profile(), "autocast": torch.float32}, r"autocast=torch\.float32"),
    ],
)
def test_auto_options_refuse_what_cannot_be_chosen_with(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dkfac.AutoOptions(**kwargs)


def test_auto_refuses_the_options_it_chooses_and_needs_a_process_group() -> None:
    auto = dkfac.AutoOptions(profile=profile())
    # An explicit 25 MiB too: the default value given is still a cap the chooser would ignore.
    for extra in ({"grad_worker_fraction": 0.5}, {"bucket_cap_mb": 4.0}, {"bucket_cap_mb": 25.0}):
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


def test_a_resumed_auto_run_keeps_the_choice_its_checkpoint_saved(tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "digits", "--batch-size", "32"]
    argv += ["--steps-per-epoch", "4", "--epochs", "1", "--nproc", "2", "--strategy", "auto"]
    assert main([*argv, "--stop-after-steps", "2", "--out", str(out)]) == 0
    saved = load_checkpoint(out)
    assert saved is not None
    first = saved["strategy_choice"]
    assert first["strategy"] in ("dkfac", "kaisa", "spd", "pad", "dp")
    # A choice written into the checkpoint with a bucket cap auto never tries (7 MiB):
    # choosing again could not land on it, so the resumed run can only run it by keeping it.
    assert 7.0 not in AUTO_BUCKET_CAPS_MB
    kept = {"strategy": "kaisa", "grad_worker_fraction": 0.5, "bucket_cap_mb": 7.0}
    if first["strategy"] == "kaisa":
        kept = {"strategy": "dp", "grad_worker_fraction": 1.0, "bucket_cap_mb": 7.0}
    kept["label"] = f"{kept['strategy']} (kept by the test)"
    save_atomic({**saved, "strategy_choice": kept}, out)
    assert main(["train", "--out", str(out), "--resume", "--nproc", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "strategy"]
    assert [(e["step"], e["strategy"]) for e in events] == [
        (0, first["strategy"]),
        (2, kept["strategy"]),
    ]
    assert events[1]["reason"] == f"resumed with what strategy=auto chose before: {kept['label']}"
    # The event says what the resumed run built (its preconditioner's strategy and options).
    assert {k: events[1][k] for k in kept} == kept
    # Resumed from the same checkpoint again (the resumed run crashed before its next one):
    # the resumption is recorded once, not once per attempt.
    save_atomic({**saved, "strategy_choice": kept}, out)
    assert main(["train", "--out", str(out), "--resume", "--nproc", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    again = [(r["step"], r["strategy"]) for r in records if r.get("event") == "strategy"]
    assert again == [(0, first["strategy"]), (2, kept["strategy"])]
    # The checkpoint the resumed run wrote keeps the choice for the next resume.
    final = load_checkpoint(out)
    assert final is not None and final["step"] == 4 and final["strategy_choice"] == kept
    # On another number of workers the choice is made again (it was made for P = 2).
    assert main(["train", "--out", str(out), "--resume", "--nproc", "1"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "strategy"]
    assert events[-1]["strategy"] == "local" and events[-1]["reason"] == "one process: local"
    # Recorded where it resumed (step 4), once, and only the first run's choice at step 0.
    assert [(e["step"], e.get("resumed", False)) for e in events] == [
        (0, False),
        (2, True),
        (4, True),
    ]


def slower(given: ComputeProfile, factor: float) -> ComputeProfile:
    """``given`` with every time multiplied by ``factor`` and packing ``factor`` times slower."""
    layer_times = ("output_s", "output_grad_s", "grad_ready_s", "a_statistic_s", "g_statistic_s")
    layers = tuple(
        LayerProfile(
            **{
                **layer.__dict__,
                **{k: getattr(layer, k) * factor for k in (*layer_times, "precondition_s")},
            }
        )
        for layer in given.layers
    )
    steps = ("forward_s", "backward_s", "optimizer_s", "factor_update_s")
    return ComputeProfile(
        **{
            **given.__dict__,
            **{k: getattr(given, k) * factor for k in steps},
            "layers": layers,
            "pack_bytes_per_s": given.pack_bytes_per_s / factor,
        }
    )


def agreed_profiles(rank: int, world_size: int) -> ComputeProfile:
    mine = profile()
    if rank == 1:  # rank 1 is three times slower everywhere but one step time
        mine = slower(mine, 3.0)
        mine = ComputeProfile(**{**mine.__dict__, "optimizer_s": 0.0})
    return agree_on_profile(mine, Communicator(StepRecorder()), torch.device("cpu"))


def test_ranks_agree_on_the_slowest_profile_field_by_field() -> None:
    fast, slow = profile(), slower(profile(), 3.0)
    for agreed in run_workers(agreed_profiles, 2, timeout=60):
        assert agreed.forward_s == pytest.approx(3 * fast.forward_s)
        assert agreed.backward_s == pytest.approx(3 * fast.backward_s)
        assert agreed.optimizer_s == fast.optimizer_s  # rank 0's: the larger
        assert agreed.pack_bytes_per_s == pytest.approx(fast.pack_bytes_per_s / 3)
        for got, want in zip(agreed.layers, slow.layers, strict=True):
            assert got.name == want.name and got.a_dim == want.a_dim
            assert got.g_statistic_s == pytest.approx(want.g_statistic_s)
            assert got.precondition_s == pytest.approx(want.precondition_s)


def profiles_that_disagree(rank: int, world_size: int, case: str) -> str:
    mine: ComputeProfile | None = profile()
    failure = None
    if case == "failed" and rank == 1:
        mine, failure = None, ValueError("out of memory, say")
    if case == "layers" and rank == 0:
        assert mine is not None
        mine = ComputeProfile(**{**mine.__dict__, "layers": mine.layers[:1]})
    try:
        agree_on_profile(mine, Communicator(StepRecorder()), torch.device("cpu"), failure)
    except (RuntimeError, ValueError) as error:
        cause = error.__cause__
        return f"{type(error).__name__}: {error} | cause: {cause}"
    return "agreed"


@pytest.mark.parametrize("case", ["failed", "layers"])
def test_a_rank_without_a_profile_or_with_other_layers_fails_every_rank(case: str) -> None:
    # Before the agreement on a header, the healthy rank waited in the profile's allreduce.
    first, second = run_workers(profiles_that_disagree, 2, args=(case,), timeout=60)
    if case == "failed":
        assert first.startswith("RuntimeError") and "another rank" in first
        assert "cause: None" in first
        assert second.startswith("RuntimeError") and "on this rank" in second
        assert "cause: out of memory, say" in second
    else:
        for message in (first, second):
            assert message.startswith("ValueError") and "1 to 2 layers" in message


#: An allreduce line that explains little of what was measured: no link can be derived.
NOISY = ClusterCostModel(AlphaBeta(2e-3, 1e-5, r_squared=0.2), CubicCost(1e-4, 1e-9))


def chosen_on_a_noisy_network(
    rank: int, world_size: int, dear_cap_mb: float | None = None
) -> dict[str, Any]:
    net = model()
    auto = dkfac.AutoOptions(
        profile=profile(), cost_model=NOISY, fallback="kaisa", dear_bucket_cap_mb=dear_cap_mb
    )
    pre = dkfac.KFACPreconditioner(net, strategy=auto)
    out = {"plan": pre.plan(), "cap": pre._strategy.comm.bucket_cap_bytes}
    pre.remove()
    return out


@pytest.mark.parametrize("dear_cap_mb", [None, 4.0])
def test_auto_falls_back_and_says_why_when_the_network_cannot_be_predicted(
    dear_cap_mb: float | None,
) -> None:
    assert NOISY.problems()  # the premise: the planners would refuse this line too
    sync = "ddp" if dear_cap_mb is None else "dear"
    for out in run_workers(chosen_on_a_noisy_network, 2, args=(dear_cap_mb,), timeout=60):
        chosen = out["plan"]["chosen"]
        assert out["plan"]["strategy"] == "kaisa" == chosen["strategy"]
        assert chosen["gradient_sync"] == sync
        assert chosen["label"] == ("kaisa" if sync == "ddp" else "kaisa dear")
        assert chosen["ranking"] == []
        assert "without a prediction" in chosen["reason"] and "R²=0.20" in chosen["reason"]
        assert out["cap"] == 25 * 2**20


def test_auto_options_refuse_a_fallback_it_may_not_choose() -> None:
    with pytest.raises(ValueError, match="fallback='dp'"):
        dkfac.AutoOptions(profile=profile(), strategies=("dkfac", "kaisa"), fallback="dp")


def test_the_command_line_chooses_with_dear_averaging_the_gradients(tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "digits", "--batch-size", "32"]
    argv += ["--steps-per-epoch", "3", "--epochs", "1", "--nproc", "2", "--strategy", "auto"]
    assert main([*argv, "--grad-sync", "dear", "--bucket-mb", "auto", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (chosen,) = [r for r in records if r.get("event") == "strategy"]
    # Simulated with DeAR's traffic (or, where a loaded machine's calibration cannot be
    # fitted, its fallback, labelled for DeAR too).
    assert "dear" in chosen["label"].split(), chosen
    assert [r["event"] for r in records if "event" in r][-1] == "epoch"  # it trained
