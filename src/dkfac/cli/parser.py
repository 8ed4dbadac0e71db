"""The ``dkfac`` argument parser: the ``train``, ``compare`` and ``bench`` subcommands."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any, NoReturn

from dkfac import __version__
from dkfac.bench.options import add_bench_options
from dkfac.cli.config import CHOICES, TrainConfig
from dkfac.cli.config_resolution import COMPARE_RECIPE, NO_RECIPE
from dkfac.cli.config_values import WORDED_OPTIONS, adaptive_default
from dkfac.cli.exit_codes import EXIT_USAGE
from dkfac.cli.simulate import add_simulate_parser
from dkfac.recipes import RECIPES

#: What ``dkfac --help`` says the command is.
DESCRIPTION = "``dkfac``: train, compare and benchmark distributed K-FAC from the command line."
#: Defaults of ``dkfac bench`` without ``--quick``.
BENCH_MODELS = "resnet20"
BENCH_NPROCS = "2"


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE``, and exit code 2.

    Abbreviated options are refused: ``--lr`` must not silently mean ``--lr-schedule`` one day.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line (no usage block) and exit with code 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_train_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add one flag per TrainConfig field to ``parser``, and ``--dataset-option``, ``--config``.

    The flags' defaults are None (not given): the configuration's defaults apply, except
    where ``command`` (``"train"`` or ``"compare"``) has its own, which ``--help`` shows.
    """
    shown = {
        "out": os.path.join("runs", command),
        "target_accuracy": 0.95,
    }
    choices = dict(CHOICES)
    helps = {
        "model": "mlp, cnn, resnet20, resnet32, resnet56, transformer, lm (a causal language "
        "model, for text data such as pysource)",
        "dataset": "digits (bundled), synthetic, cifar10, npz, tokens, pysource (characters of "
        "the Python standard library's sources; train it with --model lm)",
        "data_root": "folder of cifar10 python batches, or the .npz file",
        "strategy": "none (plain optimizer), local, dkfac, kaisa, spd, pad, dp, auto (the "
        "one dkfac simulate predicts fastest for this model and cluster, chosen at the start)",
        "grad_sync": "ddp (DistributedDataParallel), dear (dkfac.DeAR: reduce-scatter under "
        "backward, all-gather under the next forward)",
        "bucket_mb": "MiB per gradient bucket of DDP/DeAR, or auto (DeAR's online search)",
        "steps_per_epoch": "cap on steps per epoch (0: the whole shard)",
        "grad_accumulation": "micro-batches of --batch-size whose gradients one optimizer step "
        "averages (K-FAC accumulates their statistics too); a step takes batch x N per worker",
        "nproc": "local worker processes to start (ignored under torchrun/Slurm)",
        "checkpoint_every": "also checkpoint every N steps (0: at epoch ends only)",
        "stop_after_steps": "checkpoint and stop after N steps, as a preempted job would "
        "(continue with --resume; 0: run to the end)",
        "target_accuracy": "test accuracy whose first crossing each run's seconds and epochs "
        "are reported to",
        "out": "output folder (metrics, checkpoints, plots)",
        "tensorboard": "also write the metrics as TensorBoard scalars into DIR (compare: one "
        "subfolder per run; needs the tensorboard package)",
        "optimizer": "sgd (with --momentum) or adamw",
        "schedule": "constant, cosine or step (x0.1 at 1/2 and 3/4 of the epochs), after "
        "--warmup-epochs",
        "inverse_method": "eigen (exact damped inverse), inverse (factored Tikhonov, Cholesky "
        "inverses) or cholesky (the same preconditioner by triangular solves, no inverse "
        "formed: cheaper when decompositions are frequent, as at --inv-update-steps 1)",
        "statistics_precision": "products of the factor statistics: highest (in float32) or "
        "bf16 (operands rounded to bfloat16, summed in float32: tensor cores on a GPU)",
        "precondition_precision": "products of the preconditioning: highest (in the "
        "decompositions' dtype) or bf16 (operands and results rounded to bfloat16: tensor cores "
        "on a GPU, AVX-512 BF16 on a CPU)",
        "plain_step_graphs": "replay each plain step's preconditioning, KL clip and scaling as "
        "one CUDA graph (GPU only: a few host calls instead of dozens; ResNet-32 on an H200: "
        "14.7 ms a step against 16.6; holds a copy of the gradients)",
        "factor_update_steps": "steps between factor updates, or auto (chosen early in the "
        "run so they take about 10%% of a step; needs --inv-update-steps auto)",
        "inv_update_steps": "steps between decompositions (a multiple of "
        "--factor-update-steps), or auto (chosen early in the run so they take about 10%% of "
        "a step)",
        "conv_patches": "a stride-1 convolution's patch Grams: auto (as the device suits), "
        "shifted (products of one padded copy of the input) or im2col (patches kh*kw times the "
        "input, or more; a compiled model's first factor window takes im2col either way)",
        "statistics_fraction": "estimate the K-FAC factors from this share of each batch (its "
        "first examples; 1: all of it): less factor work per step at large batches",
        "collective_timeout": "seconds a collective waits for a lost or stuck peer before the "
        "run fails",
        "adaptive": "adaptive K-FAC: learning rate and momentum from the quadratic model on "
        "each batch, Levenberg-Marquardt damping (--damping is its start; --lr, --schedule and "
        "--weight-decay reach only the layers K-FAC does not precondition)",
        "adaptive_model_fraction": "with --adaptive: build the quadratic model (its curvature, "
        "slopes and the damping check's losses) on this share of each batch (its first "
        "examples; 1: all of it): cheaper steps at large batches",
        "adaptive_damping_interval": "with --adaptive: steps between the damping's checks (each "
        "one forward pass of the model's part; a checked step that raises the loss is not "
        "taken; 1: every step)",
        "adaptive_damping_decay": "with --adaptive: the damping's factor per step when the "
        "quadratic model predicts well (smaller: faster; Martens and Grosse's: 0.95 every 5 steps)",
        "adaptive_min_damping": "with --adaptive: the damping's floor",
        "adaptive_min_model_targets": "with --adaptive: the quadratic model's part keeps at "
        "least this many target elements (a class per image, a token per position), else the "
        "whole batch",
        "adaptive_trusted_decrease": "with --adaptive: between the damping's checks, check a "
        "step whose quadratic model promises more than this share of the loss too (never: no "
        "such check)",
        "device": "auto (GPU LOCAL_RANK when every worker on this machine has a GPU, with "
        "NCCL; else the CPU with gloo), cpu, or cuda (an error without enough GPUs)",
        "amp": "autocast the forward pass: none, bf16, or fp16 (GPU only; with a GradScaler)",
        "loader_workers": "DataLoader processes per worker (-1: 2 on a GPU under torchrun or "
        "Slurm, else 0; batches are pinned on a GPU)",
        "max_restarts": "restart the local workers this many times when one is lost, resuming "
        "from the last checkpoint (train only; under torchrun use its --max-restarts)",
    }
    for f in fields(TrainConfig):
        if f.name == "dataset_options" or (f.name == "target_accuracy" and command != "compare"):
            continue  # set by --dataset-option; a target only compare reports
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        if isinstance(f.default, bool):
            parser.add_argument(
                flag,
                dest=f.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=_help(helps.get(f.name, ""), None, f.default),
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            type=kind if kind in (int, float) and f.name not in WORDED_OPTIONS else str,
            help=_help(helps.get(f.name, ""), choices.get(f.name), shown.get(f.name, f.default)),
        )
    parser.add_argument(
        "--dataset-option",
        dest="dataset_options",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="an option of --dataset, repeatable; synthetic: shape=3,32,32 num_classes=10 "
        "train_size=1024 test_size=256; tokens: vocab_size, seq_len, num_classes, "
        "train_size, test_size, key_position; digits and npz: test_fraction; npz: num_classes; "
        "pysource: seq_len=64 valid_fraction=0.1 max_chars",
    )
    parser.add_argument("--config", help="TOML or YAML file of options (CLI flags override it)")
    parser.add_argument(
        "--recipe",
        choices=[*RECIPES, NO_RECIPE],
        default=None,
        help="start from a named configuration of dkfac.recipes, which --config and the "
        "other flags change (a config file may say recipe = NAME). fast_to_target: adaptive "
        "K-FAC as measured fastest to a target (docs/benchmarks.md), its factors from 1/8 of "
        "each batch, its quadratic model too (at least "
        f"{adaptive_default('min_model_targets')} target elements). {NO_RECIPE}: the "
        "command's own defaults. "
        + (f"(default: {COMPARE_RECIPE})" if command == "compare" else f"(default: {NO_RECIPE})"),
    )


