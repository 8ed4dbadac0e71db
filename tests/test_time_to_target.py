"""Issue 15's workloads and the time-to-target runner: data, models, runs, summaries."""

from __future__ import annotations

import json
import math
import os
import sysconfig
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from dkfac.bench.target_report import format_table, grid_score, lost_progress, summarize
from dkfac.bench.target_run import (
    Method,
    kfac_keywords,
    kfac_method,
    run_method,
    train_to_target,
    window_steps,
)
from dkfac.bench.workloads import Workload, load_workload
from dkfac.cli.main import main
from dkfac.cli.objective import label_cross_entropy
from dkfac.data.builtin import load_digits_tensors
from dkfac.data.registry import load_dataset
from dkfac.data.stdlib_text import OTHER_BYTE, STDLIB_TEXT_MODULES, load_stdlib_text
from dkfac.models import DeepAutoencoder, TransformerLM, build_model, sparse_init_
from script_loader import load_benchmark


def test_pysource_windows_are_the_library_files_bytes_shifted_by_one() -> None:
    source = (Path(sysconfig.get_paths()["stdlib"]) / f"{STDLIB_TEXT_MODULES[0]}.py").read_bytes()
    train, valid = load_stdlib_text(seq_len=16, valid_fraction=0.25)
    x, y = train[0]
    assert bytes(x.tolist()) == source[:16] and bytes(y.tolist()) == source[1:17]
    x1, _ = train[1]
    assert bytes(x1.tolist()) == source[16:32]  # windows do not overlap
    cut = round(len(source) * 0.75)
    first_valid, _ = valid[0]
    assert bytes(first_valid.tolist()) == source[cut : cut + 16]  # each file's tail validates
    for data in (train, valid):
        inputs, targets = data.tensors
        assert inputs.max() < 128 and targets.min() >= 0


def test_pysource_maps_bytes_outside_ascii_to_one_id_and_refuses_bad_options() -> None:
    from dkfac.data.stdlib_text import _encode

    assert _encode("é=1".encode()).tolist() == [OTHER_BYTE, OTHER_BYTE, ord("="), ord("1")]
    spec = load_dataset("pysource", seq_len=8, max_chars=900)
    assert (spec.kind, spec.num_classes, spec.vocab_size, spec.input_shape) == (
        "text",
        128,
        128,
        (8,),
    )
    assert len(spec.train) == (900 - 1) // 8  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len=0"):
        load_dataset("pysource", seq_len=0)
    with pytest.raises(ValueError, match="max_chars=5"):
        load_dataset("pysource", seq_len=8, max_chars=5)


def test_the_lm_model_takes_text_and_only_text() -> None:
    text = load_dataset("pysource", seq_len=8, max_chars=900)
    tokens = load_dataset("tokens", seq_len=8)
    assert isinstance(build_model("lm", text, d_model=16, heads=2, layers=1), TransformerLM)
    with pytest.raises(ValueError, match="'transformer' does not fit dataset kind 'text'"):
        build_model("transformer", text)
    with pytest.raises(ValueError, match="'lm' does not fit dataset kind 'tokens'"):
        build_model("lm", tokens)


def test_label_cross_entropy_is_the_mean_over_every_position() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 7, dtype=torch.float64), torch.randint(0, 7, (3, 5))
    by_position = [F.cross_entropy(logits[:, t], labels[:, t]) for t in range(5)]
    assert label_cross_entropy(logits, labels) == pytest.approx(float(sum(by_position) / 5))
    flat = torch.randn(4, 7)  # one label per example: plain cross-entropy
    assert torch.equal(
        label_cross_entropy(flat, labels[0, :4]), F.cross_entropy(flat, labels[0, :4])
    )


