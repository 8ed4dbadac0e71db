"""Validated configuration of a K-FAC preconditioner.

Every constructor argument of :class:`dkfac.KFACPreconditioner` lands here and is checked
once, at the boundary, so the rest of the library can trust it. Hyperparameters that may vary
during training (damping, learning rate...) are either a number or a callable of the K-FAC step;
callables are checked each time they are evaluated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from dkfac.adaptive.options import AdaptiveOptions
from dkfac.comm.cost_model import ClusterCostModel, CostModelCache
from dkfac.curvature.batching import Batching, batched_decompositions_up_to
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.factors import CONV_PATCHES
from dkfac.curvature.gram import GramPrecision
from dkfac.curvature.inverse import check_method_precision, check_precondition_precision
from dkfac.schedules import (
    FloatSchedule,
    Hyperparameter,
    IntHyperparameter,
    IntSchedule,
    check_multiple,
)
from dkfac.strategies.chooser import StrategyChooser
from dkfac.strategies.registry import StrategyOptions, resolve_options
from dkfac.update_intervals import AUTO, IntervalBudget, IntervalSettings
from dkfac.validation import check_bool, check_float, check_int, check_switch_or_int, describe

__all__ = [
    "Hyperparameter",
    "IntHyperparameter",
    "KFACConfig",
    "check_float",
    "check_int",
    "check_multiple",
]

LOSS_REDUCTIONS: tuple[str, ...] = ("mean", "sum")
#: The communicator's bucket cap (MiB) when none is given and no chooser picks one.
DEFAULT_BUCKET_CAP_MB = 25.0
FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


@dataclass(frozen=True)
class KFACConfig:
    """Every knob of :class:`dkfac.KFACPreconditioner`, validated on construction.

    See the preconditioner's docstring for the meaning of each field.
    """

    strategy: str | StrategyOptions | StrategyChooser = "local"
    inverse_method: str = "eigen"
    damping: Hyperparameter = 0.003
    factor_decay: Hyperparameter = 0.95
    kl_clip: Hyperparameter | None = 0.001
    lr: Hyperparameter = 0.1
    factor_update_steps: IntHyperparameter | IntervalBudget | str = 1
    inv_update_steps: IntHyperparameter | IntervalBudget | str = 1
    accumulation_steps: int | None = None
    skip_layers: Sequence[str] = ()
    loss_reduction: str = "mean"
    factor_dtype: torch.dtype = torch.float32
    statistics_precision: str = "highest"
    conv_patches: str = "auto"
    statistics_fraction: float = 1.0
    precondition_precision: str = "highest"
    inv_dtype: torch.dtype = torch.float32
    grad_worker_fraction: float | None = None
    bucket_cap_mb: float | None = None
    comm_dtype: torch.dtype | None = None
    profile_steps: int | None = None
    cost_model: ClusterCostModel | CostModelCache | None = None
    share: str | None = None
    check_replicas_every: int = 0
    adaptive: AdaptiveOptions | None = None
    max_factor_dim: int | None = 8192
    batched_preconditioning: bool | None = None
    batched_decompositions: bool | int | None = None
    batched_factor_updates: bool | None = None
    batched_statistics: bool | None = None
    plain_step_graphs: bool = False
    #: ``strategy`` with the shorthand keywords applied (:func:`resolve_options`), or its chooser.
    options: StrategyOptions | StrategyChooser = field(init=False, repr=False)
    skip_patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False)
    damping_at: FloatSchedule = field(init=False, repr=False)
    factor_decay_at: FloatSchedule = field(init=False, repr=False)
    lr_at: FloatSchedule = field(init=False, repr=False)
    kl_clip_at: FloatSchedule | None = field(init=False, repr=False)
    factor_update_steps_at: IntSchedule = field(init=False, repr=False)
    inv_update_steps_at: IntSchedule = field(init=False, repr=False)

    def _resolve_strategy(self) -> StrategyOptions | StrategyChooser:
        """The options ``strategy`` means; a chooser takes none of the shorthand keywords."""
        shorthand = {
            "grad_worker_fraction": self.grad_worker_fraction,
            "profile_steps": self.profile_steps,
            "cost_model": self.cost_model,
            "share": self.share,
        }
        if not isinstance(self.strategy, StrategyChooser):
            return resolve_options(self.strategy, **shorthand)
        given = sorted(key for key, value in shorthand.items() if value is not None)
        if self.bucket_cap_mb is not None:
            given.append("bucket_cap_mb")
        if given:
            raise ValueError(
                f"{', '.join(given)} is not allowed with strategy={self.strategy.name!r}: "
                "the strategy and its options are chosen (set them in the chooser)"
            )
        return self.strategy

    def batching(self, device: torch.device, hooks_start_work: bool = False) -> Batching:
        """What runs batched on ``device`` (``None``: GPU defaults; see ``hooks_start_work``)."""
        on_gpu, statistics = device.type == "cuda", self.batched_statistics
        return Batching(
            on_gpu if self.batched_preconditioning is None else self.batched_preconditioning,
            batched_decompositions_up_to(self.batched_decompositions, device),
            on_gpu if self.batched_factor_updates is None else self.batched_factor_updates,
            (on_gpu and not hooks_start_work) if statistics is None else statistics,
        )

    def __post_init__(self) -> None:
        if self.inverse_method not in INVERSE_METHODS:
            raise ValueError(
                f"inverse_method={self.inverse_method!r} is not allowed: "
                f"expected one of {', '.join(map(repr, INVERSE_METHODS))}"
            )
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction={self.loss_reduction!r} is not allowed: "
                f"expected one of {', '.join(map(repr, LOSS_REDUCTIONS))}"
            )
        for name in ("factor_dtype", "inv_dtype"):
            dtype = getattr(self, name)
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name}={dtype!r} is not allowed: expected a floating dtype "
                    f"({', '.join(map(str, FLOAT_DTYPES))})"
                )
        if GramPrecision(self.statistics_precision).name == "bf16" and (
            self.factor_dtype != torch.float32
        ):
            raise ValueError(
                f"statistics_precision='bf16' is not allowed with factor_dtype="
                f"{self.factor_dtype}: its products are summed in float32 (use torch.float32)"
            )
        if not isinstance(self.conv_patches, str) or self.conv_patches not in CONV_PATCHES:
            raise ValueError(
                f"conv_patches={self.conv_patches!r} is not allowed: expected one of "
                f"{', '.join(map(repr, CONV_PATCHES))}"
            )
        check_precondition_precision(self.precondition_precision)
        check_method_precision(self.inverse_method, self.precondition_precision)
        check_float(
            "statistics_fraction",
            self.statistics_fraction,
            low=0.0,
            high=1.0,
            low_open=True,
            allowed="a number in (0, 1]: the share of each call's examples the factors use",
        )
        if self.inv_dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"inv_dtype={self.inv_dtype!r} is not allowed: decompositions need "
                "torch.float32 or torch.float64"
            )
        if self.accumulation_steps is not None:
            check_int("accumulation_steps", self.accumulation_steps)
        self._check_adaptive()
        check_int("check_replicas_every", self.check_replicas_every, low=0)
        if self.max_factor_dim is not None:
            check_int("max_factor_dim", self.max_factor_dim, low=1)
        for name in ("batched_preconditioning", "batched_factor_updates", "batched_statistics"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name), "None (on a GPU), ")
        check_switch_or_int("batched_decompositions", self.batched_decompositions, low=2)
        check_bool("plain_step_graphs", self.plain_step_graphs)
        object.__setattr__(self, "options", self._resolve_strategy())
        if self.bucket_cap_mb is not None:
            check_float(
                "bucket_cap_mb",
                self.bucket_cap_mb,
                low=0.0,
                allowed="None or a finite number of MiB >= 0 (0: every tensor in its own "
                "collective)",
            )
        if self.comm_dtype is not None and self.comm_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} is not allowed: expected None or "
                f"a floating dtype ({', '.join(map(str, FLOAT_DTYPES))})"
            )
        self._interval_budgets()  # "auto" becomes the default budget, other text refused
        factor_steps = self.factor_update_steps
        if isinstance(factor_steps, (str, IntervalBudget)):
            factor_steps = 1  # what strategies plan with at construction (see update_intervals)
        inv_steps = self.inv_update_steps
        if isinstance(inv_steps, (str, IntervalBudget)):
            inv_steps = factor_steps  # until the budget chooses: every factor update
        # Building the schedules validates constant values now.
        schedules = {
            "damping_at": FloatSchedule(
                "damping",
                self.damping,
                low=0.0,
                low_open=True,
                allowed="a finite number > 0 or a callable of the step",
            ),
            "factor_decay_at": FloatSchedule(
                "factor_decay",
                self.factor_decay,
                low=0.0,
                high=1.0,
                high_open=True,
                allowed="a number in [0, 1) or a callable of the step",
            ),
            # 0 is where a cosine schedule ends (KL clipping then scales nothing: ν = 1).
            "lr_at": FloatSchedule(
                "lr",
                self.lr,
                low=0.0,
                allowed="a finite number >= 0 or a callable of the step",
            ),
            "kl_clip_at": None
            if self.kl_clip is None
            else FloatSchedule(
                "kl_clip",
                self.kl_clip,
                low=0.0,
                low_open=True,
                allowed="a finite number > 0, a callable of the step, or None",
            ),
            "factor_update_steps_at": IntSchedule("factor_update_steps", factor_steps),
            "inv_update_steps_at": IntSchedule("inv_update_steps", inv_steps),
        }
        for key, schedule in schedules.items():
            object.__setattr__(self, key, schedule)
        if not callable(factor_steps) and not callable(inv_steps):
            check_multiple(factor_steps, inv_steps)
        if isinstance(self.skip_layers, str):
            raise ValueError(
                f"skip_layers={self.skip_layers!r} is not allowed: expected a "
                "sequence of regular expressions, e.g. ('fc', 'Embedding')"
            )
        patterns = []
        for pattern in self.skip_layers:
            try:
                patterns.append(re.compile(pattern))
            except (re.error, TypeError) as error:
                raise ValueError(
                    f"skip_layers entry {pattern!r} is not allowed: expected a "
                    f"regular expression ({error})"
                ) from None
        object.__setattr__(self, "skip_patterns", tuple(patterns))

    def _interval_budgets(self) -> None:
        """Each interval's ``"auto"`` becomes the default budget; other text is refused."""
        for name in ("factor_update_steps", "inv_update_steps"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value != AUTO:
                    raise ValueError(
                        f"{name}={value!r} is not allowed: expected an integer >= 1, a "
                        f"callable of the step, {AUTO!r} or dkfac.IntervalBudget(...)"
                    )
                object.__setattr__(self, name, IntervalBudget())
        if self.factor_budget is not None and self.inv_budget is None:
            raise ValueError(
                f"factor_update_steps={self.factor_update_steps!r} is not allowed with "
                f"inv_update_steps={self.inv_update_steps!r}: a chosen factor interval needs "
                "a chosen decomposition interval (inv_update_steps='auto'), which is kept a "
                "multiple of it"
            )

    @property
    def factor_budget(self) -> IntervalBudget | None:
        """The rule that chooses the factor interval, if ``factor_update_steps`` is one."""
        value = self.factor_update_steps
        return value if isinstance(value, IntervalBudget) else None

    @property
    def inv_budget(self) -> IntervalBudget | None:
        """The rule that chooses the decomposition interval, if ``inv_update_steps`` is one."""
        value = self.inv_update_steps
        return value if isinstance(value, IntervalBudget) else None

    def interval_settings(self) -> IntervalSettings:
        """Both intervals as :class:`~dkfac.update_intervals.UpdateIntervals` reads them."""
        return IntervalSettings(
            factor_steps=self.factor_update_steps_at,
            inv_steps=self.inv_update_steps_at,
            factor_budget=self.factor_budget,
            inv_budget=self.inv_budget,
            fixed_factor_steps=f if isinstance(f := self.factor_update_steps, int) else None,
            check=check_multiple,
        )

    def _check_adaptive(self) -> None:
        """Adaptive K-FAC: its options, a constant initial damping, one backward per step."""
        if self.adaptive is None:
            return
        if not isinstance(self.adaptive, AdaptiveOptions):
            raise ValueError(
                f"adaptive={self.adaptive!r} is not allowed: expected None or "
                "dkfac.AdaptiveOptions(loss_fn=...)"
            )
        if callable(self.damping):
            raise ValueError(
                f"damping={describe(self.damping)} is not allowed with adaptive: expected a "
                "number (the initial damping; adaptive K-FAC chooses it from then on)"
            )
        if self.accumulation_steps not in (None, 1):
            raise ValueError(
                f"accumulation_steps={self.accumulation_steps!r} is not allowed with adaptive: "
                "the quadratic model is measured on the one batch passed to step()"
            )
        if self.loss_reduction != "mean":
            raise ValueError(
                f"loss_reduction={self.loss_reduction!r} is not allowed with adaptive: the "
                "factors are per-example averages, so a summed loss's curvature would be "
                "damped N times less in the quadratic model than in the direction (use a "
                "mean loss)"
            )
        low, high = self.adaptive.min_damping, self.adaptive.max_damping
        if not low <= float(self.damping) <= high:
            raise ValueError(
                f"damping={self.damping!r} is not allowed with adaptive: expected a number "
                f"in [min_damping, max_damping] = [{low!r}, {high!r}] (the initial damping)"
            )


#: The names of KFACConfig's arguments (those of ``KFACPreconditioner`` that it takes).
CONFIG_FIELDS = frozenset(f.name for f in fields(KFACConfig) if f.init)
