"""The preconditioner's saved state: steps, running factors and decompositions per layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dkfac.curvature.layer import LayerCurvature

STATE_VERSION = 1


def pack_state(steps: int, inverse_method: str, layers: Sequence[LayerCurvature]) -> dict[str, Any]:
    """Everything needed to continue bitwise identically, as ``state_dict()`` returns it.

    Args:
        steps: completed ``step()`` calls.
        inverse_method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        layers: the preconditioned layers (running factors and decompositions).
    """
    return {
        "version": STATE_VERSION,
        "steps": steps,
        "inverse_method": inverse_method,
        "layers": {layer.name: layer.state() for layer in layers},
    }


def restore_state(state: Any, layers: Sequence[LayerCurvature], inverse_method: str) -> int:
    """Load ``state`` (from :func:`pack_state`) into ``layers``; returns the saved step count.

    Everything is validated before anything changes.

    Args:
        state: what :func:`pack_state` returned (possibly through ``torch.save``/``load``).
        layers: the preconditioned layers.
        inverse_method: the preconditioner's method; saved decompositions must be of it.

    Raises:
        ValueError: the state is not a dkfac state, or does not match the layers or the
            method.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(
            f"state_dict is not a dkfac KFACPreconditioner state (version {STATE_VERSION} expected)"
        )
    saved = state["layers"]
    names = {layer.name for layer in layers}
    if set(saved) != names:
        missing, unexpected = sorted(names - set(saved)), sorted(set(saved) - names)
        embeddings = any(
            layer.name in missing and layer.block.kind == "Embedding" for layer in layers
        )
        hint = (
            " (a state saved before nn.Embedding was preconditioned by default loads with "
            "skip_layers=('Embedding',))"
            if embeddings
            else ""
        )
        raise ValueError(
            f"state_dict layers do not match the model: missing {missing}, unexpected "
            f"{unexpected}{hint}"
        )
    for layer in layers:
        layer.check_state(saved[layer.name], inverse_method)
    for layer in layers:
        layer.load_state(saved[layer.name])
    return int(state["steps"])


def needs_decomposition(layers: Sequence[LayerCurvature]) -> bool:
    """Whether loaded layers have factors but no decomposition anywhere.

    So is a state saved on another world size, where decompositions live on their owners: it
    is decomposed at the next step, on every rank.

    Args:
        layers: the layers after loading.
    """
    has_factors = any(layer.a is not None or layer.g is not None for layer in layers)
    return has_factors and all(layer.inverse is None for layer in layers)
