"""Dry-run accounting (single process): hand-computed bytes and memory, agreement with the
analytic byte counts the distributed tests assert on real runs, ResNet-50's shapes, and the
``--layers resnet50`` front ends."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dkfac.bench.dry_run import NOMINAL_COST_MODEL, dry_run_report, format_dry_run
from dkfac.bench.targets import NO_TARGETS_LINE, load_targets
from dkfac.cli.main import main as dkfac_main
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.factor_side import DiagonalSide
from dkfac.strategies import dp
from dkfac.strategies.accounting import DryRunSettings, account_strategy, summarize_accounts
from dkfac.strategies.factor_placement import choose_share
from dkfac.strategies.layer_shapes import (
    LayerShape,
    conv2d_shape,
    layer_shapes_of,
    linear_shape,
    resnet50_layer_shapes,
)
from dkfac.strategies.pad import PADStrategy
from dkfac.strategies.pipeline import ready_order_of
from dkfac.strategies.spd import SPDStrategy
from test_benchmarks_smoke import _load_strategies
from test_distributed import configurations, entry, expected_bytes, tri, uneven_model
from test_pipelined import COST, expected_broadcast, expected_gradients, fused
from test_placement import resnet50_factor_dims

TINY = [LayerShape("l0", 3, 2), LayerShape("l1", 5, 4)]
ROOT = Path(__file__).resolve().parents[1]
TARGETS_FILE = ROOT / "benchmarks" / "targets.json"
DRY_RUN_TARGET = load_targets(TARGETS_FILE).dry_run_target


def test_dkfac_and_dp_on_two_layers_at_p2_by_hand() -> None:
    settings = DryRunSettings(2)  # float32 factors, decompositions and gradients; eigen
    # Owners (LPT, larger cost first to worker 0): l1 -> 0, l0 -> 1, for both strategies
    # (dkfac: d_A³+d_G³ = 189 vs 35; dp adds d_G·d_A·(d_G+d_A): 369 vs 65).
    dkfac = account_strategy("dkfac", TINY, settings)
    for account in dkfac:
        assert account.comm == {
            # 4 float64 counts (32 B) + the upper triangles 6+3+15+10 = 34 float32 (136 B);
            # an allreduce sends 2(P-1)/P = 1x its payload.
            "factor_comm/allreduce": {"bytes": 32 + 136, "calls": 2, "wire_bytes": 32 + 136},
            # Owner 0 sends l1: Q_A 25 + λ_A 5 + Q_G 16 + λ_G 4 + flag 1 = 51 values (204 B);
            # owner 1 sends l0: 9 + 3 + 4 + 2 + 1 = 19 values (76 B); a broadcast sends 1/2.
            "inverse_comm/broadcast": {"bytes": 204 + 76, "calls": 2, "wire_bytes": 102 + 38},
        }
        # Every factor (9+4+25+16 values) and every decomposition (18+50 values), float32.
        assert (account.factor_bytes, account.inverse_bytes) == (4 * 54, 4 * 68)
    assert [a.decomposition_work for a in dkfac] == [125 + 64, 27 + 8]

    dp_accounts = account_strategy("dp", TINY, settings)
    for account in dp_accounts:
        # One broadcast per owner of its preconditioned gradients: l1 4x5 (80 B), l0 2x3 (24 B).
        assert account.comm == {
            "grad_comm/broadcast": {"bytes": 80 + 24, "calls": 2, "wire_bytes": 40 + 12}
        }
    # Owners hold only their layers: rank 0 l1 (25+16 | 25+5+16+4), rank 1 l0 (9+4 | 9+3+4+2).
    assert [(a.factor_bytes, a.inverse_bytes) for a in dp_accounts] == [
        (4 * 41, 4 * 50),
        (4 * 13, 4 * 18),
    ]
    assert [a.memory_bytes for a in dp_accounts] == [364, 124]
    assert [a.decomposition_work for a in dp_accounts] == [189, 35]
    summary = summarize_accounts(dp_accounts)
    assert summary["memory_bytes"]["max"] == 364 and summary["memory_bytes"]["mean"] == 244
    assert summary["wire_bytes"]["per_rank"] == [52, 52]


def test_a_diagonal_factor_is_counted_as_its_vector_by_hand() -> None:
    # An embedding's A (50 tokens) held as its diagonal, and a linear layer, at P = 2.
    layers = [LayerShape("emb", DiagonalSide(50), 4), LayerShape("fc", 5, 3)]
    settings = DryRunSettings(2)  # float32, eigen
    accounts = account_strategy("dkfac", layers, settings)
    # Owners by d_A³ + d_G³ with a diagonal side costing d: fc 125 + 27 -> 0, emb 50 + 64 -> 1.
    assert [a.decomposition_work for a in accounts] == [152, 114]
    for account in accounts:
        assert account.comm == {
            # 4 float64 counts (32 B); A of emb whole (50), then the triangles 10 + 15 + 6.
            "factor_comm/allreduce": {"bytes": 32 + 4 * 81, "calls": 2, "wire_bytes": 32 + 324},
            # fc from 0: Q_A 25 + λ_A 5 + Q_G 9 + λ_G 3 + flag = 43 values; emb from 1:
            # λ_A 50 (no eigenvectors) + Q_G 16 + λ_G 4 + flag = 71.
            "inverse_comm/broadcast": {
                "bytes": 4 * (43 + 71),
                "calls": 2,
                "wire_bytes": 2 * 43 + 2 * 71,
            },
        }
        # Factors 50 + 16 + 25 + 9 values; decompositions 70 + 42.
        assert (account.factor_bytes, account.inverse_bytes) == (4 * 100, 4 * 112)


def test_bucket_cap_splits_like_the_communicator() -> None:
    # Packed factors in order 24, 12, 60, 40 bytes: 24+12+60 = 96 fit in 100 bytes, 40 not.
    settings = DryRunSettings(2, bucket_cap_mb=100 / 2**20)
    (account, _) = account_strategy("dkfac", TINY, settings)
    assert account.comm["factor_comm/allreduce"] == {"bytes": 168, "calls": 3, "wire_bytes": 168}
    # Owner 0's l1 tensors, 100 (Q_A) 20 64 16 4 bytes, go as 100 | 20+64+16 | 4; owner 1's
    # l0 (76 bytes in all) in one: four broadcasts of the same 280 bytes.
    assert account.comm["inverse_comm/broadcast"] == {"bytes": 280, "calls": 4, "wire_bytes": 140}


def test_kaisa_mem_opt_at_p3_by_hand() -> None:
    layers = [*TINY, LayerShape("l2", 2, 2)]
    # f = 1/3 (MEM-OPT): no decomposition broadcast; preconditioned gradients from the owners.
    accounts = account_strategy("kaisa", layers, DryRunSettings(3), grad_worker_fraction=1 / 3)
    # LPT on d³: l1 (189) -> 0, l0 (35) -> 1, l2 (16) -> 2.
    for account in accounts:
        assert account.comm["grad_comm/broadcast"] == {
            "bytes": 4 * (20 + 6 + 4),
            "calls": 3,
            "wire_bytes": 4 * 20 * 2 // 3 + 4 * 6 * 2 // 3 + 4 * 4 * 2 // 3,
        }
        assert "inverse_comm/broadcast" not in account.comm
    assert [a.inverse_bytes for a in accounts] == [4 * 50, 4 * 18, 4 * 12]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_kaisa_and_dkfac_equal_the_byte_counts_of_real_runs(world_size: int) -> None:
    # test_distributed asserts that real runs' comm_stats() equal expected_bytes (float64).
    model = uneven_model()
    shapes = layer_shapes_of(model)
    settings = DryRunSettings(
        world_size,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        grad_dtype=torch.float64,
    )
    for config in configurations(world_size):
        method_settings = dataclasses.replace(settings, inverse_method=config["inverse_method"])
        accounts = account_strategy(
            config["strategy"],
            shapes,
            method_settings,
            grad_worker_fraction=config.get("grad_worker_fraction", 1.0),
        )
        assert [a.comm for a in accounts] == expected_bytes(config, world_size, model), config


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dp_equals_the_byte_count_of_real_runs(world_size: int) -> None:
    # test_dp asserts this count on real runs, with the owners of the run's plan.
    shapes = layer_shapes_of(uneven_model())
    owners = dp.plan_layer_owners([s.dims for s in shapes], world_size)
    payloads = [
        sum(s.a_dim * s.g_dim for s, o in zip(shapes, owners, strict=True) if o == owner)
        for owner in range(world_size)
        if owner in owners
    ]
    settings = DryRunSettings(world_size, grad_dtype=torch.float64)
    for account in account_strategy("dp", shapes, settings):
        assert account.comm == {"grad_comm/broadcast": entry("broadcast", payloads, world_size)}


@pytest.mark.parametrize("method", INVERSE_METHODS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_spd_and_pad_agree_with_the_pipelined_byte_checks(method: str, world_size: int) -> None:
    # The checks test_pipelined makes on real runs with the same fixed cost model, for SPD and
    # for PAD sharing decompositions or preconditioned gradients.
    shapes = layer_shapes_of(uneven_model())
    dims = [s.dims for s in shapes]
    settings = DryRunSettings(
        world_size,
        inverse_method=method,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        grad_dtype=torch.float64,
        cost_model=COST,
    )
    factor_values = sum(tri(s.a_dim) + tri(s.g_dim) for s in shapes)
    dkfac_wire = entry("allreduce", [factor_values, 2 * len(shapes)], world_size)["wire_bytes"]
    kinds = [(SPDStrategy, None), (PADStrategy, "decompositions"), (PADStrategy, "gradients")]
    for strategy, share in kinds:
        choice = None
        if share is not None:
            choice = choose_share(
                share,
                dims,
                inverse_method=method,
                inv_dtype=torch.float64,
                grad_dtype=torch.float64,
                inv_update_steps=1,
            )
        placement = strategy.place_factors(
            dims,
            world_size,
            COST,
            inverse_method=method,
            inv_dtype=torch.float64,
            factor_dtype=torch.float64,
            cap_bytes=settings.cap_bytes,
            share=choice,
            grad_dtype=torch.float64,
        )
        plan: dict[str, Any] = {
            "factors": placement.placement().describe([s.name for s in shapes]),
            "share": {"mode": share},
        }
        if strategy is SPDStrategy:
            by_dim = {f["dim"]: f["decomposed_by"] for f in plan["factors"]}
            assert by_dim[64] != "all" and by_dim[5] == "all"  # as asserted on real runs
        for account in account_strategy(strategy.name, shapes, settings, share=share or "auto"):
            factor = {k: v for k, v in account.comm.items() if k.startswith("factor_comm")}
            # The counts: one per factor and the late-statistics marker (2L + 1 float64).
            counts = 8 * (2 * len(shapes) + 1)
            assert sum(v["bytes"] for v in factor.values()) == 8 * factor_values + counts
            wire = sum(v["wire_bytes"] for v in factor.values())
            calls = sum(v["calls"] for v in factor.values())
            assert calls == len(placement.buckets) + 1
            if strategy is SPDStrategy:
                marker_wire = 2 * 8 * (world_size - 1) // world_size
                assert abs(wire - dkfac_wire - marker_wire) < calls + 1
            else:
                # PAD reduces each planned bucket of packed factors to its owner ((P-1)/P of
                # the bucket, floored per call) and allreduces the 2L + 1 float64 counts. The
                # floors need the bucket boundaries, which the cost-model placement decides:
                # they are read from the plan above, the bytes are computed here.
                assert None not in placement.destination
                slot_dims = [slot.dim for slot in placement.costs.slots]
                assert factor["factor_comm/reduce"]["bytes"] == 8 * factor_values
                assert factor["factor_comm/allreduce"] == entry(
                    "allreduce", [2 * len(shapes) + 1], world_size
                )
                assert (
                    wire
                    == sum(
                        8 * sum(tri(slot_dims[i]) for i in bucket) * (world_size - 1) // world_size
                        for bucket in placement.buckets
                    )
                    + 2 * counts * (world_size - 1) // world_size
                )
                if world_size == 2:  # every bucket is whole float64s: no floor, no plan needed
                    assert wire == 4 * factor_values + counts
            assert account.comm.get("inverse_comm/broadcast") == expected_broadcast(
                plan, method, world_size, settings.bucket_cap_mb
            )
            assert account.comm.get("grad_comm/broadcast") == expected_gradients(
                plan, world_size, settings.bucket_cap_mb
            )
            # Sharing gradients, each owner holds both factors of its layers: no traces move.
            if share == "gradients":
                assert "inverse_comm/allreduce" not in account.comm


def test_pad_sharing_gradients_on_two_layers_at_p2_by_hand() -> None:
    settings = DryRunSettings(2, cost_model=COST)  # float32, eigen
    # Layers l0 (3, 2) and l1 (5, 4); each its own owner (their predicted costs, both
    # decompositions + both reduces + the gradient broadcast, are far below one start-up, so
    # two blocks beat one): l0 -> 0, l1 -> 1. Ready order A0 A1 G1 G0: reduces to 0 | 1 | 0.
    accounts = account_strategy("pad", TINY, settings, share="gradients")
    for account in accounts:
        assert account.comm == {
            # 2L + 1 = 5 float64 counts.
            "factor_comm/allreduce": {"bytes": 40, "calls": 1, "wire_bytes": 40},
            # Upper triangles 6 | 15 + 10 | 3 float32 values; a reduce sends half of each.
            "factor_comm/reduce": {"bytes": 4 * 34, "calls": 3, "wire_bytes": 2 * 34},
            # Owner 0 sends l0's 2x3 gradient (24 B), owner 1 l1's 4x5 (80 B); no
            # decomposition is broadcast.
            "grad_comm/broadcast": {"bytes": 24 + 80, "calls": 2, "wire_bytes": 12 + 40},
        }
    # Each owner holds its layer's factors (9+4 | 25+16 values) and decomposition (Q and λ of
    # both: 9+3+4+2 | 25+5+16+4) only.
    assert [(a.factor_bytes, a.inverse_bytes) for a in accounts] == [
        (4 * 13, 4 * 18),
        (4 * 41, 4 * 50),
    ]
    assert [a.decomposition_work for a in accounts] == [27 + 8, 125 + 64]
    # share="auto" at inv_update_steps 1 decides the same (104 gradient bytes a step against
    # 272 of decompositions); at 100 it shares decompositions, as share="decompositions" does.
    assert account_strategy("pad", TINY, settings) == accounts
    every_100 = dataclasses.replace(settings, inv_update_steps=100)
    assert account_strategy("pad", TINY, every_100) == account_strategy(
        "pad", TINY, settings, share="decompositions"
    )
    assert "grad_comm/broadcast" not in account_strategy("pad", TINY, every_100)[0].comm


@pytest.mark.parametrize("method", ["inverse", "cholesky"])
def test_pads_trace_means_travel_in_their_own_dtype_whatever_the_transport(method: str) -> None:
    """PAD with inverse_method="inverse": each factor is reduced to its owner, so the Tikhonov
    shifts need the other owner's trace means, (L, 2) float32 values allreduced. With a
    bfloat16 transport the factors travel in bfloat16 (half their float32 bytes), the trace
    means in float32: 4 values x 4 bytes, as without it (the shift equals the one worker's)."""
    plain = DryRunSettings(2, inverse_method=method, cost_model=COST)
    low = dataclasses.replace(plain, comm_dtype=torch.bfloat16)
    for settings in (plain, low):
        for account in account_strategy("pad", TINY, settings, share="decompositions"):
            assert account.comm["inverse_comm/allreduce"]["bytes"] == 2 * 2 * 4
    (plain_reduce, low_reduce) = (
        account_strategy("pad", TINY, s, share="decompositions")[0].comm["factor_comm/reduce"]
        for s in (plain, low)
    )
    assert low_reduce["bytes"] * 2 == plain_reduce["bytes"]


def test_resnet50_shapes() -> None:
    shapes = resnet50_layer_shapes()
    assert len(shapes) == 54 and shapes[0].name == "conv1" and shapes[-1].name == "fc"
    assert sum(s.a_dim * s.g_dim for s in shapes) == 25_557_032 - 53_120  # minus BatchNorm
    assert [slot.dim for slot in ready_order_of([s.dims for s in shapes])] == (
        resnet50_factor_dims()
    )
    # conv2d_shape / linear_shape follow the preconditioner's own block rule.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(64, 128, 3, bias=True),
            nn.BatchNorm2d(128),
            nn.Conv2d(128, 256, 1, bias=False),
            nn.Flatten(),
            nn.Linear(2048, 1000),
        )
    assert layer_shapes_of(model) == [
        conv2d_shape("0", 64, 128, 3, bias=True),
        conv2d_shape("2", 128, 256, 1),
        linear_shape("4", 2048, 1000),
    ]


