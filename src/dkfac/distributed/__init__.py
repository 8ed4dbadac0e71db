"""Placement strategies and (later) the communicator they share.

:func:`make_strategy` maps a ``strategy=`` name to its implementation.
"""

from __future__ import annotations

from dkfac.distributed.local import LocalStrategy
from dkfac.distributed.strategy import Strategy

STRATEGY_NAMES: tuple[str, ...] = ("local",)


def make_strategy(name: str) -> Strategy:
    """The strategy called ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name == LocalStrategy.name:
        return LocalStrategy()
    raise ValueError(
        f"strategy={name!r} is not allowed: expected one of {', '.join(map(repr, STRATEGY_NAMES))}"
    )


__all__ = ["STRATEGY_NAMES", "LocalStrategy", "Strategy", "make_strategy"]
