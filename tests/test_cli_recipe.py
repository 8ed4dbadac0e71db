"""``--recipe``: a dkfac.recipes configuration as the command's options, changed by the others.

The oracle is the library's own recipe: the preconditioner the command builds from
``--recipe NAME`` must be configured exactly as ``KFACPreconditioner(model, **recipe(loss))``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
import dkfac.cli.config_resolution as resolution
import dkfac.cli.parser as parser_module
from dkfac.cli.config import ConfigError, TrainConfig
from dkfac.cli.config_files import load_config_file
from dkfac.cli.config_resolution import COMPARE_RECIPE, recipe_values, resolve_config
from dkfac.cli.device import Precision
from dkfac.cli.lr_schedule import EpochLR, ProgressSchedule
from dkfac.cli.main import main
from dkfac.cli.parser import build_parser
from dkfac.cli.training_setup import _build_preconditioner
from dkfac.recipes import RECIPES
from test_cli import QUICK


def built(config: TrainConfig) -> dkfac.KFACPreconditioner:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = EpochLR(opt, ProgressSchedule("constant", 1))
    return _build_preconditioner(
        config, "local", model, scheduler, Precision("none", torch.device("cpu"))
    )


def configured(argv: list[str]) -> TrainConfig:
    return resolve_config(build_parser().parse_args(argv))


def adaptive_fields(options: dkfac.AdaptiveOptions | None) -> dict[str, Any]:
    assert options is not None
    return {
        f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "loss_fn"
    }


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_builds_the_preconditioner_the_library_recipe_builds(name: str) -> None:
    pre = built(configured(["train", "--recipe", name]))
    keywords = RECIPES[name](F.cross_entropy)
    want = dkfac.KFACPreconditioner(nn.Linear(3, 2), **keywords)
    for key in keywords:  # what the recipe sets, as the preconditioner resolved it
        if key != "adaptive":
            assert getattr(pre.config, key) == getattr(want.config, key), key
    assert adaptive_fields(pre.config.adaptive) == adaptive_fields(want.config.adaptive)
    pre.remove()


def test_the_config_file_and_the_flags_change_the_recipe(tmp_path: Path) -> None:
    recipe = recipe_values("fast_to_target")
    config = configured(["train", "--recipe", "fast_to_target", "--damping", "0.1"])
    assert config.damping == 0.1 and config.inverse_method == recipe["inverse_method"]
    assert config.adaptive and config.adaptive_model_fraction == 0.125
    file = tmp_path / "run.toml"
    file.write_text('recipe = "fast_to_target"\nstatistics_fraction = 0.5\n')
    config = configured(["train", "--config", str(file), "--inverse-method", "eigen"])
    assert config.statistics_fraction == 0.5 and config.inverse_method == "eigen"
    assert config.precondition_precision == recipe["precondition_precision"]
    assert config.factor_update_steps == "auto" and config.adaptive
    assert configured(["train"]).adaptive is False  # no recipe: the command's defaults


def test_the_flags_recipe_wins_over_the_files_and_the_files_values_over_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def other(loss_fn: Any) -> dict[str, Any]:
        return {"damping": 0.2, "factor_decay": 0.5}

    recipes = {**RECIPES, "other": other}
    monkeypatch.setattr(resolution, "RECIPES", recipes)
    monkeypatch.setattr(parser_module, "RECIPES", recipes)  # --recipe's choices
    file = tmp_path / "run.toml"
    file.write_text('recipe = "other"\nstatistics_fraction = 0.5\n')
    config = configured(["train", "--config", str(file), "--recipe", "fast_to_target"])
    assert config.damping == 0.03 and config.adaptive  # fast_to_target's, not other's
    assert config.factor_decay == TrainConfig().factor_decay and config.statistics_fraction == 0.5
    config = configured(["train", "--config", str(file)])
    assert (config.damping, config.factor_decay, config.adaptive) == (0.2, 0.5, False)


def test_compare_runs_the_plain_optimizer_beside_a_recipes_adaptive_k_fac(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No --recipe: compare's default, fast_to_target, end to end.
    argv = ["compare", *QUICK, "--epochs", "1", "--nproc", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "SGD+adaptive K-FAC (dkfac)" in capsys.readouterr().out
    plain = load_config_file(str(tmp_path / "SGD" / "config.toml"))
    kfac = load_config_file(str(tmp_path / "SGD_adaptive_K-FAC_dkfac" / "config.toml"))
    assert plain["strategy"] == "none" and plain["adaptive"] is False
    assert kfac["adaptive"] is True and kfac["inverse_method"] == "inverse"
    assert kfac["adaptive_model_fraction"] == 0.125 and kfac["statistics_fraction"] == 0.125


def test_compare_starts_from_fast_to_target_unless_told_otherwise(tmp_path: Path) -> None:
    def compare(argv: list[str]) -> TrainConfig:
        args = build_parser().parse_args(["compare", *argv])
        return resolve_config(args, default_recipe=COMPARE_RECIPE)

    recipe = recipe_values("fast_to_target")
    plain = configured(["train"])
    assert COMPARE_RECIPE == "fast_to_target"
    assert compare([]) == plain.with_overrides(recipe)
    assert compare(["--damping", "0.1"]).damping == 0.1 and compare([]).adaptive
    assert compare(["--recipe", "none"]) == plain  # the command's own defaults
    file = tmp_path / "run.toml"
    file.write_text('recipe = "none"\nepochs = 3\n')
    assert compare(["--config", str(file)]) == plain.with_overrides({"epochs": 3})
    assert configured(["train"]).adaptive is False  # train: no recipe unless asked
    # An option the default recipe conflicts with: the error says where the recipe came from.
    with pytest.raises(ConfigError, match=r"--amp fp16 .* starts from --recipe fast_to_target"):
        compare(["--amp", "fp16"])
    with pytest.raises(ConfigError, match=r"--amp fp16 is not allowed") as refused:
        compare(["--amp", "fp16", "--recipe", "fast_to_target"])
    assert "starts from" not in str(refused.value)  # asked for: no hint
    assert compare(["--amp", "fp16", "--recipe", "none"]).amp == "fp16"
    file.write_text('recipe = "fast_to_target"\n')  # named in the file: no hint either
    with pytest.raises(ConfigError, match=r"--amp fp16 is not allowed") as refused:
        compare(["--amp", "fp16", "--config", str(file)])
    assert "starts from" not in str(refused.value)
    # An error that is not the recipe's doing: no hint.
    with pytest.raises(ConfigError, match="epochs") as refused:
        compare(["--epochs", "0"])
    assert "starts from" not in str(refused.value)


def test_a_recipe_the_command_cannot_express_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def capped(loss_fn: Any) -> dict[str, Any]:
        return {"adaptive": dkfac.AdaptiveOptions(loss_fn=loss_fn, max_damping=10.0)}

    def other(loss_fn: Any) -> dict[str, Any]:
        # lr is the preconditioner's own there, the optimizer's here: not the same option.
        return {"damping": 0.1, "skip_layers": ("head",), "lr": 0.1}

    monkeypatch.setattr(resolution, "RECIPES", {"capped": capped, "other": other})
    with pytest.raises(
        ConfigError, match=r"--recipe capped: the command has no option for adaptive\.max_damping"
    ):
        recipe_values("capped")
    with pytest.raises(
        ConfigError, match="--recipe other: the command has no option for lr, skip_layers"
    ):
        recipe_values("other")
    with pytest.raises(
        ConfigError, match="--recipe 'fastest' is not allowed: choose one of capped, other, none"
    ):
        recipe_values("fastest")


def test_the_parser_refuses_an_unknown_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["train", "--recipe", "fastest"])
    assert stopped.value.code == 2
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_make_demos_command_resolves_to_the_recipe_on_two_workers() -> None:
    # `make demo` is the first thing a user runs: its flags must parse and resolve.
    import shlex

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndemo:") :].split("\n\n")[0]
    command = recipe[recipe.index("dkfac compare") :].replace("\\\n", " ")
    argv = shlex.split(command)[1:]  # after "dkfac"
    config = configured(argv)
    assert config.adaptive and config.nproc == 2 and config.batch_size == 672
    values = recipe_values("fast_to_target")
    assert all(getattr(config, key) == value for key, value in values.items()), values