def _resnet50_dims() -> list[tuple[int, int]]:
    """``(d_A, d_G)`` of ImageNet ResNet-50, written out here from the architecture alone.

    conv1 is 7x7 3->64; each bottleneck is 1x1 in->w, 3x3 w->w, 1x1 w->4w, plus the 1x1 in->4w
    projection in a stage's first block; no convolution has a bias; fc is 2048->1000 with one.
    """
    dims = [(3 * 7 * 7, 64)]
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            dims += [(channels, width), (width * 3 * 3, width), (width, 4 * width)]
            if block == 0:
                dims.append((channels, 4 * width))
            channels = 4 * width
    return [*dims, (channels + 1, 1000)]


@dataclasses.dataclass(frozen=True)
class _ResNet50Oracle:
    """Closed forms of one second-order update of ResNet-50 (eigen, float32: 4 bytes a value).

    They do not depend on P: every worker takes part in every collective of dkfac and dp.
    """

    layers: int
    #: dkfac factor allreduce: every factor's upper triangle + 2 float64 counts a layer.
    dkfac_factor: int
    #: dkfac decomposition broadcast: per layer Q_A, λ_A, Q_G, λ_G and one validity flag.
    dkfac_broadcast: int
    #: dp: each owner broadcasts its layers' preconditioned (d_G, d_A) gradients.
    dp_broadcast: int
    #: dkfac memory, the same on every worker (so also the busiest): every running factor
    #: as a full d x d matrix plus every stored decomposition (Q and λ; the flag is not kept).
    dkfac_memory: int
    #: dp memory per layer on its owner (factors + decomposition); their sum is dkfac_memory.
    dp_layer_memory: tuple[int, ...]
    #: Σ d³ of one layer's two factors.
    layer_work: tuple[int, ...]