def test_dkfac_train_runs_a_character_language_model_on_pysource(tmp_path: Path) -> None:
    argv = ["train", "--model", "lm", "--dataset", "pysource", "--batch-size", "16"]
    argv += ["--dataset-option", "max_chars=20000", "--dataset-option", "seq_len=32"]
    argv += ["--steps-per-epoch", "3", "--epochs", "1", "--nproc", "1", "--strategy", "local"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epoch = [r for r in records if r.get("event") == "epoch"][-1]
    # Next-character loss starts near ln(128) = 4.85 (uniform) and cannot be far above it.
    assert 0 < epoch["test_loss"] < 6 and 0 <= epoch["test_accuracy"] <= 1


def test_digits_can_stay_in_the_unit_interval_for_the_autoencoder() -> None:
    from sklearn.datasets import load_digits

    train, test = load_digits_tensors(standardize=False)
    images = torch.as_tensor(load_digits().images, dtype=torch.float32) / 16
    everything = torch.cat([train.tensors[0], test.tensors[0]]).flatten(1)
    assert everything.min() == 0 and everything.max() == 1
    # The same images as scikit-learn's, in some order.
    assert sorted(map(tuple, everything.tolist())) == sorted(map(tuple, images.flatten(1).tolist()))


def test_the_deep_autoencoder_has_martens_and_grosses_shape() -> None:
    model = DeepAutoencoder(64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    widths = [linears[0].in_features] + [m.out_features for m in linears]
    assert widths == [64, 1000, 500, 250, 30, 250, 500, 1000, 64]
    assert sum(isinstance(m, nn.Sigmoid) for m in model.modules()) == 6  # not after code, output
    assert isinstance(model.encoder[-1], nn.Linear) and isinstance(model.decoder[-1], nn.Linear)
    assert model(torch.rand(5, 1, 8, 8)).shape == (5, 64)


def test_the_sparse_initialisation_gives_each_unit_its_own_few_normal_weights() -> None:
    torch.manual_seed(0)
    model = DeepAutoencoder(64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for layer in linears:
        nonzero = (layer.weight != 0).sum(1)
        assert torch.equal(nonzero, torch.full_like(nonzero, min(15, layer.in_features)))
        assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
    # The chosen inputs differ from unit to unit, and the values are N(0, 1) (the 1000-wide
    # first layer holds 15,000 of them: mean and spread within a few standard errors).
    chosen = linears[0].weight != 0
    assert len({tuple(row.nonzero().flatten().tolist()) for row in chosen}) > 900
    values = linears[0].weight.detach()[chosen].double()
    assert abs(float(values.mean())) < 0.04 and abs(float(values.std()) - 1) < 0.03
    # Normal, not just mean 0 and variance 1: 5% beyond ±1.96 (a uniform ±√3 has none;
    # standard error 0.18 points).
    assert 0.04 < float((values.abs() > 1.96).double().mean()) < 0.06
    # Every input equally likely: 1000·15/64 = 234 units each, standard deviation about 13.
    per_input = chosen.sum(0)
    assert int(per_input.min()) > 234 - 70 and int(per_input.max()) < 234 + 70
    # The same seed, the same weights; PyTorch's own initialisation on request.
    torch.manual_seed(0)
    again = DeepAutoencoder(64)
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    default = DeepAutoencoder(64, init="default")
    assert bool((default.encoder[0].weight != 0).all())


def test_the_sparse_initialisation_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="init='xavier'"):
        DeepAutoencoder(64, init="xavier")
    with pytest.raises(ValueError, match="nonzero=0"):
        sparse_init_(nn.Linear(3, 2), nonzero=0)
    small = nn.Linear(3, 2)
    sparse_init_(small, nonzero=15, generator=torch.Generator().manual_seed(1))
    assert bool((small.weight != 0).all())  # fewer inputs than 15: every weight drawn
    with pytest.raises(ValueError, match="lazy linear layer"):
        sparse_init_(nn.Sequential(nn.LazyLinear(4)))
    # A CUDA generator (a stand-in: only its device is read before the refusal).
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="generator on cuda:0"):
        sparse_init_(small, generator=on_gpu)  # type: ignore[arg-type]


def test_the_sparse_initialisation_takes_its_count_generator_and_the_weights_dtype() -> None:
    layer = nn.Linear(40, 10, dtype=torch.float64)
    state = torch.get_rng_state()
    sparse_init_(layer, nonzero=4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)  # the given generator, not the global one
    assert layer.weight.dtype == torch.float64
    assert torch.equal((layer.weight != 0).sum(1), torch.full((10,), 4))
    first = layer.weight.detach().clone()
    sparse_init_(layer, nonzero=4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer.weight, first)
    sparse_init_(layer, nonzero=4, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(layer.weight, first)


def _regression(target: float, lr_scale: float = 1.0) -> Workload:
    """y = 2x: a loss that a working optimizer drives to zero."""
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    data = (x, 2 * x)

    def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float(F.mse_loss(model(batch[0]), batch[1]))

    return Workload(
        "regression", data, data, lambda: nn.Linear(1, 1), F.mse_loss, mse, "mse",
        target, False, batch_size=16, eval_every=5, budget_s=5.0,
    )  # fmt: skip


def test_a_run_stops_at_the_first_measurement_that_meets_the_target() -> None:
    # A budget whose windows (budget/200 = 5 s) no step of this tiny model comes near, even on
    # a loaded machine: one step first, then eval_every (5) at a time.
    trace = train_to_target(_regression(target=1e-3), Method("sgd", 0.1), seed=0, budget_s=1e3)
    assert trace.reached_step is not None
    assert [p[1] for p in trace.points] == [0, 1, *range(6, trace.reached_step + 1, 5)]
    assert trace.points[-1][2] <= 1e-3 < min(p[2] for p in trace.points[:-1])
    assert trace.reached_s == trace.points[-1][0] == trace.train_s
    assert not trace.diverged and not trace.collapsed and trace.as_dict()["collapsed"] is False
    with_kfac = train_to_target(_regression(1e-3), Method("sgd", 0.1, kfac=True), seed=0)
    assert with_kfac.reached_step is not None


def test_a_diverging_run_and_an_unreachable_target_are_told_apart() -> None:
    diverged = train_to_target(_regression(1e-3), Method("sgd", 1e3), seed=0)
    assert diverged.diverged and diverged.reached_s is None
    unreached = train_to_target(_regression(-1.0), Method("sgd", 0.1), seed=0, budget_s=0.05)
    assert not unreached.diverged and unreached.reached_s is None
    assert unreached.train_s >= 0.05 and len(unreached.points) >= 2


def test_measurements_come_every_eval_every_steps_or_sooner_when_steps_are_slow() -> None:
    workload = _regression(1e-3)  # eval_every 5; a budget of 5 s: windows near 0.025 s
    assert window_steps(workload, 5.0, 0.0, 0) == 1  # the first step alone: no timing yet
    assert window_steps(workload, 5.0, 0.001, 10) == 5  # 0.1 ms steps: eval_every
    assert window_steps(workload, 5.0, 0.1, 10) == 2  # 10 ms steps: 0.025 s is 2 of them
    assert window_steps(workload, 5.0, 1.0, 10) == 1  # 100 ms steps: never fewer than one


def test_summaries_take_the_median_over_reached_runs_and_count_failures() -> None:
    def trace(seconds: float | None, diverged: bool = False) -> dict[str, Any]:
        points = [[0.0, 0, 0.5], [1.0, 10, 0.9 if seconds else 0.8]]
        step = None if seconds is None else 10
        return {"points": points, "reached_s": seconds, "reached_step": step, "diverged": diverged}

    runs = [trace(3.0), trace(1.0), trace(2.0), trace(None), trace(None, diverged=True)]
    summary = summarize(runs)
    assert summary == {
        "runs": 5,
        "reached": 3,
        "diverged": 1,
        "collapsed": 0,
        "median_s": 2.0,
        "min_s": 1.0,
        "max_s": 3.0,
        "median_steps": 10,
    }
    assert summarize(runs[2:])["median_s"] is None  # one of three reached: not typical
    assert grid_score(trace(2.0), True) < grid_score(trace(3.0), True)
    assert grid_score(trace(None), True) == (math.inf, -0.8)
    nothing_finite = {**trace(None, diverged=True), "points": [[0.0, 0, math.nan]]}
    assert grid_score(nothing_finite, True) == (math.inf, math.inf)  # ranks last
    table = format_table(
        [{"workload": "digits", "world_size": 1, "method": "sgd lr=0.1", "summary": summary}]
    )
    assert "digits" in table and "3/5" in table and "1.00-3.00" in table and "1+0" in table
    assert summarize([{**trace(2.0), "collapsed": True}])["collapsed"] == 1


def test_a_run_that_loses_more_than_half_its_way_to_the_target_collapsed() -> None:
    def points(*values: float) -> list[tuple[float, int, float]]:
        return [(float(k), k, value) for k, value in enumerate(values)]

    # A loss from 5.0 towards 1.4 (3.6 of way): one bad step of 0.5 (14%) is noise; falling
    # from 2.0 back to 4.0 (56% of the way) is a collapse, though every value is finite.
    assert not lost_progress(points(5.0, 3.0, 2.0, 2.5, 1.9), target=1.4)
    assert lost_progress(points(5.0, 3.0, 2.0, 4.0, 1.5), target=1.4)
    assert not lost_progress(points(5.0, 3.0, 2.0, 3.7), target=1.4)  # 47%: not yet
    # An accuracy from 0.1 towards 0.97: from 0.9 down to 0.4 is 57% of the way.
    assert lost_progress(points(0.1, 0.6, 0.9, 0.4), target=0.97)
    assert not lost_progress(points(0.1, 0.12, 0.11, 0.1), target=0.97)  # noise at the start
    assert not lost_progress(points(5.0, 2.0, math.inf), target=1.4)  # divergence, not this
    assert not lost_progress(points(1.4), target=1.4)  # no way to go


def test_every_workload_loads_with_a_target_its_first_measurement_misses() -> None:
    for name in ("digits", "autoencoder", "charlm"):
        workload = load_workload(name)
        torch.manual_seed(0)
        model = workload.build()
        with torch.no_grad():
            start = workload.measure(model, workload.test)
        assert not workload.reached(start), name
    with pytest.raises(ValueError, match="workload='mnist'"):
        load_workload("mnist")


def test_a_workload_takes_another_batch_for_every_method_and_refuses_one_it_cannot_draw() -> None:
    own = load_workload("digits")
    full = load_workload("digits", 1344)
    assert (own.batch_size, full.batch_size) == (64, 1344)
    assert full.target == own.target and torch.equal(full.train[0], own.train[0])
    assert load_workload("digits", None).batch_size == 64
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="expected a positive int"):
            load_workload("digits", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="training split has 1347 examples"):
        load_workload("digits", 1348)
    with pytest.raises(ValueError, match="does not split over 2 workers"):
        run_method("digits", Method("sgd", 0.1), seed=0, world_size=2, batch_size=1347)


@pytest.mark.parametrize("kfac", [False, True])
def test_two_workers_train_as_one_process_on_the_global_batch(kfac: bool) -> None:
    # A budget this large keeps every window at eval_every steps, so both runs measure at the
    # same steps; each worker's half batch averaged by DDP (and dkfac's factors reduced over
    # both) is the one process's full batch, so the accuracies agree up to float32 order
    # effects (one test image either way).
    method = Method("sgd", 0.1, kfac=kfac)
    one = run_method("digits", method, seed=1, budget_s=1e6, world_size=1)
    two = run_method("digits", method, seed=1, budget_s=1e6, world_size=2)
    assert one["reached_step"] is not None and two["reached_step"] == one["reached_step"]
    assert [p[1] for p in two["points"]] == [p[1] for p in one["points"]]
    for (_, _, got), (_, _, want) in zip(two["points"], one["points"], strict=True):
        assert got == pytest.approx(want, abs=1 / 450 + 1e-9)


def test_the_benchmark_runs_final_seeds_after_the_grids_interleaved_at_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = load_benchmark("time_to_target", monkeypatch)
    calls: list[tuple[str, int, int | None]] = []

    def run(workload: str, method: Method, seed: int, **kwargs: Any) -> dict[str, Any]:
        calls.append((method.label, seed, kwargs["batch_size"]))
        point = [1.0 + method.lr, 10, 0.98]
        return {"points": [[0.0, 0, 0.1], point], "reached_s": point[0], "reached_step": 10,
                "diverged": False, "collapsed": False, "train_s": point[0]}  # fmt: skip

    monkeypatch.setattr(script, "run_method", run)
    monkeypatch.setattr(script, "_plot", lambda *args: None)
    argv = ["time_to_target.py", "--workloads", "digits", "--world-sizes", "1", "--seeds", "2"]
    argv += ["--sgd-grid", "0.1,0.3", "--adamw-grid", "0.01", "--batch-size", "1344"]
    argv += ["--kfac", '{"optimizer": "sgd", "lr": 0.1, "name": "a",'
             ' "options": {"adaptive": {"damping_decay": 0.9}}}']  # fmt: skip
    for name in script.MALLOC_KEEP:
        monkeypatch.delenv(name, raising=False)  # restored (removed) after the test
    monkeypatch.setattr("sys.argv", [*argv, "--malloc-keep", "--out", str(tmp_path)])
    assert script.main() == 0
    assert all(os.environ[name] == value for name, value in script.MALLOC_KEEP.items())
    grid = [(label, seed) for label, seed, _ in calls[:3]]
    assert grid == [("sgd lr=0.1", 0), ("sgd lr=0.3", 0), ("adamw lr=0.01", 0)]
    finals = [seed for _, seed, _ in calls[3:]]
    assert finals == [1, 1, 1, 2, 2, 2]  # every method on a seed before the next seed
    assert {batch for _, _, batch in calls} == {1344}
    record = json.loads((tmp_path / "time_to_target.json").read_text())
    assert record["workloads"]["digits"]["batch_size"] == 1344
    assert record["malloc"] == script.MALLOC_KEEP
    # The rule the configuration ran: its keyword, and the defaults of this commit.
    defaults = dkfac.AdaptiveOptions(loss_fn=F.cross_entropy)
    rule = record["kfac_resolved"]["a"]["adaptive"]
    assert rule["damping_decay"] == 0.9
    assert rule["damping_interval"] == defaults.damping_interval
    assert rule["min_damping"] == defaults.min_damping and "loss_fn" not in rule


def test_the_benchmark_refuses_two_configurations_of_one_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Their runs would be pooled under one label: both rows the same mixed median.
    script = load_benchmark("time_to_target", monkeypatch)
    same = '{"optimizer": "sgd", "lr": 0.1, "options": {"damping": 0.1}}'
    other = '{"optimizer": "sgd", "lr": 0.1, "options": {"damping": 0.3}}'
    monkeypatch.setattr("sys.argv", ["time_to_target.py", "--kfac", same, "--kfac", other])
    with pytest.raises(SystemExit, match="distinct names"):
        script.main()


def test_a_recipe_is_changed_by_the_options_given_beside_it() -> None:
    recipe = dkfac.fast_to_target(F.cross_entropy)
    plain = Method("sgd", 0.1, kfac=True, recipe="fast_to_target")
    keywords = kfac_keywords(plain, F.cross_entropy)
    assert keywords == recipe  # AdaptiveOptions compare by their fields
    changed = Method(
        "sgd",
        0.1,
        kfac=True,
        recipe="fast_to_target",
        kfac_options=(("adaptive", {"min_damping": 1e-9}), ("damping", 0.1)),
    )
    keywords = kfac_keywords(changed, F.cross_entropy)
    assert keywords["damping"] == 0.1 and keywords["inverse_method"] == "inverse"
    assert keywords["adaptive"].min_damping == 1e-9
    assert keywords["adaptive"].model_fraction == recipe["adaptive"].model_fraction  # kept
    off = Method(
        "sgd", 0.1, kfac=True, recipe="fast_to_target", kfac_options=(("adaptive", False),)
    )
    assert "adaptive" not in kfac_keywords(off, F.cross_entropy)
    assert kfac_keywords(Method("sgd", 0.1, kfac=True), F.cross_entropy) == {}  # the library's
    with pytest.raises(ValueError, match="recipe='fastest': expected one of"):
        Method("sgd", 0.1, kfac=True, recipe="fastest")
    with pytest.raises(ValueError, match="recipe='fast_to_target' needs kfac=True"):
        Method("sgd", 0.1, recipe="fast_to_target")
    # An empty table keeps the recipe's adaptive options; null removes them; a number is bad.
    kept = Method("sgd", 0.1, kfac=True, recipe="fast_to_target", kfac_options=(("adaptive", {}),))
    assert kfac_keywords(kept, F.cross_entropy)["adaptive"] == recipe["adaptive"]
    none = Method(
        "sgd", 0.1, kfac=True, recipe="fast_to_target", kfac_options=(("adaptive", None),)
    )
    assert "adaptive" not in kfac_keywords(none, F.cross_entropy)
    bad = Method("sgd", 0.1, kfac=True, kfac_options=(("adaptive", 3),))
    with pytest.raises(ValueError, match='"adaptive": 3 is not allowed'):
        kfac_keywords(bad, F.cross_entropy)


def test_a_kfac_configuration_with_a_key_the_benchmark_does_not_read_is_refused() -> None:
    # An "adaptive" table beside "options" instead of in it was ignored once: a run labelled
    # "floor 1e-5" ran the recipe's floor (found before its results were kept).
    given = {"optimizer": "sgd", "lr": 0.2, "recipe": "fast_to_target", "name": "floor"}
    with pytest.raises(ValueError, match=r"'adaptive' is not allowed: .* go in \"options\""):
        kfac_method({**given, "adaptive": {"min_damping": 1e-5}})
    method = kfac_method({**given, "options": {"adaptive": {"min_damping": 1e-5}}})
    adaptive = kfac_keywords(method, F.cross_entropy)["adaptive"]
    assert adaptive.min_damping == 1e-5 and adaptive.model_fraction == 0.125
    assert kfac_method({"optimizer": "adamw", "lr": "0.01"}).label == "dkfac (adamw lr=0.01)"
    for bad, pattern in (
        ([given], "expected a table"),
        ({"optimizer": "sgd"}, "lr missing"),
        ({**given, "options": [1]}, '"options" \\[1\\] is not allowed'),
    ):
        with pytest.raises(ValueError, match=pattern):
            kfac_method(bad)
