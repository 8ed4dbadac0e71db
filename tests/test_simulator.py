"""The simulator (dkfac.sim) against hand-computed times: links, profiles, steps."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from dkfac.bench.link_shape import LinkShape
from dkfac.cli.main import main
from dkfac.comm.cost_model import AlphaBeta, CubicCost
from dkfac.curvature.factor_side import DiagonalSide
from dkfac.sim.choice import candidates, kaisa_fractions, rank_candidates
from dkfac.sim.flops import DeviceRates, LayerWork, flop_profile, resnet50_work
from dkfac.sim.link_schedule import LinkSchedule, ScheduledCollective, Stage
from dkfac.sim.network import ETHERNET_PAYLOAD_SHARE, LinkModel, steps, uplink_loads
from dkfac.sim.passes import DearBucket, ddp_buckets, dear_buckets, worker_passes
from dkfac.sim.profile import ComputeProfile, LayerProfile
from dkfac.sim.profiling import device_clock, measure_profile
from dkfac.sim.run import SimulatedCluster, SimulatedRun
from dkfac.sim.timeline import settings_of, simulate
from dkfac.sim.validation import compare_rows
from dkfac.strategies.accounting import account_strategy, plan_strategy
from dkfac.strategies.layer_shapes import LayerShape

MB = 1e6


def test_uplink_loads_and_steps_of_each_collective() -> None:
    n = 1200.0
    assert uplink_loads("allreduce", n, 4) == [1800.0] * 4  # 2(p-1)/p
    assert steps("allreduce", 4) == 6
    assert uplink_loads("reduce_scatter", n, 4) == [900.0] * 4
    assert uplink_loads("all_gather", n, 3) == [800.0] * 3
    assert steps("all_gather", 3) == 2
    # A chain: every member but the last sends the whole payload.
    assert uplink_loads("reduce", n, 3, root=1) == [n, 0.0, n]
    assert uplink_loads("broadcast", n, 3, root=1) == [0.0, n, n]
    assert uplink_loads("broadcast", n, 2, root=0) == [n, 0.0]
    assert uplink_loads("allreduce", n, 1) == [0.0] and steps("allreduce", 1) == 0
    with pytest.raises(ValueError, match="root"):
        uplink_loads("reduce", n, 2)
    with pytest.raises(ValueError, match="root"):
        uplink_loads("allreduce", n, 2, root=0)
    with pytest.raises(ValueError, match="unknown collective"):
        uplink_loads("gather", n, 2)


def test_link_models_from_a_shaped_link_and_from_a_fitted_allreduce() -> None:
    shaped = LinkModel.from_link_shape(LinkShape.parse("100mbit,2ms"), overhead_s=1e-4)
    assert shaped.bytes_per_s == pytest.approx(100e6 / 8 * 1448 / 1514)
    assert pytest.approx(95.64, abs=0.01) == ETHERNET_PAYLOAD_SHARE * 100  # measured: 95.6
    assert shaped.step_latency_s == pytest.approx(2.1e-3)
    # Allreduce of n over P = 4: 6 latencies + 1.5 n / B.
    link = LinkModel(bytes_per_s=1e9, step_latency_s=1e-5)
    assert link.seconds("allreduce", 1e6, 4) == pytest.approx(6e-5 + 1.5e-3)
    fit = link.allreduce_fit(4)
    assert fit.alpha == pytest.approx(6e-5) and fit.beta == pytest.approx(1.5e-9)
    back = LinkModel.from_allreduce_fit(fit, 4)
    assert back.bytes_per_s == pytest.approx(1e9) and back.step_latency_s == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="negative"):
        LinkModel.from_allreduce_fit(AlphaBeta(-1e-3, 1e-9), 2)
    with pytest.raises(ValueError, match="positive"):
        LinkModel(0.0)


def profile(**changes: object) -> ComputeProfile:
    """Two layers; outputs during forward, gradients during backward (last layer first)."""
    layers = (
        LayerProfile("first", 5, 4, 0.02, 0.18, 0.19, 0.0, 0.0, 0.001, 80),
        LayerProfile("second", 9, 6, 0.08, 0.05, 0.06, 0.0, 0.0, 0.002, 216),
    )
    values: dict[str, object] = {
        "device": "test",
        "batch_size": 8,
        "forward_s": 0.1,
        "backward_s": 0.2,
        "optimizer_s": 0.01,
        "factor_update_s": 0.004,
        "decomposition": {"eigen": CubicCost(1e-3, 1e-6)},
        "layers": layers,
        "other_grad_bytes": 40,
    }
    values.update(changes)
    return ComputeProfile(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "spd"])
def test_a_diagonal_factor_travels_in_the_simulator_as_the_strategies_send_it(
    strategy: str,
) -> None:
    # An embedding's A of 50 tokens, held as its diagonal. On a step that only updates
    # factors, the busiest uplink sends DDP's gradients and the factor allreduce the dry run
    # counts (its bytes are checked against real runs in tests/test_embedding_block.py): 50
    # values for the diagonal, not a 50 x 50 triangle.
    embedding = LayerProfile("emb", 50, 4, 0.01, 0.15, 0.16, 0.0, 0.0, 0.001, 800, True)
    given = profile(layers=(embedding, *profile().layers))
    assert given.shapes[0].dims == (50, 4) and isinstance(given.shapes[0].a_dim, DiagonalSide)
    assert ComputeProfile.from_dict(json.loads(json.dumps(given.to_dict()))) == given
    cluster = SimulatedCluster(2, LinkModel(1e6, 1e-4), backend="gloo")
    run = SimulatedRun(strategy, factor_update_steps=1, inv_update_steps=2)

    def factor_step_bytes(layers: ComputeProfile) -> float:
        steps = {step.kind: step for step in simulate(layers, cluster, run).steps}
        return steps["factor"].wire_bytes

    sgd = simulate(given, cluster, SimulatedRun("sgd")).steps[0].wire_bytes
    (account, _) = account_strategy(strategy, given.shapes, settings_of(given, cluster, run))
    factors = account.comm["factor_comm/allreduce"]["wire_bytes"]
    assert factor_step_bytes(given) == sgd + factors
    dense = profile(layers=(dataclasses.replace(embedding, a_diagonal=False), *profile().layers))
    assert factor_step_bytes(dense) == sgd + factors + 4 * (50 * 51 // 2 - 50)


def test_a_profile_round_trips_through_json_and_bad_ones_are_refused(tmp_path) -> None:
    original = profile()
    path = tmp_path / "profile.json"
    original.save(path)
    assert ComputeProfile.load(path) == original
    data = json.loads(path.read_text())
    data["surprise"] = 1
    with pytest.raises(ValueError, match="unknown keys surprise"):
        ComputeProfile.from_dict(data)
    del data["surprise"], data["layers"][0]["g_dim"]
    with pytest.raises(ValueError, match="missing or malformed"):
        ComputeProfile.from_dict(data)
    with pytest.raises(ValueError, match="forward_s must be a finite time"):
        profile(forward_s=-1.0)
    late = dataclasses.replace(original.layers[0], output_grad_s=0.5)
    with pytest.raises(ValueError, match="a gradient is ready after backward ends"):
        profile(layers=(late, original.layers[1]))
    with pytest.raises(ValueError, match="no 'inverse' decomposition"):
        original.decomposition_cost("inverse")


def test_worker_passes_add_the_statistics_of_the_layers_a_worker_captures() -> None:
    costly = profile(
        layers=tuple(
            dataclasses.replace(layer, a_statistic_s=0.01 * (i + 1), g_statistic_s=0.1 * (i + 1))
            for i, layer in enumerate(profile().layers)
        )
    )
    plain = worker_passes(costly, [False, False])
    assert (plain.forward_s, plain.backward_s) == (0.1, 0.2)
    assert plain.a_ready_s == (0.02, 0.08) and plain.grad_ready_s == (0.19, 0.06)
    both = worker_passes(costly, [True, True])
    assert both.forward_s == pytest.approx(0.13) and both.backward_s == pytest.approx(0.5)
    assert both.a_ready_s == pytest.approx((0.03, 0.11))  # each after its own and earlier ones
    # Backward runs the second layer first: its G statistic delays the first layer's.
    assert both.g_ready_s == pytest.approx((0.18 + 0.3, 0.05 + 0.2))
    assert both.grad_ready_s == pytest.approx((0.19 + 0.3, 0.06 + 0.2))
    second_only = worker_passes(costly, [False, True])
    assert second_only.forward_s == pytest.approx(0.12)
    assert second_only.g_ready_s == pytest.approx((0.18 + 0.2, 0.05 + 0.2))


def test_ddp_buckets_fill_in_reverse_layer_order_after_a_small_first_one() -> None:
    passes = worker_passes(profile(), [False, False])
    assert ddp_buckets(profile(), passes, cap_bytes=1000) == [(0.2, 216 + 80 + 40)]
    # A cap below both layers: the second layer's bucket goes when its gradient exists.
    assert ddp_buckets(profile(), passes, cap_bytes=100) == [(0.06, 216), (0.2, 80 + 40)]
    big = profile(
        layers=tuple(dataclasses.replace(layer, grad_bytes=2**19 + 8) for layer in profile().layers)
    )
    # DDP closes a bucket once it holds at least its cap: the first (1 MiB) with both
    # layers, when the first layer's gradient exists; the other parameters go last.
    assert ddp_buckets(big, passes, cap_bytes=25 * 2**20) == [
        (passes.grad_ready_s[0], 2**20 + 16),
        (0.2, 40),
    ]
    assert passes.grad_ready_s[0] == pytest.approx(0.19)


def test_sgd_step_is_forward_backward_allreduce_optimizer() -> None:
    link = LinkModel(bytes_per_s=1000.0, step_latency_s=0.001)
    cluster = SimulatedCluster(2, link, backend="nccl")
    predicted = simulate(profile(), cluster, SimulatedRun("sgd")).iteration_s
    allreduce = (216 + 80 + 40) / 1000.0 + 2 * 0.001  # 2(P-1)/P = 1 at P = 2
    assert predicted == pytest.approx(0.1 + 0.2 + allreduce + 0.01)
    # A fast link: the step is compute only (the allreduce starts at the backward's end).
    fast = SimulatedCluster(2, LinkModel(1e12), backend="nccl")
    assert simulate(profile(), fast, SimulatedRun("sgd")).iteration_s == pytest.approx(0.31)


def test_dear_buckets_follow_its_plan_and_launch_last_bucket_first() -> None:
    passes = worker_passes(profile(), [False, False])
    # A 25 MiB cap: one bucket holds everything, sent when the backward ends (the parameters
    # outside the layers are ready only then).
    assert dear_buckets(profile(), passes, 25.0) == [DearBucket(0, 0.2, 216 + 80 + 40)]
    # The other parameters (40 bytes) come first: a 130-byte cap puts them with the first
    # layer, a 100-byte one alone; the first bucket launches after the second.
    assert dear_buckets(profile(), passes, 130 / 2**20) == [
        DearBucket(0, 0.2, 40 + 80),
        DearBucket(1, 0.06, 216),
    ]
    tiny = 100 / 2**20  # MiB
    assert dear_buckets(profile(), passes, tiny) == [
        DearBucket(0, 0.2, 40),
        DearBucket(0, 0.19, 80),
        DearBucket(1, 0.06, 216),
    ]
    # A first bucket ready before the second still waits for the second's launch.
    early = profile(
        other_grad_bytes=0,
        layers=(dataclasses.replace(profile().layers[0], grad_ready_s=0.03), profile().layers[1]),
    )
    early_passes = worker_passes(early, [False, False])
    assert dear_buckets(early, early_passes, tiny) == [
        DearBucket(0, 0.06, 80),
        DearBucket(1, 0.06, 216),
    ]


def test_sgd_with_dear_gathers_under_the_next_forward_and_scatters_under_backward() -> None:
    link = LinkModel(bytes_per_s=1000.0, step_latency_s=0.001)
    cluster = SimulatedCluster(2, link, backend="nccl")
    run = SimulatedRun("sgd", gradient_sync="dear", dear_bucket_cap_mb=100 / 2**20)
    step = simulate(profile(), cluster, run).steps[0]
    # Last step's all-gathers from t = 0, first bucket first, one at a time (NCCL): each
    # member sends half of a bucket after one latency. Buckets: the other parameters (40
    # bytes), the first layer (80), the second (216).
    gathered = [0.001 + 20 / 1000]
    gathered.append(gathered[-1] + 0.001 + 40 / 1000)
    gathered.append(gathered[-1] + 0.001 + 108 / 1000)
    # The forward waits for each bucket before its first layer (the first two: layer 0 at
    # t = 0; the third: layer 1, reached 0.02 s into the pass) and applies its share of the
    # optimizer step (by bytes) there.
    delay = 0.0
    for done, start, nbytes in zip(gathered, (0.0, 0.0, 0.02), (40, 80, 216), strict=True):
        delay = max(start + delay, done) - start + 0.01 * nbytes / 336
    forward = 0.1 + delay
    # Reduce-scatters, last bucket first: the second layer's when its gradient exists
    # (0.06 s into the backward), the first layer's at 0.19 s, the others' at the end.
    scatter_2 = forward + 0.06 + 0.001 + 108 / 1000
    scatter_1 = max(scatter_2, forward + 0.19) + 0.001 + 40 / 1000
    scatter_0 = max(scatter_1, forward + 0.2) + 0.001 + 20 / 1000
    assert step.seconds == pytest.approx(max(forward + 0.2, scatter_0))
    assert step.stages["optimizer"] == 0.0  # inside the forward pass
    # On gloo a group runs two collectives at once: both all-gathers (two buckets at a
    # 130-byte cap: 120 and 216 bytes) start together and share the uplinks.
    gloo = SimulatedCluster(2, link, backend="gloo")
    two = SimulatedRun("sgd", gradient_sync="dear", dear_bucket_cap_mb=130 / 2**20)
    gathered_0 = 0.001 + 60 / 500  # half the link each until the first is done
    gathered_1 = gathered_0 + (108 - 60) / 1000
    delay = gathered_0 + 0.01 * 120 / 336
    delay = max(0.02 + delay, gathered_1) - 0.02 + 0.01 * 216 / 336
    forward = 0.1 + delay
    scatter_0 = forward + 0.2 + 0.001 + 60 / 1000  # the other one is done by then
    assert simulate(profile(), gloo, two).iteration_s == pytest.approx(scatter_0)
    ddp = simulate(profile(), cluster, SimulatedRun("sgd")).iteration_s
    assert ddp == pytest.approx(0.1 + 0.2 + 0.336 + 0.002 + 0.01) and step.seconds < ddp
    # A fast link: forward, backward and the optimizer, whichever pass holds it.
    fast = SimulatedCluster(2, LinkModel(1e12), backend="nccl")
    assert simulate(profile(), fast, run).iteration_s == pytest.approx(0.31)


def test_kfac_with_dear_gathers_the_gradients_before_preconditioning() -> None:
    link = LinkModel(bytes_per_s=1000.0, step_latency_s=0.001)
    cluster = SimulatedCluster(2, link, backend="nccl")
    dear = simulate(profile(), cluster, SimulatedRun("dkfac", gradient_sync="dear")).steps[0]
    ddp = simulate(profile(), cluster, SimulatedRun("dkfac")).steps[0]
    # One bucket: its reduce-scatter at the backward's end, then its all-gather at once.
    assert dear.stages["forward_backward"] == pytest.approx(0.3 + 0.001 + 0.168)
    assert dear.stages["gradient_gather"] == pytest.approx(0.001 + 0.168)
    # At P = 2 the two halves move what one allreduce moves, in as many latencies: the
    # K-FAC stages that follow start at the same time, and the step takes as long.
    assert ddp.stages["forward_backward"] == pytest.approx(0.3 + 0.002 + 0.336)
    assert dear.seconds == pytest.approx(ddp.seconds)
    assert dear.stages["optimizer"] == ddp.stages["optimizer"] == 0.01
    with pytest.raises(ValueError, match="gradient_sync='allreduce'"):
        SimulatedRun("sgd", gradient_sync="allreduce")
    assert SimulatedRun("sgd", gradient_sync="dear").label == "sgd dear"
    assert SimulatedRun("pad", gradient_sync="dear").label == "pad auto dear (1,1)"


def eigen_bytes(dim: int) -> int:
    """Bytes of one factor's eigendecomposition (float32): Q and the eigenvalues."""
    return 4 * (dim * dim + dim)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_dkfac_step_stage_by_stage(backend: str) -> None:
    link = LinkModel(bytes_per_s=1e4, step_latency_s=0.001)
    cluster = SimulatedCluster(2, link, backend=backend)
    step = simulate(profile(), cluster, SimulatedRun("dkfac")).steps[0]
    dims = [5, 4, 9, 6]
    # Factors: one fused allreduce of the upper triangles and one of the float64 counts. gloo
    # runs both at once (two threads per group): their latencies overlap and they share the
    # uplinks; NCCL's one stream runs them one after the other.
    factors = sum(d * (d + 1) // 2 for d in dims) * 4
    counts = 8 * len(dims)
    latencies = 2 if backend == "gloo" else 4
    exchange = factors / 1e4 + counts / 1e4 + latencies * 0.001
    assert step.stages["factor_exchange"] == pytest.approx(exchange + 0.004)  # + folding
    # D-KFAC balances the decompositions over the two ranks; each broadcasts its own, once
    # both ranks have decomposed theirs (both are members of every broadcast). On gloo each
    # source has its own lane (open_lanes), so the two broadcasts (on different uplinks)
    # travel at once; NCCL's one stream sends them one after the other.
    prof = profile()
    placement = plan_strategy(
        "dkfac", prof.shapes, settings_of(prof, cluster, SimulatedRun("dkfac"))
    )
    loads, work = [0, 0], [0.0, 0.0]
    for route in placement.factors:
        loads[route.decomposed_by] += eigen_bytes(route.dim)
        work[route.decomposed_by] += 1e-3 + 1e-6 * route.dim**3
    for layer in range(2):  # a layer's payload carries one validity flag (float32)
        loads[placement.route((layer, "a")).decomposed_by] += 4
    assert loads[0] and loads[1]
    if backend == "gloo":
        broadcasts = max(loads) / 1e4 + 0.001
    else:
        broadcasts = sum(loads) / 1e4 + 2 * 0.001
    assert step.stages["decompositions"] == pytest.approx(max(work) + broadcasts)


def test_a_schedule_averages_its_kinds_of_step() -> None:
    cluster = SimulatedCluster(2, LinkModel(1e5, 1e-4), backend="gloo")
    prediction = simulate(profile(), cluster, SimulatedRun("kaisa", 0.5, "auto", 10, 100))
    kinds = {step.kind: step for step in prediction.steps}
    assert [(k, round(s.share, 6)) for k, s in kinds.items()] == [
        ("decomposition", 0.01),
        ("factor", 0.09),
        ("precondition", 0.9),
    ]
    expected = sum(step.share * step.seconds for step in prediction.steps)
    assert prediction.iteration_s == pytest.approx(expected)
    assert kinds["precondition"].seconds < kinds["factor"].seconds < kinds["decomposition"].seconds


def test_spd_hides_its_factors_under_backward_where_dkfac_waits_for_them() -> None:
    # Factors ready early in a long backward: SPD's hook-launched buckets finish under it.
    slow_backward = profile(backward_s=2.0, factor_update_s=0.0)
    cluster = SimulatedCluster(2, LinkModel(1e4, 1e-4), backend="gloo")
    dkfac = simulate(slow_backward, cluster, SimulatedRun("dkfac")).steps[0]
    spd = simulate(slow_backward, cluster, SimulatedRun("spd")).steps[0]
    assert spd.stages["factor_exchange"] < 0.2 * dkfac.stages["factor_exchange"]
    assert spd.seconds < dkfac.seconds


def test_simulated_runs_refuse_bad_schedules_and_clusters() -> None:
    with pytest.raises(ValueError, match="multiple"):
        SimulatedRun("dkfac", factor_update_steps=10, inv_update_steps=15)
    with pytest.raises(ValueError, match="at least 2 workers"):
        SimulatedCluster(1, LinkModel(1e9))
    with pytest.raises(ValueError, match="backend"):
        SimulatedCluster(2, LinkModel(1e9), backend="mpi")


def test_dkfac_simulate_prints_the_table_and_writes_json_and_chart(tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    profile().save(path)
    out = tmp_path / "sim"
    argv = ["simulate", "--profile", str(path), "--network", "100mbit,20us", "--world-sizes"]
    argv += ["2,4", "--strategies", "sgd,dkfac,pad", "--schedules", "1:1", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "P=2" in printed and "P=4" in printed and "pad auto (1,1)" in printed
    report = json.loads((out / "simulate.json").read_text())
    assert [(r["world_size"], r["label"]) for r in report["rows"]] == [
        (p, label) for p in (2, 4) for label in ("sgd", "dkfac (1,1)", "pad auto (1,1)")
    ]
    # The JSON's rows are what simulate() predicts for the same inputs.
    link = LinkModel.from_link_shape(LinkShape.parse("100mbit,20us"))
    expected = simulate(profile(), SimulatedCluster(4, link), SimulatedRun("dkfac"))
    assert report["rows"][4]["iteration_s"] == pytest.approx(expected.iteration_s)
    assert ComputeProfile.from_dict(report["profile"]) == profile()
    # Every row averaging its gradients with DeAR.
    assert main([*argv, "--grad-sync", "dear"]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert report["rows"][0]["label"] == "sgd dear"
    dear = SimulatedRun("sgd", gradient_sync="dear")
    expected = simulate(profile(), SimulatedCluster(2, link), dear)
    assert report["rows"][0]["iteration_s"] == pytest.approx(expected.iteration_s)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--network", "fast"], "--network fast"),
        (["--world-sizes", "1,2"], "world sizes must lie in [2, 1024]"),
        (["--strategies", "sgd,adam"], "unknown strategies ['adam']"),
        (["--schedules", "10:15"], "multiple"),
        (["--schedules", "10:ten"], "'10:ten': expected FACTOR:INVERSE"),
        (["--world-sizes", "0-4"], "'0-4': a range LOW-HIGH needs 1 <= LOW <= HIGH"),
        (["--world-sizes", "2,four"], "'2,four': expected P,P,... or LOW-HIGH"),
        (["--amp", "bf16"], "--amp applies to --profile-here only"),
    ],
)
def test_dkfac_simulate_refuses_bad_options_in_one_line(
    tmp_path, capsys, argv: list[str], message: str
) -> None:
    path = tmp_path / "profile.json"
    profile().save(path)
    assert main(["simulate", "--profile", str(path), "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decomposition": None}, "'decomposition' must be an object"),
        ({"decomposition": {"eigen": {"c0_s": "x", "c3_s": 1}}}, "malformed decomposition"),
        ({"batch_size": "8"}, "batch_size must be int, got '8'"),
        ({"forward_s": None}, "forward_s must be float, got None"),
        ({"layers": [["first"]]}, "malformed entry"),
        ({"layers": [dict(profile().to_dict()["layers"][0], a_dim=5.5)]}, "a_dim must be int"),
    ],
)
def test_a_malformed_profile_file_is_refused_in_one_line(
    tmp_path, capsys, change: dict[str, object], message: str
) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**profile().to_dict(), **change}))
    assert main(["simulate", "--profile", str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and f"--profile {path}" in err and "Traceback" not in err


def test_dkfac_simulate_refuses_a_missing_profile(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.json"
    assert main(["simulate", "--profile", str(missing), "--out", str(tmp_path)]) == 2
    assert f"--profile {missing}" in capsys.readouterr().err


def test_a_profile_measured_here_has_every_layer_in_order() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.BatchNorm1d(5))
    batch = (torch.randn(16, 6), torch.randint(0, 5, (16,)))
    measured = measure_profile(model, batch, nn.functional.cross_entropy, steps=2, warmup=1)
    dims = [(layer.name, layer.a_dim, layer.g_dim) for layer in measured.layers]
    assert dims == [("0", 7, 8), ("2", 9, 5)]
    assert [layer.grad_bytes for layer in measured.layers] == [4 * 7 * 8, 4 * 9 * 5]
    assert measured.other_grad_bytes == 4 * 10  # the batch norm's weight and bias
    first, second = measured.layers
    assert first.output_s < second.output_s <= measured.forward_s  # forward order
    assert second.output_grad_s < first.output_grad_s <= measured.backward_s  # backward order
    assert second.grad_ready_s < first.grad_ready_s <= measured.backward_s
    assert all(layer.a_statistic_s >= 0 and layer.g_statistic_s >= 0 for layer in measured.layers)
    assert measured.batch_size == 16 and measured.problems() == []
    assert measured.decomposition["eigen"].c3 > 0


class AutocastRecorder(nn.Linear):
    """A linear layer that records the autocast dtype its forward ran under (None: off)."""

    def __init__(self) -> None:
        super().__init__(6, 5)
        self.seen: list[torch.dtype | None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on = torch.is_autocast_enabled("cpu")
        self.seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return super().forward(x)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_profile_measures_the_forward_under_the_autocast_it_is_given(
    autocast: torch.dtype | None,
) -> None:
    model = AutocastRecorder()
    batch = (torch.randn(8, 6), torch.randint(0, 5, (8,)))
    loss = nn.functional.cross_entropy
    # No decomposition timed (methods=()): what is tested is the autocast of the forward
    # passes, and a fit of decomposition times is a judgement on the machine's load (R² =
    # 0.79 < 0.8 failed this test once in a fresh-clone CI run on 2 busy cores).
    measured = measure_profile(model, batch, loss, steps=2, warmup=1, autocast=autocast, methods=())
    assert model.seen == [autocast] * 6  # every step, plain and with K-FAC
    assert measured.notes["autocast"] == (None if autocast is None else "bfloat16")
    with pytest.raises(ValueError, match=r"autocast=torch\.float32: expected"):
        measure_profile(model, batch, loss, autocast=torch.float32)


def test_dkfac_simulate_profiles_here_under_autocast(tmp_path, capsys, monkeypatch) -> None:
    # What is tested is the autocast reaching the saved profile. The refusal of a profile
    # whose decomposition times fit their cubic poorly is a judgement on the machine's load
    # (two suites at once on 2 cores measured R² = 0.67 and failed here), tested with its
    # numbers in test_cost_model.py: this test does not depend on it.
    monkeypatch.setattr("dkfac.comm.cost_model.MIN_R_SQUARED", 0.0)
    argv = ["simulate", "--profile-here", "--model", "resnet20", "--batch-size", "4"]
    argv += ["--world-sizes", "2", "--strategies", "sgd", "--out", str(tmp_path)]
    saved = tmp_path / "profile.json"
    assert main([*argv, "--amp", "bf16", "--save-profile", str(saved)]) == 0
    assert ComputeProfile.load(saved).notes["autocast"] == "bfloat16"


def test_on_a_gpu_every_profile_clock_reading_waits_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the wait, a stamp is when the work was queued: launch times, not compute times.
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    gpu = torch.device("cuda", 1)
    first = device_clock(gpu)()
    second = device_clock(gpu)()
    assert waited == [gpu, gpu] and second >= first
    device_clock(torch.device("cpu"))()
    assert waited == [gpu, gpu]  # nothing to wait for on the CPU


def test_collectives_in_flight_share_the_uplinks_they_load() -> None:
    cluster = SimulatedCluster(2, LinkModel(bytes_per_s=100.0), backend="nccl")
    both = (0, 1)

    def collective(op: str, root: int | None, lane: str, at: float = 0.0) -> ScheduledCollective:
        return ScheduledCollective(op, 100, both, root, (lane,), dict.fromkeys(both, at))

    # Two allreduces of different groups load both uplinks: each gets half of them.
    first, second = collective("allreduce", None, "ddp"), collective("allreduce", None, "kfac")
    assert LinkSchedule(cluster).run([first, second]) == [2.0, 2.0]
    # Broadcasts from either rank load different uplinks: no sharing.
    out, back = collective("broadcast", 0, "a"), collective("broadcast", 1, "b")
    assert LinkSchedule(cluster).run([out, back]) == [1.0, 1.0]
    # One group's collectives run one at a time on NCCL's stream (gloo: two at a time).
    one_lane = [collective("allreduce", None, "a"), collective("allreduce", None, "a")]
    assert LinkSchedule(cluster).run(one_lane) == [1.0, 2.0]
    gloo = SimulatedCluster(2, LinkModel(bytes_per_s=100.0), backend="gloo")
    one_lane = [collective("allreduce", None, "a"), collective("allreduce", None, "a")]
    assert LinkSchedule(gloo).run(one_lane) == [2.0, 2.0]
    # A later arrival slows what is still in flight: the first has half left at t = 0.5.
    schedule = LinkSchedule(cluster)
    early, late = collective("allreduce", None, "x"), collective("allreduce", None, "y", 0.5)
    assert schedule.run([early, late]) == [1.5, 2.0]
    # A second call starts from where the first left off, on the same lanes.
    again = collective("allreduce", None, "x", 1.0)
    assert schedule.run([again]) == [3.0]


def test_each_worker_moves_to_its_next_stage_when_its_own_collectives_are_done() -> None:
    """Four workers in two groups: the fast group's next stage does not wait for the slow one."""
    cluster = SimulatedCluster(4, LinkModel(bytes_per_s=100.0), backend="nccl")

    def pair(members: tuple[int, int], nbytes: int) -> ScheduledCollective:
        return ScheduledCollective("allreduce", nbytes, members, None, (members,), {})

    fast, slow = pair((0, 1), 100), pair((2, 3), 300)  # 1 s and 3 s on their uplinks
    fast_next = pair((0, 1), 100)
    compute = [0.5, 0.5, 0.0, 0.0]
    stages = [
        Stage("exchange", [fast, slow], [fast, slow], [0.0] * 4, compute),
        Stage("next", [fast_next], [fast_next], [0.25] * 4, [0.0] * 4),
    ]
    ends = LinkSchedule(cluster).run_stages(stages, [0.0, 0.0, 1.0, 1.0])
    assert ends[0] == [1.5, 1.5, 4.0, 4.0]  # done, then 0.5 s of compute on 0 and 1
    # Workers 0 and 1 issue again at 1.75 and are done at 2.75; 2 and 3 have nothing to do.
    assert ends[1] == [2.75, 2.75, 4.25, 4.25]
    assert fast_next.issued == {0: 1.75, 1: 1.75} and fast_next.done_at == 2.75


def test_packing_buckets_costs_each_member_its_payload_at_the_profiled_rate() -> None:
    cluster = SimulatedCluster(2, LinkModel(1e4, 0.001), backend="nccl")
    free = simulate(profile(), cluster, SimulatedRun("dkfac")).steps[0]
    packed = simulate(profile(pack_bytes_per_s=1e3), cluster, SimulatedRun("dkfac")).steps[0]
    factors = sum(d * (d + 1) // 2 for d in (5, 4, 9, 6)) * 4 + 8 * 4  # and the counts
    assert packed.stages["factor_exchange"] == pytest.approx(
        free.stages["factor_exchange"] + factors / 1e3
    )
    sgd = SimulatedRun("sgd")
    assert simulate(profile(pack_bytes_per_s=1e3), cluster, sgd).iteration_s == pytest.approx(
        simulate(profile(), cluster, sgd).iteration_s
    )  # DDP's buckets are DDP's own


def test_validation_predicts_each_row_as_the_benchmark_ran_it() -> None:
    """Rate, delay, bucket cap and PAD's share come from the benchmark's JSON."""
    row = {
        "model": "m",
        "rate": "1mbit",
        "rate_bit_s": 1e6,
        "nprocs": 2,
        "strategy": "pad",
        "grad_worker_fraction": 1.0,
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "inverse_method": "eigen",
        "gradient_sync": "ddp",
        "median_s": 2.0,
        "amortized_s": 2.0,
        "pad_share": "decompositions",
    }
    link = {"rate_bit_s": 1e6, "delay_s": 0.002}
    settings = {"batch_size_per_worker": 8, "bucket_cap_mb": 1e-4, "network": [link]}
    [compared] = compare_rows([row], {"m": profile()}, settings)
    cluster = SimulatedCluster(
        2, LinkModel.from_link_shape(LinkShape(1e6, 0.002)), backend="gloo", bucket_cap_mb=1e-4
    )
    expected = simulate(profile(), cluster, SimulatedRun("pad", share="decompositions"))
    assert compared["predicted_s"] == pytest.approx(expected.iteration_s)
    assert compared["error"] == pytest.approx(expected.iteration_s / 2.0 - 1.0)
    plain = simulate(profile(), SimulatedCluster(2, LinkModel(1e6 / 8)), SimulatedRun("pad"))
    assert abs(plain.iteration_s - expected.iteration_s) > 0.01  # the settings mattered
    with pytest.raises(ValueError, match=r"profile is of batch size 8; .* ran 32"):
        compare_rows([row], {"m": profile()}, {**settings, "batch_size_per_worker": 32})
    # SGD with DeAR, at the bucket cap its search kept (the middle of its rounds').
    dear_row = {**row, "strategy": None, "gradient_sync": "dear", "dear_bucket_cap_mb": [1, 2, 1]}
    [compared] = compare_rows([dear_row], {"m": profile()}, settings)
    run = SimulatedRun("sgd", gradient_sync="dear", dear_bucket_cap_mb=1.0)
    assert compared["label"] == "sgd dear"
    assert compared["predicted_s"] == pytest.approx(simulate(profile(), cluster, run).iteration_s)
    tiny = SimulatedRun("sgd", gradient_sync="dear", dear_bucket_cap_mb=1e-4)
    assert simulate(profile(), cluster, tiny).iteration_s != compared["predicted_s"]


def test_a_flop_profile_shares_the_passes_by_multiply_adds() -> None:
    rates = DeviceRates("toy", 100.0, 1e9, 1e8, CubicCost(1e-3, 1e-9), CubicCost(1e-4, 1e-10))
    work = [LayerWork(LayerShape("conv", 9, 4), 10), LayerWork(LayerShape("fc", 5, 2), 1)]
    derived = flop_profile(work, rates, batch_size=2, other_grad_bytes=8, inverse_method="inverse")
    # 2 samples at 100/s: 0.02 s, a third forward; multiply-adds 2·2·10·9·4 and 2·2·1·5·2.
    forward, backward, conv, fc = 0.02 / 3, 0.04 / 3, 1440 / 1480, 40 / 1480
    assert derived.forward_s == pytest.approx(forward)
    assert derived.backward_s == pytest.approx(backward)
    first, second = derived.layers
    assert [first.output_s, second.output_s] == pytest.approx([conv * forward, forward])
    # The last layer's gradient arrives first.
    assert second.output_grad_s == 0.0 and second.grad_ready_s == pytest.approx(fc * backward)
    assert first.output_grad_s == pytest.approx(fc * backward)
    assert first.grad_ready_s == pytest.approx(backward)
    # A statistic: 20 rows x 9 read and written at 1e8 B/s, then 2·20·81 FLOPs at 1e9.
    assert first.a_statistic_s == pytest.approx(2 * 4 * 20 * 9 / 1e8 + 2 * 20 * 81 / 1e9)
    assert second.g_statistic_s == pytest.approx(2 * 4 * 2 * 2 / 1e8 + 2 * 2 * 4 / 1e9)
    assert second.precondition_s == pytest.approx(2 * (4 * 5 + 2 * 25) / 1e9)
    eigen = flop_profile(work, rates, batch_size=2, other_grad_bytes=8)  # four products
    assert eigen.layers[1].precondition_s == pytest.approx(4 * (4 * 5 + 2 * 25) / 1e9)
    assert [first.grad_bytes, second.grad_bytes] == [144, 40]
    assert derived.optimizer_s == pytest.approx(5 * (144 + 40 + 8) / 1e8)
    assert derived.factor_update_s == pytest.approx(3 * 4 * (81 + 16 + 25 + 4) / 1e8)
    assert derived.pack_bytes_per_s == 5e7
    assert derived.decomposition_cost("eigen") == CubicCost(1e-3, 1e-9)
    with pytest.raises(ValueError, match="positive"):
        DeviceRates("none", 0.0, 1e9, 1e8, CubicCost(0, 1e-9), CubicCost(0, 1e-9))
    # Statistics from half of a batch of 5: ⌈2.5⌉ = 3 examples, 30 patch rows (floor or
    # round would keep 2); preconditioning and the passes do not depend on it.
    whole = flop_profile(work, rates, batch_size=5)
    half = flop_profile(work, rates, batch_size=5, statistics_fraction=0.5)
    conv = half.layers[0]
    assert conv.a_statistic_s == pytest.approx(2 * 4 * 30 * 9 / 1e8 + 2 * 30 * 81 / 1e9)
    assert conv.g_statistic_s == pytest.approx(2 * 4 * 30 * 4 / 1e8 + 2 * 30 * 16 / 1e9)
    for cut, full in zip(half.layers, whole.layers, strict=True):
        assert (cut.precondition_s, cut.output_s) == (full.precondition_s, full.output_s)
    assert half.notes["statistics_fraction"] == 0.5 and "statistics_fraction" not in whole.notes
    # An embedding's diagonal A (its counts) comes from the whole call, its G from the part.
    embedding = LayerWork(LayerShape("emb", DiagonalSide(6), 4), 1)
    table = flop_profile([embedding], rates, 5, statistics_fraction=0.5)
    assert table.layers[0].a_statistic_s == pytest.approx(2 * 4 * 5 * 6 / 1e8)
    assert table.layers[0].g_statistic_s == pytest.approx(2 * 4 * 3 * 4 / 1e8 + 2 * 3 * 16 / 1e9)
    with pytest.raises(ValueError, match="statistics_fraction=0"):
        flop_profile(work, rates, batch_size=2, statistics_fraction=0)


def test_resnet50_work_has_imagenet_multiply_adds_and_resolutions() -> None:
    work = {item.shape.name: item for item in resnet50_work()}
    assert len(work) == 54
    # 4.09 G multiply-adds per 224x224 image (the published ResNet-50 figure).
    assert sum(item.forward_flops(1) for item in work.values()) / 2 == pytest.approx(
        4.09e9, rel=1e-2
    )
    assert work["conv1"].positions == 112 * 112
    assert work["layer2.0.conv1"].positions == 56 * 56  # before the stride
    assert work["layer2.0.conv2"].positions == 28 * 28
    assert work["layer4.2.conv3"].positions == 7 * 7 and work["fc"].positions == 1


def test_a_profile_refuses_a_layer_that_does_not_run() -> None:
    class Spare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    with pytest.raises(ValueError, match=r"layers \['spare'\] did not run"):
        measure_profile(Spare(), batch, nn.functional.cross_entropy, steps=1, warmup=0)


def test_auto_candidates_cover_the_strategies_fractions_and_caps() -> None:
    assert kaisa_fractions(8) == [0.125, 0.25, 0.5, 1.0]
    template = SimulatedRun("dkfac", factor_update_steps=10, inv_update_steps=100)
    found = candidates(template, 8, bucket_caps_mb=(25.0,))
    assert [(c.run.strategy, c.run.grad_worker_fraction) for c in found] == [
        ("dkfac", 1.0),
        ("kaisa", 0.125),
        ("kaisa", 0.25),
        ("kaisa", 0.5),
        ("spd", 1.0),
        ("pad", 1.0),
        ("dp", 1.0),
    ]
    assert all(c.run.inv_update_steps == 100 for c in found)  # the run's schedule kept
    # At P = 64 KAISA is tried at four fractions: both ends and two between.
    wide = candidates(template, 64, strategies=("kaisa",), bucket_caps_mb=(25.0, 4.0))
    fractions = sorted({c.run.grad_worker_fraction for c in wide})
    assert fractions == [1 / 64, 1 / 16, 1 / 8, 1 / 2] and len(wide) == 8
    with pytest.raises(ValueError, match="auto chooses among"):
        candidates(template, 8, strategies=("sgd",))


def test_ranking_is_every_candidates_simulated_time_fastest_first() -> None:
    cluster = SimulatedCluster(2, LinkModel(1e4, 0.001), backend="gloo")
    options = candidates(SimulatedRun("dkfac"), 2, bucket_caps_mb=(25.0, 1e-4))
    ranked = rank_candidates(profile(), cluster, options)
    expected = sorted(
        simulate(
            profile(), dataclasses.replace(cluster, bucket_cap_mb=c.bucket_cap_mb), c.run
        ).iteration_s
        for c in options
    )
    assert [r.iteration_s for r in ranked] == pytest.approx(expected)
    assert {r.candidate for r in ranked} == set(options)
    # Equal candidates keep their order: every rank ranking the same inputs agrees.
    twins = [options[0], dataclasses.replace(options[0])]
    assert [r.candidate for r in rank_candidates(profile(), cluster, twins)] == twins
    assert ranked[0].as_dict()["iteration_s"] == ranked[0].iteration_s


def test_the_link_speed_flips_which_strategy_auto_chooses() -> None:
    """On a slow link DP-KFAC's broadcasts of preconditioned gradients, which travel after all
    the compute, cost more than everything SPD adds to DP's passes (its factors partly travel
    under the backward pass): SPD wins. On a fast link traffic costs latencies only and
    DP-KFAC, which computes and decomposes only its own layers' factors, wins."""
    options = candidates(SimulatedRun("dkfac"), 2, bucket_caps_mb=(25.0,))
    chosen, steps = {}, {}
    for bytes_per_s in (1e3, 1e6):
        cluster = SimulatedCluster(2, LinkModel(bytes_per_s, 1e-3), backend="gloo")
        ranked = rank_candidates(profile(), cluster, options)
        # The choice is the fastest of the candidates simulated one by one.
        times = {c.run.label: simulate(profile(), cluster, c.run).iteration_s for c in options}
        assert ranked[0].candidate.run.label == min(times, key=times.__getitem__)
        assert ranked[1].iteration_s > ranked[0].iteration_s * 1.005  # not a near tie
        chosen[bytes_per_s] = ranked[0].candidate.run.strategy
        for name in ("spd", "dp"):
            steps[name, bytes_per_s] = simulate(profile(), cluster, SimulatedRun(name)).steps[0]
    assert chosen == {1e3: "spd", 1e6: "dp"}
    slow_dp, slow_spd = steps["dp", 1e3], steps["spd", 1e3]
    assert slow_dp.wire_bytes < slow_spd.wire_bytes  # DP sends less, but after the compute
    spd_over_dp_passes = slow_spd.seconds - slow_dp.stages["forward_backward"] - 0.01
    assert slow_dp.stages["gradients"] > spd_over_dp_passes
    fast_dp, fast_spd = steps["dp", 1e6], steps["spd", 1e6]
    assert fast_dp.stages["gradients"] < slow_dp.stages["gradients"] / 20
    assert fast_dp.stages["decompositions"] < fast_spd.stages["decompositions"]