def _resnet50_oracle() -> _ResNet50Oracle:
    dims = _resnet50_dims()
    return _ResNet50Oracle(
        layers=len(dims),
        dkfac_factor=4 * sum(tri(a) + tri(g) for a, g in dims) + 8 * 2 * len(dims),
        dkfac_broadcast=4 * sum(a * a + a + g * g + g + 1 for a, g in dims),
        dp_broadcast=4 * sum(a * g for a, g in dims),
        dkfac_memory=4 * sum(a * a + g * g for a, g in dims)
        + 4 * sum(a * a + a + g * g + g for a, g in dims),
        dp_layer_memory=tuple(4 * (2 * a * a + a + 2 * g * g + g) for a, g in dims),
        layer_work=tuple(a**3 + g**3 for a, g in dims),
    )


def _check_dry_run_output(printed: str, report: dict[str, Any], nprocs: int) -> None:
    """The report and its printed ratios against the closed forms (any P)."""
    oracle = _resnet50_oracle()
    printed = " ".join(printed.split())  # prose lines are wrapped
    assert "NOMINAL (not measured)" in printed and "EXCLUDED: DDP's gradient allreduce" in printed
    assert report["benchmark"] == "dry_run" and report["launches"] == []
    labels = [row["label"] for row in report["summary"]]
    assert labels == ["dkfac", f"kaisa f=1/{nprocs}", "kaisa f=1", "spd", "pad", "dp"]
    rows = {row["key"]: row for row in report["summary"]}
    assert rows["kaisa_1of1"]["wire_bytes"] == rows["dkfac"]["wire_bytes"]
    dkfac, dp_row = rows["dkfac"], rows["dp"]
    dkfac_payload = oracle.dkfac_factor + oracle.dkfac_broadcast
    assert dkfac["payload_bytes"]["per_rank"] == [dkfac_payload] * nprocs
    assert dp_row["payload_bytes"]["per_rank"] == [oracle.dp_broadcast] * nprocs
    assert dkfac["memory_bytes"]["per_rank"] == [oracle.dkfac_memory] * nprocs
    # dp's busiest worker holds at least the largest layer; with L <= P every layer has a
    # worker to itself (longest-processing-time, largest first), so exactly that.
    dp_memory = dp_row["memory_bytes"]["max"]
    assert dp_memory >= max(oracle.dp_layer_memory)
    if oracle.layers <= nprocs:
        assert dp_memory == max(oracle.dp_layer_memory)
    assert sum(dp_row["memory_bytes"]["per_rank"]) == oracle.dkfac_memory

    # Ratios dkfac / dp. Sent bytes are (P-1)/P of the payload (twice for an allreduce),
    # floored per collective, so the communication ratios are the payload ones below up to
    # those floors (1e-6 covers them: at most a byte per call, 54 calls in 1e8 bytes for dp).
    communication = (2 * oracle.dkfac_factor + oracle.dkfac_broadcast) / oracle.dp_broadcast
    payload = dkfac_payload / oracle.dp_broadcast
    ddp = 2 * oracle.dp_broadcast  # DDP allreduces the same gradients: 2(P-1)/P of them
    with_ddp = (2 * oracle.dkfac_factor + oracle.dkfac_broadcast + ddp) / (
        oracle.dp_broadcast + ddp
    )
    memory = oracle.dkfac_memory / dp_memory
    (verdict,) = report["target"]
    assert verdict["communication"] == pytest.approx(communication, rel=1e-6)
    assert verdict["communication_with_ddp_allreduce"] == pytest.approx(with_ddp, rel=1e-6)
    assert (verdict["communication_payload"], verdict["memory"]) == (payload, memory)
    assert verdict["memory_mean"] == nprocs  # dp spreads dkfac's memory over the P workers
    assert verdict["nprocs"] == nprocs and verdict["evaluated"] is True
    assert verdict["communication_met"] is verdict["memory_met"] is verdict["met"] is True
    c, m = f"{communication:.2f}x", f"{memory:.2f}x"
    assert (
        f"ratios dp vs dkfac at P={nprocs} (dkfac / dp, max per worker): communication {c} less "
        f"sent (payload {payload:.2f}x; with DDP's gradient allreduce counted for both "
        f"{with_ddp:.2f}x), memory {m} less (mean {nprocs:.2f}x), decomposition work "
    ) in printed
    assert (
        "target (DP-KFAC paper, 64 GPUs: >= 2.79x less communication and >= 1.14x less memory "
        f"per second-order update than D-KFAC) at P={nprocs}: communication MET ({c} vs 2.79x), "
        f"memory MET ({m} vs 1.14x)"
        + ("" if nprocs == 64 else " [the target's figures are for P=64]")
    ) in printed
    assert NO_TARGETS_LINE not in printed
    assert report["dry_run_target"] == {
        "source": "DP-KFAC paper, 64 GPUs",
        "nprocs": 64,
        "communication": 2.79,
        "memory": 1.14,
    }


