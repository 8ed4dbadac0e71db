"""The resolved configuration of a ``dkfac train`` run: defaults < config file < command line.

Every field is validated here, before any worker starts, so that a bad option costs one line on
stderr instead of a traceback in N processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

from dkfac.cli.config_values import (
    ADAPTIVE_RULE,
    INTERVAL_OPTIONS,
    adaptive_default,
    adaptive_value,
    check_adaptive_rule,
    check_intervals,
    check_method_precision_flags,
    interval_value,
    parse_bucket_mb,
    trusted_decrease_value,
)
from dkfac.cli.config_values import ConfigError as ConfigError
from dkfac.cli.device import AMP_MODES, DEVICES
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.factors import CONV_PATCHES
from dkfac.curvature.gram import STATISTICS_PRECISIONS
from dkfac.curvature.inverse import PRECONDITION_PRECISIONS
from dkfac.strategies.registry import KAISAOptions, strategy_names

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step")
#: ``--strategy``: "none" (the plain optimizer), a strategy of the library's registry, or
#: "auto" (``dkfac.AutoOptions``: the fastest the simulator predicts for this model here).
STRATEGIES: tuple[str, ...] = ("none", *strategy_names(), "auto")
GRAD_SYNCS: tuple[str, ...] = ("ddp", "dear")
#: The options that take one of a few names, and those names (checked here, listed in --help).
CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", OPTIMIZERS),
    ("schedule", SCHEDULES),
    ("strategy", STRATEGIES),
    ("grad_sync", GRAD_SYNCS),
    ("inverse_method", INVERSE_METHODS),
    ("statistics_precision", STATISTICS_PRECISIONS),
    ("conv_patches", tuple(CONV_PATCHES)),
    ("precondition_precision", PRECONDITION_PRECISIONS),
    ("device", DEVICES),
    ("amp", AMP_MODES),
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (written to ``config.toml``)."""

    model: str = "cnn"
    dataset: str = "digits"
    data_root: str = ""
    #: ``load_dataset`` options of the dataset as sorted ``(key, value)`` pairs (a tuple keeps
    #: the configuration immutable); ``--dataset-option KEY=VALUE`` on the command line, a
    #: ``[dataset_options]`` table in a config file. See :attr:`dataset_kwargs`.
    dataset_options: tuple[tuple[str, Any], ...] = ()
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    #: The command line's own defaults (cosine, weight decay 0.01, damping 0.3): with them
    #: plain K-FAC generalises at least as well as SGD on the digits (docs/benchmarks.md,
    #: "dkfac compare: a regularised recipe"); ``dkfac compare`` starts from the recipe
    #: fast_to_target on top of them unless given ``--recipe none``. The library's own
    #: damping default is 0.003.
    weight_decay: float = 0.01
    schedule: str = "cosine"
    warmup_epochs: float = 0.0
    epochs: int = 10
    batch_size: int = 32
    #: Micro-batches of ``batch_size`` whose gradients one optimizer step averages.
    grad_accumulation: int = 1
    steps_per_epoch: int = 0
    strategy: str = "dkfac"
    grad_sync: str = "ddp"
    #: MiB per gradient bucket of DDP or DeAR, or "auto" (DeAR searches 1-64 MiB online).
    bucket_mb: str = "25"
    inverse_method: str = "eigen"
    #: Products of the factor statistics: "highest" (float32) or "bf16" (tensor cores).
    statistics_precision: str = "highest"
    #: A stride-1 convolution's patch Grams: auto (the device's rule), shifted or im2col.
    conv_patches: str = "auto"
    #: Share of each batch (its first examples) the factors are estimated from.
    statistics_fraction: float = 1.0
    #: Products of the preconditioning: "highest" (the decompositions' dtype) or "bf16".
    precondition_precision: str = "highest"
    #: Each plain step's preconditioning replayed as one CUDA graph (GPU only; the library's
    #: ``plain_step_graphs``, off by default until timed on a GPU).
    plain_step_graphs: bool = False
    damping: float = 0.3
    factor_decay: float = 0.95
    kl_clip: float = 0.001
    #: Steps between factor updates and decompositions: integers, or auto (chosen on the run).
    factor_update_steps: int | str = 1
    inv_update_steps: int | str = 1
    #: Adaptive K-FAC (dkfac.AdaptiveOptions): the step's size and the damping chosen.
    adaptive: bool = False
    #: Share of each batch (its first examples) adaptive K-FAC's quadratic model curves on.
    adaptive_model_fraction: float = 1.0
    #: Its Levenberg-Marquardt damping rule: steps between checks, per-step factor, floor.
    adaptive_damping_interval: int = adaptive_default("damping_interval")
    adaptive_damping_decay: float = adaptive_default("damping_decay")
    adaptive_min_damping: float = adaptive_default("min_damping")
    #: Between checks, a step promising more than this share of the loss is checked too
    #: ("never": no such check; AdaptiveOptions' None).
    adaptive_trusted_decrease: float | str = adaptive_default("trusted_decrease")
    #: The fewest target elements the model's part keeps (else the whole batch).
    adaptive_min_model_targets: int = adaptive_default("min_model_targets")
    grad_worker_fraction: float = 1.0
    nproc: int = 2
    threads: int = 1
    #: Where each worker trains (dkfac.cli.device): auto takes GPU LOCAL_RANK when every
    #: local worker has one, the CPU otherwise.
    device: str = "auto"
    #: Autocast precision of the forward pass; fp16 adds a GradScaler.
    amp: str = "none"
    #: DataLoader worker processes per rank; -1: 2 on a GPU, 0 on the CPU.
    loader_workers: int = -1
    seed: int = 0
    out: str = ""
    #: TensorBoard log directory ("" none): the metrics.jsonl records as scalars.
    tensorboard: str = ""
    checkpoint_every: int = 0
    stop_after_steps: int = 0
    log_every: int = 10
    target_accuracy: float = 0.0
    #: Seconds a collective may wait for a peer before the run fails (every process group).
    collective_timeout: float = 300.0
    #: Times ``dkfac train`` restarts its local workers after one is lost (torchrun: its own).
    max_restarts: int = 0

    def __post_init__(self) -> None:
        for name, allowed in CHOICES:
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not "
                    f"allowed: choose one of {', '.join(allowed)}"
                )
        positive: tuple[str, ...] = ("lr", "damping", "epochs", "batch_size", "nproc")
        positive += ("grad_accumulation", "threads", "log_every", "collective_timeout")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not "
                    "allowed: expected a number > 0"
                )
        non_negative = (
            "momentum",
            "weight_decay",
            "warmup_epochs",
            "steps_per_epoch",
            "checkpoint_every",
            "kl_clip",
            "target_accuracy",
            "max_restarts",
        )
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not "
                    "allowed: expected a number >= 0"
                )
        self._parse_bucket()
        check_method_precision_flags(self.inverse_method, self.precondition_precision)
        if not 0 < self.statistics_fraction <= 1:
            raise ConfigError(
                f"--statistics-fraction {self.statistics_fraction!r} is not allowed: expected "
                "a number in (0, 1]"
            )
        if not 0 < self.adaptive_model_fraction <= 1:
            raise ConfigError(
                f"--adaptive-model-fraction {self.adaptive_model_fraction!r} is not "
                "allowed: expected a number in (0, 1]"
            )
        if self.adaptive_model_fraction != 1 and not self.adaptive:
            raise ConfigError(
                "--adaptive-model-fraction is not allowed without --adaptive: it sets "
                "adaptive K-FAC's quadratic model"
            )
        trusted = trusted_decrease_value(self.adaptive_trusted_decrease)
        object.__setattr__(self, "adaptive_trusted_decrease", trusted)
        check_adaptive_rule(
            self.adaptive, self.adaptive_rule, self.adaptive_model_fraction, self.damping
        )
        if not 0 <= self.factor_decay < 1:
            raise ConfigError(
                f"--factor-decay {self.factor_decay!r} is not allowed: expected a number in [0, 1)"
            )
        for name in INTERVAL_OPTIONS:
            object.__setattr__(self, name, interval_value(name, getattr(self, name)))
        check_intervals(self.factor_update_steps, self.inv_update_steps)
        if self.adaptive and self.strategy == "none":
            raise ConfigError(
                "--adaptive is not allowed with --strategy none: it is a mode of K-FAC "
                "(choose a K-FAC strategy, e.g. --strategy dkfac)"
            )
        if self.adaptive and self.grad_sync != "ddp":
            raise ConfigError(
                f"--adaptive is not allowed with --grad-sync {self.grad_sync}: adaptive K-FAC "
                "moves the preconditioned layers itself, which DeAR's sharded optimizer step "
                "does not expect (use --grad-sync ddp)"
            )
        if self.grad_accumulation > 1 and (self.adaptive or self.grad_sync != "ddp"):
            what = "--adaptive" if self.adaptive else f"--grad-sync {self.grad_sync}"
            raise ConfigError(
                f"--grad-accumulation {self.grad_accumulation} is not allowed with {what}: "
                "it needs one batch per step (use --grad-accumulation 1, or a larger "
                "--batch-size)"
            )
        if self.amp == "fp16" and (self.adaptive or self.grad_sync != "ddp"):
            what = "--adaptive" if self.adaptive else f"--grad-sync {self.grad_sync}"
            raise ConfigError(
                f"--amp fp16 is not allowed with {what}: its loss scaling skips steps that "
                f"{what} does not expect; use --amp bf16 (no scaler)"
            )
        if self.loader_workers < -1:
            raise ConfigError(
                f"--loader-workers {self.loader_workers} is not allowed: expected a number "
                ">= 0, or -1 (2 on a GPU, 0 on the CPU)"
            )
        if self.strategy == "local" and self.nproc > 1:
            raise ConfigError(
                f"--strategy local is not allowed with --nproc {self.nproc}: each "
                "worker would precondition with its own factors and the replicas "
                "would drift apart; use --strategy dkfac or kaisa"
            )
        # The flag reaches the kaisa runs only (dkfac compare runs several strategies from one
        # configuration); it is checked whatever the strategy, with the library's own checks.
        try:
            kaisa = KAISAOptions(self.grad_worker_fraction)
        except ValueError as error:
            raise ConfigError(
                f"--grad-worker-fraction {self.grad_worker_fraction!r} is not allowed: "
                f"{str(error).split(': ', 1)[1]}"
            ) from None
        if self.strategy == "kaisa":
            try:
                kaisa.check_world_size(self.nproc)
            except ValueError as error:
                raise ConfigError(
                    f"--grad-worker-fraction {self.grad_worker_fraction!r} is not allowed with "
                    f"--nproc {self.nproc}: {str(error).split(': ', 1)[1]}"
                ) from None

    @property
    def step_batch(self) -> int:
        """Examples one optimizer step takes on one worker: the micro-batches together."""
        return self.batch_size * self.grad_accumulation

    @property
    def bucket_cap_mb(self) -> float | str:
        """``--bucket-mb`` as DDP/DeAR take it: MiB (a float), or ``"auto"`` (DeAR)."""
        return self._parse_bucket()

    def _parse_bucket(self) -> float | str:
        return parse_bucket_mb(self.bucket_mb, self.grad_sync)

    @property
    def dataset_kwargs(self) -> dict[str, Any]:
        """The dataset options as keyword arguments of :func:`dkfac.data.registry.load_dataset`."""
        return dict(self.dataset_options)

    @property
    def adaptive_rule(self) -> dict[str, Any]:
        """Adaptive K-FAC's :class:`dkfac.AdaptiveOptions` keywords (all but the share)."""
        return {name: adaptive_value(getattr(self, f"adaptive_{name}")) for name in ADAPTIVE_RULE}

    @property
    def uses_kfac(self) -> bool:
        """Whether a K-FAC preconditioner is built."""
        return self.strategy != "none"

    def with_overrides(self, values: dict[str, Any]) -> TrainConfig:
        """A copy with ``values`` replaced (keys are field names), validated again."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}: known options are "
                f"{', '.join(sorted(known))}"
            )
        converted = {key: _convert(self, key, value) for key, value in values.items()}
        return dataclasses.replace(self, **converted)

    def to_toml(self) -> str:
        """The configuration as TOML (strings quoted as JSON, which TOML accepts)."""
        lines = ["# dkfac train: fully resolved configuration"]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dataset_options":
                rendered = (
                    "{ " + ", ".join(f"{key} = {_toml_value(v)}" for key, v in value) + " }"
                    if value
                    else "{}"
                )
            else:
                rendered = _toml_value(value)
            lines.append(f"{f.name} = {rendered}")
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A scalar or a tuple of scalars as TOML (strings quoted as JSON, which TOML accepts)."""
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _option_value(text: str) -> int | float | str:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, anything else stays a string."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def parse_dataset_option(text: str) -> tuple[str, Any]:
    """One ``--dataset-option KEY=VALUE``: ``shape=3,32,32`` -> ``("shape", (3, 32, 32))``.

    Numbers become ints or floats; a comma-separated value becomes a tuple. Whether the
    dataset accepts the key and the value is checked by the dataset itself.

    Raises:
        ConfigError: ``text`` is not ``KEY=VALUE`` with a non-empty key and value.
    """
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier() or not value.strip():
        raise ConfigError(
            f"--dataset-option {text!r} is not allowed: expected KEY=VALUE, "
            "e.g. shape=3,32,32 or train_size=2048"
        )
    parts = [part.strip() for part in value.split(",")]
    if "," in value:
        return key, tuple(_option_value(part) for part in parts if part)
    return key, _option_value(parts[0])


