"""The strategies dkfac has, each with its typed options: the one list of names.

The preconditioner, the command line, the benchmarks and the dry run take their names and
checks from :data:`STRATEGIES`. ``strategy="kaisa"`` is shorthand for ``KAISAOptions()``; an
options object carries what only that strategy reads, validated once when it is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from dkfac.comm.cost_model import ClusterCostModel, CostModelCache

#: What PAD-KFAC's owners broadcast: their factors' decompositions, the layers' preconditioned
#: gradients, or whichever moves fewer bytes per step at the run's schedule.
PADShare = Literal["decompositions", "gradients", "auto"]
PAD_SHARES: tuple[PADShare, ...] = ("decompositions", "gradients", "auto")


def check_share(share: object) -> None:
    """Raise ``ValueError`` unless ``share`` is one of :data:`PAD_SHARES`."""
    if not isinstance(share, str) or share not in PAD_SHARES:
        raise ValueError(
            f"share={share!r} is not allowed: expected one of {', '.join(map(repr, PAD_SHARES))}"
        )


def _divisors(world_size: int) -> str:
    return ", ".join(f"{k}/{world_size}" for k in range(1, world_size + 1) if world_size % k == 0)


@dataclass(frozen=True)
class StrategyOptions:
    """Options of a strategy; the base class is a strategy that takes none."""

    #: The ``strategy=`` name these options select.
    name: ClassVar[str]

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` if these options cannot run on ``world_size`` workers."""


@dataclass(frozen=True)
class LocalOptions(StrategyOptions):
    """``strategy="local"``: everything on this worker."""

    name: ClassVar[str] = "local"


@dataclass(frozen=True)
class DKFACOptions(StrategyOptions):
    """``strategy="dkfac"``: D-KFAC (factors allreduced, decompositions broadcast)."""

    name: ClassVar[str] = "dkfac"


@dataclass(frozen=True)
class KAISAOptions(StrategyOptions):
    """``strategy="kaisa"``.

    Attributes:
        grad_worker_fraction: the fraction ``f`` of workers that hold each layer's
            decomposition and precondition it; ``f·P`` must be a whole number dividing ``P``
            (1: COMM-OPT, as D-KFAC; ``1/P``: MEM-OPT).
    """

    name: ClassVar[str] = "kaisa"
    grad_worker_fraction: float = 1.0

    def __post_init__(self) -> None:
        f = self.grad_worker_fraction
        if (
            isinstance(f, bool)
            or not isinstance(f, int | float)
            or not math.isfinite(f)
            or not 0 < f <= 1
        ):
            raise ValueError(
                f"grad_worker_fraction={f!r} is not allowed: expected a number in (0, 1], "
                "e.g. 1/P, 2/P, ..., 1"
            )

    def grad_workers(self, world_size: int) -> int:
        """``f·P``, the number of gradient workers per layer, checked against ``world_size``.

        Raises:
            ValueError: ``f·P`` is not a whole number dividing ``P``.
        """
        count = self.grad_worker_fraction * world_size
        rounded = round(count)
        if not math.isclose(count, rounded, abs_tol=1e-9) or rounded < 1 or world_size % rounded:
            raise ValueError(
                f"grad_worker_fraction={self.grad_worker_fraction!r} is not allowed with "
                f"{world_size} workers: fraction·P must be an integer dividing P "
                f"(allowed: {_divisors(world_size)})"
            )
        return rounded

    def check_world_size(self, world_size: int) -> None:
        """``f·P`` must be a whole number dividing ``P``."""
        self.grad_workers(world_size)


@dataclass(frozen=True)
class PipelinedOptions(StrategyOptions):
    """Options of the strategies that launch factor collectives from the hooks.

    Attributes:
        profile_steps: factor-update windows whose ready times are measured before the fusion
            is re-planned with the alpha-beta merge rule (0: keep the size plan).
        cost_model: the cluster's measured costs; a :class:`CostModelCache` to take them from
            (measured there on first use); ``None`` measures them when the preconditioner is
            built.
    """

    name: ClassVar[str]
    profile_steps: int = 5
    cost_model: ClusterCostModel | CostModelCache | None = None

    def __post_init__(self) -> None:
        steps = self.profile_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"profile_steps={steps!r} is not allowed: expected an integer >= 0")
        if self.cost_model is not None and not isinstance(
            self.cost_model, ClusterCostModel | CostModelCache
        ):
            raise ValueError(
                f"cost_model={self.cost_model!r} is not allowed: expected a "
                "dkfac.comm.ClusterCostModel, a CostModelCache or None"
            )


@dataclass(frozen=True)
class SPDOptions(PipelinedOptions):
    """``strategy="spd"``: SPD-KFAC (pipelined, fused, balanced decomposition placement)."""

    name: ClassVar[str] = "spd"


@dataclass(frozen=True)
class PADOptions(PipelinedOptions):
    """``strategy="pad"``: PAD-KFAC (reduce to owner, optimal contiguous partition).

    Attributes:
        share: what the owners broadcast: ``"decompositions"`` (each factor's owner sends its
            decomposition to every worker, which preconditions every layer), ``"gradients"``
            (each layer has one owner, which decomposes both factors, preconditions the layer
            and sends its preconditioned gradient every step) or ``"auto"`` (whichever moves
            fewer predicted bytes per step at the run's ``inv_update_steps``).
    """

    name: ClassVar[str] = "pad"
    share: PADShare = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_share(self.share)