def _help(text: str, choices: tuple[str, ...] | None, default: Any) -> str:
    """An option's help: what it is, its choices, the default the command uses."""
    listed = f" (choices: {', '.join(choices)})" if choices else ""
    return f"{text}{listed} (default: {default!r})".strip()


def build_parser() -> argparse.ArgumentParser:
    """The ``dkfac`` argument parser (its errors are one line and exit code 2)."""
    parser = CommandParser(prog="dkfac", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dkfac {__version__}")
    sub = parser.add_subparsers(dest="command")  # subcommands are CommandParsers too
    train = sub.add_parser("train", help="train one configuration")
    _add_train_options(train, "train")
    train.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out"
    )
    compare = sub.add_parser(
        "compare",
        help="several strategies (default: the optimizer with and without K-FAC) on the same "
        "data and seed",
    )
    _add_train_options(compare, "compare")
    compare.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="comma-separated strategies, one run each, e.g. none,dkfac,dp (none: the plain "
        "optimizer; default: none and --strategy, or none,dkfac / none,local on one worker)",
    )
    bench = sub.add_parser(
        "bench",
        help="time DDP + SGD against DeAR + SGD and the K-FAC strategies on CIFAR ResNets, a "
        "wide MLP and a Transformer LM (torchrun, gloo)",
        description="Launch torchrun workers per world size, time SGD and every K-FAC "
        "configuration (model, P, strategy, schedule), and DeAR + SGD when --strategies "
        "names dear, print the table and write "
        "OUT/bench.json and the stacked bar chart OUT/bench.png.",
    )
    add_bench_options(bench, models=BENCH_MODELS, nprocs=BENCH_NPROCS)
    bench.add_argument(
        "--out",
        default=os.path.join("runs", "bench"),
        help="folder of bench.json and bench.png (default: runs/bench)",
    )
    add_simulate_parser(sub)
    return parser
