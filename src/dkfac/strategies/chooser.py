"""Options that choose the strategy when the preconditioner is built (``dkfac.AutoOptions``).

A :class:`StrategyChooser` stands where a strategy's options would (``strategy=``); the
preconditioner asks it, once, at construction, which strategy to run and with what bucket cap
(:meth:`StrategyChooser.choose`), then builds that strategy as if it had been named. The
choice, with why, is kept for ``pre.plan()["chosen"]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from dkfac.strategies.registry import StrategyOptions


@dataclass(frozen=True)
class StrategyChoice:
    """What a chooser chose.

    Attributes:
        options: the strategy's options, as if given as ``strategy=``.
        bucket_cap_mb: the communicator's bucket cap.
        report: why (JSON-ready; ``pre.plan()["chosen"]``).
    """

    options: StrategyOptions
    bucket_cap_mb: float
    report: dict[str, Any] = field(default_factory=dict)


class StrategyChooser(ABC):
    """Chooses a strategy for a model on the running cluster; see the module."""

    #: The ``strategy`` name reports show before the choice (``"auto"``).
    name: ClassVar[str]

    @abstractmethod
    def choose(self, model: nn.Module, config: Any) -> StrategyChoice:
        """The strategy to run ``model`` with under ``config`` (a ``KFACConfig``).

        Collective: every rank calls it at construction, in the same order as its other
        collectives, and every rank must return the same choice.
        """
