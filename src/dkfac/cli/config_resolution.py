"""The run configuration the user asked for: defaults < ``--recipe`` < ``--config`` file < flags.

A resumed run (``dkfac train --resume``) starts from its saved configuration instead, and
only how and where it runs may change (:data:`RESUME_MAY_CHANGE`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from dkfac.adaptive import AdaptiveOptions
from dkfac.cli.config import ConfigError, TrainConfig, parse_dataset_option
from dkfac.cli.config_files import load_config_file
from dkfac.cli.config_values import ADAPTIVE_RULE, NEVER, PRECONDITIONER_OPTIONS
from dkfac.recipes import RECIPES
from dkfac.strategies.registry import option_keywords, strategy_names


def recipe_values(name: str) -> dict[str, Any]:
    """A :mod:`dkfac.recipes` recipe as the command's options (field names of TrainConfig).

    Raises:
        ConfigError: an unknown recipe, or one setting what the command cannot express
            exactly (then it would run something else than the recipe says).
    """
    if name not in RECIPES:
        raise ConfigError(
            f"--recipe {name!r} is not allowed: choose one of {', '.join(RECIPES)}, {NO_RECIPE}"
        )
    keywords = RECIPES[name](lambda outputs, targets: outputs)
    values = {key: keywords.pop(key) for key in PRECONDITIONER_OPTIONS if key in keywords}
    adaptive = keywords.pop("adaptive", None)
    if isinstance(adaptive, AdaptiveOptions):
        values["adaptive"] = True
        values["adaptive_model_fraction"] = adaptive.model_fraction
        for rule in ADAPTIVE_RULE:
            value = getattr(adaptive, rule)
            values[f"adaptive_{rule}"] = NEVER if value is None else value
        # What the command has no flag for must be the library's default: else it is named
        # below as an option the command lacks.
        defaults = AdaptiveOptions(loss_fn=adaptive.loss_fn)
        keywords.update(
            {
                f"adaptive.{field.name}": getattr(adaptive, field.name)
                for field in fields(adaptive)
                if field.name not in ("loss_fn", "model_fraction", *ADAPTIVE_RULE)
                and getattr(adaptive, field.name) != getattr(defaults, field.name)
            }
        )
    elif adaptive is not None:
        keywords["adaptive"] = adaptive
    if keywords:
        raise ConfigError(
            f"--recipe {name}: the command has no option for {', '.join(sorted(keywords))}"
        )
    return values


#: ``--recipe none``: the command's own defaults, no recipe.
NO_RECIPE = "none"
#: ``dkfac compare``'s recipe when neither ``--recipe`` nor the config file names one: the
#: configuration the benchmarks measured against SGD and AdamW (docs/benchmarks.md).
COMPARE_RECIPE = "fast_to_target"


def _given(
    args: argparse.Namespace, default_recipe: str = NO_RECIPE
) -> tuple[dict[str, Any], bool]:
    """The options the user gave: a recipe's, ``--config`` file values, then flags.

    Returns:
        The options by TrainConfig field, and whether they hold ``default_recipe``'s
        because neither ``--recipe`` nor the file named one.
    """
    values: dict[str, Any] = {}
    in_file = load_config_file(args.config) if getattr(args, "config", None) else {}
    file_recipe = in_file.pop("recipe", None)  # popped whether or not the flag wins
    named = getattr(args, "recipe", None) or file_recipe
    recipe = named or default_recipe
    if recipe != NO_RECIPE:
        values.update(recipe_values(str(recipe)))
    values.update(in_file)
    values.update(
        {
            f.name: getattr(args, f.name)
            for f in fields(TrainConfig)
            if f.name != "dataset_options" and getattr(args, f.name, None) is not None
        }
    )
    flags = getattr(args, "dataset_options", None)
    if flags:
        from_file = values.get("dataset_options", {})
        if not isinstance(from_file, dict):
            raise ConfigError(
                f"--config {args.config}: dataset_options must be a table of KEY = VALUE"
            )
        values["dataset_options"] = {**from_file, **dict(map(parse_dataset_option, flags))}
    return values, not named and recipe != NO_RECIPE


def resolve_config(
    args: argparse.Namespace, base: TrainConfig | None = None, default_recipe: str = NO_RECIPE
) -> TrainConfig:
    """Defaults < ``--recipe`` < ``--config`` file < flags (dataset options key by key).

    ``default_recipe`` applies when neither ``--recipe`` nor the file names one (``none``:
    the command's defaults alone).
    """
    base = base or TrainConfig()
    given, defaulted = _given(args, default_recipe)
    try:
        return base.with_overrides(given)
    except ConfigError as error:
        if not defaulted:
            raise
        try:  # without the recipe the user did not ask for
            base.with_overrides(_given(args)[0])
        except ConfigError:
            raise error from None  # not the recipe's doing
        raise ConfigError(
            f"{error} (this command starts from --recipe {default_recipe} unless told "
            f"otherwise: --recipe {NO_RECIPE} for its plain defaults)"
        ) from error


def refuse_unread_strategy_options(args: argparse.Namespace, config: TrainConfig) -> None:
    """Refuse a strategy option the chosen strategy does not read (``dkfac train``).

    ``--grad-worker-fraction`` with ``--strategy dkfac`` would be silently ignored; it is an
    error instead. (``dkfac compare`` runs several strategies from one configuration: there
    it reaches the strategies that read it.)

    Raises:
        ConfigError: naming the option, the strategy and the strategies that read it.
    """
    given, _ = _given(args)
    for option in ("grad_worker_fraction",):
        if option in given and not option_keywords(config.strategy, **{option: given[option]}):
            readers = [s for s in strategy_names() if option_keywords(s, **{option: 1.0})]
            raise ConfigError(
                f"--{option.replace('_', '-')} is not allowed with --strategy "
                f"{config.strategy}: only {', '.join(readers)} read it"
            )


#: What ``--resume`` may change in a saved run: how and where it runs, not what it computes.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "nproc",
    "threads",
    "data_root",
    "log_every",
    "checkpoint_every",
    "stop_after_steps",
    "collective_timeout",
    "max_restarts",
    "loader_workers",
    "tensorboard",
    "plain_step_graphs",  # the same arithmetic, replayed (to round-off on a GPU)
    "conv_patches",  # the same Grams another way (to round-off): im2col's memory, or not
)


def resumed_config(args: argparse.Namespace) -> tuple[TrainConfig, list[str]]:
    """The saved run's configuration (``OUT/config.toml``), with the options that may change.

    Returns:
        The configuration, and ``"NAME OLD -> NEW"`` for each option the flags changed.

    Raises:
        ConfigError: no saved configuration in ``--out``, or a flag that would change what
            the run computes (model, data, optimizer, K-FAC, schedule...).
    """
    given, _ = _given(args)
    out = Path(str(given.pop("out", "") or os.path.join("runs", "train")))
    saved_file = out / "config.toml"
    if not saved_file.is_file():
        raise ConfigError(
            f"--resume: no saved run in {out} (no config.toml; start without --resume)"
        )
    saved = TrainConfig().with_overrides(load_config_file(str(saved_file)))
    asked = saved.with_overrides(given)  # the flags' values, in the fields' types
    differing = [name for name in given if getattr(asked, name) != getattr(saved, name)]
    refused = [name for name in differing if name not in RESUME_MAY_CHANGE]
    if refused:
        changes = ", ".join(
            f"--{name.replace('_', '-')} {getattr(asked, name)!r} (saved: {getattr(saved, name)!r})"
            for name in refused
        )
        may = ", ".join("--" + name.replace("_", "-") for name in RESUME_MAY_CHANGE)
        raise ConfigError(
            f"--resume continues the run saved in {out}, which these flags would change: "
            f"{changes}; only {may} may change when resuming (start a new run in another "
            "--out to change the others)"
        )
    # A stop requested for the interrupted run does not carry over to its continuation.
    overrides = {"out": str(out), "stop_after_steps": asked.stop_after_steps}
    if "stop_after_steps" not in given:
        overrides["stop_after_steps"] = 0
    overrides.update({name: getattr(asked, name) for name in differing})
    config = saved.with_overrides(overrides)
    changed = [
        f"{name} {getattr(saved, name)!r} -> {getattr(config, name)!r}"
        for name in differing
        if name != "stop_after_steps"
    ]
    return config, changed