def _dataset_options(value: Any) -> tuple[tuple[str, Any], ...]:
    """A table of dataset options (config file, CLI or a previous config) as sorted pairs."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = {str(key).replace("-", "_"): item for key, item in items}
    except (TypeError, ValueError):
        raise ConfigError(
            f"option dataset_options = {value!r} is not allowed: expected a table of KEY = VALUE"
        ) from None
    for key, item in pairs.items():
        allowed = (int, float, str)
        if isinstance(item, list | tuple) and item and all(isinstance(v, allowed) for v in item):
            pairs[key] = tuple(item)
        elif not isinstance(item, allowed):
            raise ConfigError(
                f"dataset option {key} = {item!r} is not allowed: expected a number, a string "
                "or a list of them"
            )
    return tuple(sorted(pairs.items()))


def _convert(config: TrainConfig, key: str, value: Any) -> Any:
    """Coerce a config-file or CLI value to the field's type, with a clear error."""
    current = getattr(config, key)
    if key == "dataset_options":
        return _dataset_options(value)
    if key in INTERVAL_OPTIONS:
        return interval_value(key, value)
    if key == "adaptive_trusted_decrease":
        return trusted_decrease_value(value)
    try:
        if isinstance(current, bool):
            if not isinstance(value, bool):
                raise ValueError(value)  # "false" must not become True
            return value
        if isinstance(current, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(current, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"option {key} = {value!r} is not allowed: expected {type(current).__name__}"
        ) from None
