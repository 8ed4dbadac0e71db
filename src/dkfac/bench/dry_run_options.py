"""The dry run's options of ``dkfac bench``: ``--layers`` and the nominal cost model's constants."""

from __future__ import annotations

import argparse

from dkfac.bench.dry_run import DRY_RUN_NPROCS, NOMINAL_COST_MODEL, dry_run_models
from dkfac.cli.config import ConfigError
from dkfac.comm.cost_model import AlphaBeta, ClusterCostModel, CubicCost


def add_dry_run_options(parser: argparse.ArgumentParser) -> None:
    """The ``dry run`` group of flags."""
    dry = parser.add_argument_group(
        "dry run",
        "--layers computes, without training or a process group, each strategy's bytes per "
        "worker, decomposition work and factor + decomposition memory of one second-order "
        "update from the model's layer shapes, with the strategies' own planners (P from "
        f"--nprocs, default {DRY_RUN_NPROCS}); the cost model below only places spd/pad's "
        "factors and is nominal, not measured",
    )
    dry.add_argument(
        "--layers",
        choices=sorted(dry_run_models()),
        default=None,
        help="dry run on this model's layer shapes instead of timing (resnet50: ImageNet "
        "ResNet-50, 53 Conv2d + the Linear classifier)",
    )
    nominal = NOMINAL_COST_MODEL
    dry.add_argument(
        "--alpha",
        type=float,
        default=None,
        help=f"collective start-up in s (default {nominal.collective.alpha:g})",
    )
    dry.add_argument(
        "--beta",
        type=float,
        default=None,
        help=f"collective s per payload byte (default {nominal.collective.beta:g})",
    )
    dry.add_argument(
        "--decomposition-c0",
        type=float,
        default=None,
        help=f"fixed s per decomposition (default {nominal.decomposition.c0:g})",
    )
    dry.add_argument(
        "--decomposition-c3",
        type=float,
        default=None,
        help=f"s per d^3 of a decomposition (default {nominal.decomposition.c3:g})",
    )


def cost_model_from_args(args: argparse.Namespace) -> ClusterCostModel:
    """The dry run's cost model: the nominal constants, with those given on the command line."""
    given = {
        name: getattr(args, name, None)
        for name in ("alpha", "beta", "decomposition_c0", "decomposition_c3")
    }
    if getattr(args, "layers", None) is None:
        flags = [
            f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None
        ]
        if flags:
            raise ConfigError(f"{', '.join(flags)}: options of a dry run, which needs --layers")
        return NOMINAL_COST_MODEL
    for name, value in given.items():
        if value is not None and not value >= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value!r}")
    nominal = NOMINAL_COST_MODEL

    def pick(name: str, default: float) -> float:
        value = given[name]
        return default if value is None else float(value)

    return ClusterCostModel(
        AlphaBeta(pick("alpha", nominal.collective.alpha), pick("beta", nominal.collective.beta)),
        CubicCost(
            pick("decomposition_c0", nominal.decomposition.c0),
            pick("decomposition_c3", nominal.decomposition.c3),
        ),
    )