@dataclass(frozen=True)
class DPOptions(StrategyOptions):
    """``strategy="dp"``: DP-KFAC (no factor traffic; owners use their own shard)."""

    name: ClassVar[str] = "dp"


@dataclass(frozen=True)
class StrategySpec:
    """One strategy as users choose it.

    Attributes:
        options: its options class (``options()`` is what the bare name means).
        moves: what travels between workers, in one line (README, ``--help``).
        reference: where the scheme is published.
        distributed: whether it runs across workers (every strategy but ``local``).
    """

    options: type[StrategyOptions]
    moves: str
    reference: str
    distributed: bool = True

    @property
    def name(self) -> str:
        """The ``strategy=`` name."""
        return self.options.name


#: Every strategy, in the order the documentation lists them.
STRATEGIES: Mapping[str, StrategySpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            StrategySpec(LocalOptions, "nothing", "Martens & Grosse 2015", distributed=False),
            StrategySpec(
                DKFACOptions,
                "factors allreduced; each layer decomposed by one owner and broadcast",
                "Pauloski et al., SC20",
            ),
            StrategySpec(
                KAISAOptions,
                "as dkfac, decompositions to f·P workers per layer, gradients from them",
                "Pauloski et al., SC21",
            ),
            StrategySpec(
                SPDOptions,
                "factors allreduced from the hooks in fused buckets; balanced decompositions",
                "Shi, Zhang, Li, ICDCS 2021",
            ),
            StrategySpec(
                PADOptions,
                "factors reduced to their owners from the hooks; owners broadcast "
                "decompositions or preconditioned gradients, whichever is fewer bytes",
                "Lin Zhang's thesis (PAD-KFAC)",
            ),
            StrategySpec(
                DPOptions,
                "no factors; owners broadcast preconditioned gradients",
                "Zhang, Shi, Wang, Li, 2022",
            ),
        )
    }
)


def strategy_names(*, distributed: bool | None = None) -> tuple[str, ...]:
    """Names of the strategies (only the distributed ones, or only not, if asked)."""
    return tuple(
        name
        for name, spec in STRATEGIES.items()
        if distributed is None or spec.distributed == distributed
    )


def resolve_options(strategy: str | StrategyOptions, **shorthand: Any) -> StrategyOptions:
    """The options object ``strategy`` means, with the flat keyword shorthands applied.

    ``shorthand`` holds the preconditioner's flat keywords (``grad_worker_fraction=``,
    ``profile_steps=``, ``cost_model=``, ``share=``); ``None`` means not given. Each given one
    is applied to the options that have it; one set to something other than its default for a
    strategy that does not read it is an error, as is any given next to an options object (say
    it in the object).

    Raises:
        ValueError: an unknown name, an option the strategy does not have, or a bad value.
    """
    registered = {spec.options for spec in STRATEGIES.values()}
    if isinstance(strategy, StrategyOptions) and type(strategy) in registered:
        options_class: type[StrategyOptions] = type(strategy)
    elif isinstance(strategy, str) and strategy in STRATEGIES:
        options_class = STRATEGIES[strategy].options
    else:
        raise ValueError(
            f"strategy={strategy!r} is not allowed: expected one of "
            f"{', '.join(map(repr, STRATEGIES))} or an options object "
            f"({', '.join(spec.options.__name__ for spec in STRATEGIES.values())})"
        )
    fields = {f.name for f in dataclasses.fields(options_class)}
    defaults = _shorthand_defaults()
    applied = {}
    for key, value in shorthand.items():
        if value is None:  # not given
            continue
        if key in fields and not isinstance(strategy, StrategyOptions):
            applied[key] = value
        elif isinstance(strategy, StrategyOptions) or _differs(value, defaults[key]):
            owners = [s.name for s in STRATEGIES.values() if key in _field_names(s.options)]
            where = (
                f"set it in the options object ({options_class.__name__}({key}=...))"
                if key in fields
                else f"it is an option of strategy {' or '.join(map(repr, owners))}"
            )
            raise ValueError(
                f"{key}={value!r} is not allowed with strategy={options_class.name!r}: {where}"
            )
    if isinstance(strategy, StrategyOptions):
        return strategy
    return options_class(**applied)


def option_keywords(strategy: str, **values: Any) -> dict[str, Any]:
    """The entries of ``values`` that strategy ``strategy``'s options have.

    For callers that hold every shorthand (a command line's flags) and pass on only those the
    chosen strategy reads.
    """
    fields = _field_names(STRATEGIES[strategy].options) if strategy in STRATEGIES else set()
    return {key: value for key, value in values.items() if key in fields}


def _differs(value: Any, default: Any) -> bool:
    """Whether ``value`` says something other than ``default`` (``True`` is not ``1.0``)."""
    if value is default:
        return False
    return bool(value != default) or isinstance(value, bool) != isinstance(default, bool)


def _field_names(options_class: type[StrategyOptions]) -> set[str]:
    return {f.name for f in dataclasses.fields(options_class)}


def _shorthand_defaults() -> dict[str, Any]:
    """Default of every option some strategy has, by name."""
    defaults: dict[str, Any] = {}
    for spec in STRATEGIES.values():
        for f in dataclasses.fields(spec.options):
            defaults.setdefault(f.name, f.default)
    return defaults