def test_resnet50_dry_run_at_p64_equals_closed_forms() -> None:
    p = 64
    oracle = _resnet50_oracle()
    layers = oracle.layers
    assert _resnet50_dims() == [s.dims for s in resnet50_layer_shapes()]
    assert (layers, oracle.dp_broadcast) == (54, 4 * 25_503_912)
    assert oracle.dkfac_factor == 307_868_972
    assert oracle.dkfac_broadcast == 615_736_432
    assert oracle.dp_broadcast == 102_015_648
    assert oracle.dkfac_memory == 1_231_142_464  # "1231.14" MB (1e6 bytes) in the table
    assert sum(oracle.dp_layer_memory) == oracle.dkfac_memory
    assert max(oracle.dp_layer_memory) == 171_986_944  # a 3x3 512->512 convolution alone

    report = dry_run_report(
        "resnet50", [p], ["dkfac", "kaisa", "spd", "pad", "dp"], target=DRY_RUN_TARGET
    )
    _check_dry_run_output(format_dry_run(report), report, p)
    rows = {row["key"]: row for row in report["summary"]}

    def sent(op: str, nbytes: int) -> int:  # bandwidth-optimal bytes a worker sends
        return (2 if op == "allreduce" else 1) * nbytes * (p - 1) // p

    dkfac = rows["dkfac"]["comm_max_per_rank"]
    assert set(dkfac) == {"factor_comm/allreduce", "inverse_comm/broadcast"}
    assert dkfac["factor_comm/allreduce"]["bytes"] == oracle.dkfac_factor
    assert dkfac["inverse_comm/broadcast"]["bytes"] == oracle.dkfac_broadcast
    # Sent bytes are floored per call: within a byte a call of the exact (P-1)/P share.
    for key, op in (
        ("factor_comm/allreduce", "allreduce"),
        ("inverse_comm/broadcast", "broadcast"),
    ):
        exact = (2 if op == "allreduce" else 1) * dkfac[key]["bytes"] * (p - 1)
        assert exact - p * dkfac[key]["calls"] < p * dkfac[key]["wire_bytes"] <= exact
    # dp: one broadcast per layer (one layer per owner, each under the 25 MiB bucket).
    assert rows["dp"]["comm_max_per_rank"] == {
        "grad_comm/broadcast": {
            "bytes": oracle.dp_broadcast,
            "calls": layers,
            "wire_bytes": sum(sent("broadcast", 4 * a * g) for a, g in _resnet50_dims()),
        }
    }
    assert rows["dp"]["wire_bytes"]["max"] == 100_421_653
    # Memory: every dkfac worker holds every factor and decomposition; dp's owners one layer.
    for key in ("dkfac", "kaisa_1of1", "spd"):
        assert rows[key]["memory_bytes"]["per_rank"] == [oracle.dkfac_memory] * p
    assert sorted(rows["dp"]["memory_bytes"]["per_rank"]) == sorted(
        [*oracle.dp_layer_memory, *[0] * (p - layers)]
    )
    # Decomposition work: one layer per owner in both.
    for key in ("dkfac", "dp"):
        assert rows[key]["decomposition_work"]["max"] == max(oracle.layer_work)
    assert report["target"][0]["decomposition_work"] == 1.0

    # PAD: each factor's upper triangle reduced to its owner (bytes as dkfac's allreduce,
    # less the counts, which go in one float64 allreduce: one per factor and the
    # late-statistics marker). At this (1,1) update share="auto" broadcasts preconditioned
    # gradients (dp's 102 MB against 616 MB of decompositions a step): each layer's owner
    # reduces both factors, decomposes them and sends the layer's gradient, so nothing else
    # is broadcast and a worker holds only its layers' decompositions. The reduce's floors
    # per call need the planned buckets, the broadcasts' the planned owners.
    counts = 8 * (2 * layers + 1)
    pad = rows["pad"]["comm_max_per_rank"]
    assert set(pad) == {"factor_comm/allreduce", "factor_comm/reduce", "grad_comm/broadcast"}
    assert pad["factor_comm/allreduce"] == {
        "bytes": counts,
        "calls": 1,
        "wire_bytes": sent("allreduce", counts),
    }
    assert pad["factor_comm/reduce"]["bytes"] == oracle.dkfac_factor - (counts - 8) == 307_868_108
    dims = _resnet50_dims()
    choice = choose_share(
        "auto",
        dims,
        inverse_method="eigen",
        inv_dtype=torch.float32,
        grad_dtype=torch.float32,
        inv_update_steps=1,
    )
    assert choice.mode == "gradients"
    assert (choice.gradient_bytes_per_step, choice.decomposition_bytes_per_step) == (
        oracle.dp_broadcast,
        oracle.dkfac_broadcast - 4 * layers,  # without dkfac's validity flags
    )
    placement = PADStrategy.place_factors(
        dims,
        p,
        NOMINAL_COST_MODEL,
        inverse_method="eigen",
        inv_dtype=torch.float32,
        factor_dtype=torch.float32,
        cap_bytes=25 * 2**20,
        share=choice,
        grad_dtype=torch.float32,
    )
    slots = placement.costs.slots
    assert None not in placement.destination
    assert pad["factor_comm/reduce"]["calls"] == len(placement.buckets)
    assert pad["factor_comm/reduce"]["wire_bytes"] == sum(
        sent("reduce", 4 * sum(tri(slots[i].dim) for i in bucket)) for bucket in placement.buckets
    )
    owner = {slot.layer: o for slot, o in zip(slots, placement.decomposer, strict=True)}
    broadcasts = [
        payload
        for source in sorted(set(owner.values()))
        for payload in fused([a * g for i, (a, g) in enumerate(dims) if owner[i] == source], 25, 4)
    ]
    assert pad["grad_comm/broadcast"] == {
        "bytes": oracle.dp_broadcast,
        "calls": len(broadcasts),
        "wire_bytes": sum(sent("broadcast", 4 * values) for values in broadcasts),
    }
    assert (
        rows["pad"]["payload_bytes"]["per_rank"]
        == [oracle.dkfac_factor + 8 + oracle.dp_broadcast] * p
    )
    held = [
        sum(4 * (a * a + a + g * g + g) for i, (a, g) in enumerate(dims) if owner[i] == rank)
        for rank in range(p)
    ]
    assert rows["pad"]["inverse_bytes"]["per_rank"] == held
    assert sum(held) == oracle.dkfac_broadcast - 4 * layers

    # The ratios from the closed forms alone, as recorded in the results and the docs.
    communication = (2 * oracle.dkfac_factor + oracle.dkfac_broadcast) / oracle.dp_broadcast
    memory = oracle.dkfac_memory / max(oracle.dp_layer_memory)
    assert (f"{communication:.2f}x", f"{memory:.2f}x") == ("12.07x", "7.16x")
    recorded = json.loads((ROOT / "benchmarks/results/resnet50_dry_run.json").read_text())
    assert recorded["target"] == report["target"]
    docs = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    assert "communication MET (12.07x vs 2.79x), memory MET (7.16x vs 1.14x)" in docs


