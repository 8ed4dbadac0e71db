"""The strategy a preconditioner runs: the one its configuration names, or the one chosen."""

from __future__ import annotations

from torch import nn

from dkfac.comm import StepRecorder
from dkfac.config import DEFAULT_BUCKET_CAP_MB, KFACConfig
from dkfac.strategies import make_strategy
from dkfac.strategies.base import Strategy
from dkfac.strategies.chooser import StrategyChoice, StrategyChooser


def start_strategy(
    config: KFACConfig, model: nn.Module, recorder: StepRecorder
) -> tuple[Strategy, StrategyChoice | None]:
    """Build ``config``'s strategy for ``model``; with a chooser, the one it chooses (and why).

    Collective for distributed strategies (process groups, calibrations), and for a chooser
    (:meth:`~dkfac.strategies.chooser.StrategyChooser.choose`): every rank calls it in the
    same order.
    """
    options, cap, choice = config.options, config.bucket_cap_mb, None
    if cap is None:
        cap = DEFAULT_BUCKET_CAP_MB
    if isinstance(options, StrategyChooser):
        choice = options.choose(model, config)
        options, cap = choice.options, choice.bucket_cap_mb
    strategy = make_strategy(
        options,
        recorder,
        bucket_cap_mb=cap,
        comm_dtype=config.comm_dtype,
        inverse_method=config.inverse_method,
        inv_dtype=config.inv_dtype,
        factor_dtype=config.factor_dtype,
        inv_update_steps=config.inv_update_steps_at(0),
    )
    return strategy, choice
