"""Option values that are a number or ``auto``: the bucket size and the update intervals."""

from __future__ import annotations

from typing import Any

from dkfac.update_intervals import AUTO

#: Options that take a positive integer or ``auto`` (the library's interval budgets).
INTERVAL_OPTIONS: tuple[str, ...] = ("factor_update_steps", "inv_update_steps")


class ConfigError(ValueError):
    """A configuration the command refuses; its message is the one line the user sees."""


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