def test_benchmark_script_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load_strategies(monkeypatch)
    out = tmp_path / "dry.json"
    assert bench.main(["--layers", "resnet50", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check_dry_run_output(capsys.readouterr().out, report, 64)
    assert report["settings"]["cost_model"]["measured"] is False
    assert Path(report["targets_file"]).resolve() == TARGETS_FILE.resolve()  # the default
    assert not Path(report["targets_file"]).is_absolute()


def test_dkfac_bench_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--layers", "resnet50", "--nprocs", "8", "--targets", str(TARGETS_FILE)]
    assert dkfac_main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    _check_dry_run_output(capsys.readouterr().out, report, 8)
    assert report["targets_file"] == str(TARGETS_FILE)


def test_dkfac_bench_dry_run_without_targets_evaluates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--layers", "resnet50", "--nprocs", "4", "--strategies", "dkfac,dp"]
    assert dkfac_main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    assert (report["targets_file"], report["dry_run_target"], report["target"]) == (None,) * 3
    assert "ratios dp vs dkfac at P=4 (dkfac / dp, max per worker)" in printed  # measured
    assert "MET" not in printed and "target (" not in printed
    assert printed.count(NO_TARGETS_LINE) == 1


def test_dry_run_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert dkfac_main(["bench", "--alpha", "1e-5"]) == 2
    assert "needs --layers" in capsys.readouterr().err
    assert dkfac_main(["bench", "--layers", "resnet50", "--quick"]) == 2
    assert dkfac_main(["bench", "--layers", "resnet50", "--nprocs", "1"]) == 2


def test_nominal_constants_move_only_spd_and_pad() -> None:
    base = dry_run_report("resnet50", [4], ["dkfac", "spd", "dp"])
    # Decomposing beats receiving for every factor: spd decomposes them all everywhere.
    cheap = dry_run_report(
        "resnet50",
        [4],
        ["dkfac", "spd", "dp"],
        cost_model=ClusterCostModel(AlphaBeta(0.0, 1.0), COST.decomposition),
    )
    rows = {r["key"]: r for r in base["summary"]}
    cheap_rows = {r["key"]: r for r in cheap["summary"]}
    for key in ("dkfac", "dp"):
        assert rows[key] == cheap_rows[key]
    assert "inverse_comm/broadcast" not in cheap_rows["spd"]["comm_max_per_rank"]
    assert "alpha = 0 s, beta = 1 s/byte" in format_dry_run(cheap)
