"""Checks of adaptive K-FAC's saved state against its options and the model's layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from dkfac.adaptive.options import AdaptiveOptions
from dkfac.curvature.blocks import KroneckerBlock
from dkfac.validation import check_float

#: Keys every saved state has.
REQUIRED = frozenset({"damping", "refusals", "rejected_steps", "previous"})
#: "before" (the parameters an unchecked last step started from) is optional: states saved
#: before it existed load as after a checked step.
OPTIONAL = frozenset({"before"})


def check_saved_state(
    state: Any,
    options: AdaptiveOptions,
    blocks: Mapping[str, KroneckerBlock],
    parameters: Mapping[str, Tensor],
) -> None:
    """Raise unless ``state`` is ``AdaptiveStep.state()`` output for the layers ``blocks``.

    Args:
        state: the saved adaptive state.
        options: the options of the run it loads into (they bound the damping).
        blocks: each preconditioned layer's block, by name.
        parameters: the preconditioned layers' parameters, by the model's names (only
            those are put back after an unchecked step).

    Raises:
        ValueError: the state is missing or does not match (a layer or parameter unknown, a
            shape, a damping outside ``[min_damping, max_damping]``).
    """
    if not isinstance(state, dict) or not REQUIRED <= set(state) <= REQUIRED | OPTIONAL:
        raise ValueError(
            "state_dict has no adaptive K-FAC state ('adaptive': damping and previous "
            "update): it was saved without adaptive=..."
        )
    damping = state["damping"]
    below = isinstance(damping, float) and 0.0 < damping < options.min_damping
    check_float(
        "the saved adaptive damping",
        damping,
        low=options.min_damping,
        high=options.max_damping,
        allowed=f"a number in [{options.min_damping!r}, {options.max_damping!r}]"
        + (
            f" (a state saved under a lower floor, as the default before 2026-11-27, 1e-5, "
            f"loads with min_damping <= {damping!r})"
            if below
            else ""
        ),
    )
    for name, update in state["previous"].items():
        block = blocks.get(name)
        shape = None if block is None else (block.g_dim, block.a_dim)
        if not isinstance(update, Tensor) or tuple(update.shape) != shape:
            raise ValueError(
                f"adaptive state's previous update of {name!r} does not match the model "
                f"(expected a matrix of shape {shape})"
            )
    before = state.get("before", {})
    if not isinstance(before, dict):
        raise ValueError(
            "adaptive state's 'before' (the parameters before an unchecked step) is not a dict "
            "of tensors by parameter name"
        )
    for name, kept in before.items():
        parameter = parameters.get(name)
        wanted = None if parameter is None else tuple(parameter.shape)
        if not isinstance(kept, Tensor) or tuple(kept.shape) != wanted:
            raise ValueError(
                f"adaptive state's parameter {name!r} before its last step does not match the "
                f"model (expected a tensor of shape {wanted})"
            )
