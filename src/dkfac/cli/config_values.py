"""Option values checked on their own: the bucket size, the intervals, adaptive's rule, ...

... and the preconditioning's method with its precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields
from typing import Any

from dkfac.adaptive.options import AdaptiveOptions
from dkfac.curvature.inverse import check_method_precision
from dkfac.update_intervals import AUTO

#: Options that take a positive integer or ``auto`` (the library's interval budgets).
INTERVAL_OPTIONS: tuple[str, ...] = ("factor_update_steps", "inv_update_steps")
#: ``KFACPreconditioner``'s keywords the command passes from its options of the same name.
PRECONDITIONER_OPTIONS: tuple[str, ...] = (
    "inverse_method",
    "statistics_precision",
    "conv_patches",
    "statistics_fraction",
    "precondition_precision",
    "plain_step_graphs",
    "damping",
    "factor_decay",
    "factor_update_steps",
    "inv_update_steps",
)
#: ``--adaptive-trusted-decrease``'s word for ``AdaptiveOptions(trusted_decrease=None)``.
NEVER = "never"
#: Options given as a number or a word (their flags take text).
WORDED_OPTIONS: tuple[str, ...] = (*INTERVAL_OPTIONS, "adaptive_trusted_decrease")


class ConfigError(ValueError):
    """A configuration the command refuses; its message is the one line the user sees."""


def check_method_precision_flags(inverse_method: str, precondition_precision: str) -> None:
    """``--inverse-method`` with ``--precondition-precision`` (a recipe's too), as the library.

    Raises:
        ConfigError: a pair the library refuses (``cholesky`` with ``bf16``).
    """
    try:
        check_method_precision(inverse_method, precondition_precision)
    except ValueError as error:
        raise ConfigError(
            f"--inverse-method {inverse_method} is not allowed with --precondition-precision "
            f"{precondition_precision} (a recipe may set it: add --precondition-precision "
            f"highest): {str(error).split(': ', 1)[1]}"
        ) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def interval_value(name: str, value: Any) -> int | str:
    """An update interval from a flag or a config file: an integer ``>= 1``, or ``"auto"``.

    ``auto`` in any case, and surrounding spaces, are accepted.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        value = int(text) if text.isdigit() else text
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{_flag(name)} {value!r} is not allowed: expected an integer >= 1 or auto "
            "(chosen from the run's own step, factor update and decomposition times)"
        )
    return value


def check_intervals(factor_steps: int | str, inv_steps: int | str) -> None:
    """Refuse intervals the preconditioner would refuse, naming the flags.

    Raises:
        ConfigError: a factor interval ``auto`` with a fixed decomposition interval, or a fixed
            decomposition interval that is not a multiple of a fixed factor interval.
    """
    if factor_steps == AUTO and inv_steps != AUTO:
        raise ConfigError(
            f"--factor-update-steps auto is not allowed with --inv-update-steps {inv_steps}: "
            "a chosen factor interval needs a chosen decomposition interval (auto), which is "
            "kept a multiple of it"
        )
    if isinstance(factor_steps, int) and isinstance(inv_steps, int) and inv_steps % factor_steps:
        raise ConfigError(
            f"--inv-update-steps {inv_steps} is not allowed: expected a multiple of "
            f"--factor-update-steps {factor_steps}"
        )


def parse_bucket_mb(bucket_mb: str, grad_sync: str) -> float | str:
    """``--bucket-mb`` parsed: MiB (a float), or ``"auto"`` (DeAR's online search).

    ``auto`` in any case, and surrounding spaces, are accepted.

    Raises:
        ConfigError: not a positive number or ``auto``, or ``auto`` without DeAR.
    """
    text = str(bucket_mb).strip()
    if text.lower() == AUTO:
        if grad_sync != "dear":
            raise ConfigError(
                f"--bucket-mb auto is not allowed with --grad-sync {grad_sync}: the "
                "online bucket-size search is DeAR's (--grad-sync dear); give DDP a number"
            )
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(
            f"--bucket-mb {bucket_mb!r} is not allowed: expected a number of MiB > 0 "
            "or auto (with --grad-sync dear)"
        )
    return value


#: Adaptive K-FAC's options (:class:`dkfac.AdaptiveOptions`), each ``--adaptive-<name>``,
#: besides the model's share (``--adaptive-model-fraction``): its damping rule, and the
#: fewest target elements the model's part keeps.
ADAPTIVE_RULE: tuple[str, ...] = (
    "damping_interval",
    "damping_decay",
    "min_damping",
    "trusted_decrease",
    "min_model_targets",
)


def trusted_decrease_value(value: Any) -> float | str:
    """``--adaptive-trusted-decrease`` from a flag or a config file: a number, or ``never``.

    Its range is :class:`dkfac.AdaptiveOptions`' to check (:func:`check_adaptive_rule`).

    Raises:
        ConfigError: neither a number nor ``never``.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == NEVER:
            return NEVER
        with contextlib.suppress(ValueError):
            return float(text)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"--adaptive-trusted-decrease {value!r} is not allowed: expected a number > 0 or "
        f"{NEVER} (no check between the damping's checks)"
    )


def adaptive_value(value: Any) -> Any:
    """A rule's value as :class:`dkfac.AdaptiveOptions` takes it (``never`` is ``None``)."""
    return None if value == NEVER else value


def adaptive_default(name: str) -> Any:
    """The default of :class:`dkfac.AdaptiveOptions`' field ``name``: the command's, too."""
    return next(f.default for f in fields(AdaptiveOptions) if f.name == name)


def check_adaptive_rule(
    adaptive: bool, rule: dict[str, Any], model_fraction: float, damping: float
) -> None:
    """Refuse adaptive K-FAC's options where :class:`dkfac.AdaptiveOptions` would refuse them.

    Args:
        adaptive: ``--adaptive``.
        rule: ``ADAPTIVE_RULE``'s values, by name.
        model_fraction: ``--adaptive-model-fraction``.
        damping: ``--damping``, adaptive K-FAC's initial damping.

    Raises:
        ConfigError: a value changed without ``--adaptive``, one out of its range, or an
            initial damping below the floor (checked here, before any worker starts).
    """
    changed = [name for name, value in rule.items() if value != adaptive_default(name)]
    if changed and not adaptive:
        raise ConfigError(
            f"{_flag('adaptive_' + changed[0])} is not allowed without --adaptive: it sets "
            "an option of adaptive K-FAC"
        )
    try:
        AdaptiveOptions(loss_fn=_no_loss, model_fraction=model_fraction, **rule)
    except ValueError as error:
        named = [name for name in (*ADAPTIVE_RULE, "model_fraction") if f"{name}=" in str(error)]
        flag = _flag("adaptive_" + (named[0] if named else "model_fraction"))
        said = str(error).replace(", or None", f", or {NEVER}")  # the command's word for None
        raise ConfigError(f"{flag}: {said}") from error
    if adaptive and not rule["min_damping"] <= damping <= adaptive_default("max_damping"):
        raise ConfigError(
            f"--damping {damping!r} is not allowed with --adaptive: expected a number in "
            f"[--adaptive-min-damping {rule['min_damping']!r}, "
            f"{adaptive_default('max_damping')!r}]"
        )


def _no_loss(outputs: Any, targets: Any) -> Any:
    """A placeholder loss: only :class:`dkfac.AdaptiveOptions`' other checks run on it."""
    return outputs
