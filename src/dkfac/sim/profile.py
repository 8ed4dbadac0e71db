"""What one worker's compute costs: per layer and per step phase, the simulator's input.

A :class:`ComputeProfile` is measured on a machine (:func:`dkfac.sim.profiling.measure_profile`,
``dkfac simulate --profile-here``) or written by hand for one that is not here (a JSON file,
e.g. derived from a GPU's published per-layer rates). Times are seconds per step of one worker
at the profile's batch size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from dkfac.comm.cost_model import CubicCost
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.curvature.factor_side import marked
from dkfac.strategies.layer_shapes import LayerShape

#: Decomposition methods a profile can time (the preconditioner's ``inverse_method``).
METHODS: tuple[str, ...] = INVERSE_METHODS


def _mistyped(record: object) -> list[str]:
    """The fields of dataclass ``record`` whose values are not of their annotated scalar type.

    A profile read from JSON could hold ``"5"`` or ``5.5`` where a dimension belongs; the
    arithmetic would fail much later, far from the file. Integers serve where floats do.
    """
    kinds: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}
    wrong = []
    for name, spec in type(record).__dataclass_fields__.items():  # type: ignore[attr-defined]
        value = getattr(record, name)
        expected = kinds.get(str(spec.type))
        if expected and (isinstance(value, bool) or not isinstance(value, expected)):
            wrong.append(f"{name} must be {spec.type}, got {value!r}")
    return wrong


@dataclass(frozen=True)
class LayerProfile:
    """One preconditioned layer's times, in a plain step and added by K-FAC.

    Attributes:
        name: the module's name in the model.
        a_dim: rows of its ``A`` factor (inputs, plus one for a bias).
        g_dim: rows of its ``G`` factor (outputs).
        output_s: from the start of a plain forward pass until the layer's output exists.
        output_grad_s: from the start of a plain backward pass until its output's gradient
            has arrived.
        grad_ready_s: from the start of a plain backward pass until its weight gradient
            exists (when DDP may send it).
        a_statistic_s: computing its ``A`` statistic (in the forward hook, on a factor
            step, on the workers that capture the layer).
        g_statistic_s: computing its ``G`` statistic (in the backward hook, likewise).
        precondition_s: preconditioning its gradient with its decompositions.
        grad_bytes: bytes of its parameters' gradients (weight and bias).
        a_diagonal: its ``A`` is held as its diagonal (an embedding's;
            :mod:`dkfac.curvature.factor_side`).
        g_diagonal: its ``G`` is.
    """

    name: str
    a_dim: int
    g_dim: int
    output_s: float
    output_grad_s: float
    grad_ready_s: float
    a_statistic_s: float
    g_statistic_s: float
    precondition_s: float
    grad_bytes: int
    a_diagonal: bool = False
    g_diagonal: bool = False

    @property
    def shape(self) -> LayerShape:
        """The layer's factor dimensions, as the planners take them (diagonal sides marked)."""
        a_dim, g_dim = marked(self.a_dim, self.a_diagonal), marked(self.g_dim, self.g_diagonal)
        return LayerShape(self.name, a_dim, g_dim)


@dataclass(frozen=True)
class ComputeProfile:
    """One worker's compute at ``batch_size``: the whole step and each layer.

    Attributes:
        device: where it was measured or what it describes (free text).
        batch_size: samples per worker per step.
        forward_s: a plain forward pass (and loss); a factor step adds the statistics of
            the layers a worker captures (:attr:`LayerProfile.a_statistic_s`).
        backward_s: a plain backward pass (likewise ``g_statistic_s``).
        optimizer_s: the optimizer's step.
        factor_update_s: folding every factor's statistics into its running average (all
            layers; a worker that keeps some factors pays their share by ``d²``).
        decomposition: per method (:data:`METHODS`), the time of one ``d × d``
            factor's decomposition, ``c0 + c3·d³``.
        layers: the preconditioned layers, in the model's registration order.
        other_grad_bytes: gradients of parameters outside those layers (normalisation and
            the like): DDP sends them with the last layers' bucket.
        pack_bytes_per_s: how fast the communicator packs a bucket and unpacks its result
            (payload bytes per second, on the training thread); ``0``: free.
    """

    device: str
    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    factor_update_s: float
    decomposition: dict[str, CubicCost]
    layers: tuple[LayerProfile, ...]
    other_grad_bytes: int = 0
    pack_bytes_per_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid compute profile: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with this profile (empty when nothing is)."""
        problems = _mistyped(self) + [
            f"layer {getattr(layer, 'name', layer)!r}: {p}"
            for layer in self.layers
            for p in (_mistyped(layer) if isinstance(layer, LayerProfile) else ["not a layer"])
        ]
        if problems:
            return problems  # the checks below compare values of these types
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, got {self.batch_size}")
        for name in (
            "forward_s",
            "backward_s",
            "optimizer_s",
            "factor_update_s",
            "pack_bytes_per_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a finite time >= 0, got {value}")
        if not self.layers:
            problems.append("a profile needs at least one preconditioned layer")
        for method, cost in self.decomposition.items():
            if method not in METHODS:
                problems.append(f"unknown decomposition method {method!r}")
            problems += [f"{method} decomposition: {p}" for p in cost.problems()]
        for layer in self.layers:
            times = (
                layer.output_s,
                layer.output_grad_s,
                layer.grad_ready_s,
                layer.a_statistic_s,
                layer.g_statistic_s,
                layer.precondition_s,
            )
            if not all(math.isfinite(t) and t >= 0 for t in times):
                problems.append(f"layer {layer.name!r}: times must be finite and >= 0")
            if layer.output_s > self.forward_s:
                problems.append(f"layer {layer.name!r}: its output exists after forward ends")
            if max(layer.output_grad_s, layer.grad_ready_s) > self.backward_s:
                problems.append(f"layer {layer.name!r}: a gradient is ready after backward ends")
            if min(layer.a_dim, layer.g_dim, layer.grad_bytes) < 1:
                problems.append(f"layer {layer.name!r}: dimensions and bytes must be >= 1")
            if not all(isinstance(flag, bool) for flag in (layer.a_diagonal, layer.g_diagonal)):
                problems.append(f"layer {layer.name!r}: a_diagonal and g_diagonal must be bool")
        return problems

    @property
    def shapes(self) -> list[LayerShape]:
        """Every layer's factor dimensions, in registration order."""
        return [layer.shape for layer in self.layers]

    def pack_s(self, nbytes: float) -> float:
        """Packing a bucket of ``nbytes`` payload and unpacking its result."""
        return nbytes / self.pack_bytes_per_s if self.pack_bytes_per_s > 0 else 0.0

    def decomposition_cost(self, method: str) -> CubicCost:
        """The decomposition time of ``method``.

        Raises:
            ValueError: the profile did not time ``method``.
        """
        if method not in self.decomposition:
            raise ValueError(
                f"the compute profile ({self.device}) has no {method!r} decomposition times: "
                f"it has {', '.join(sorted(self.decomposition)) or 'none'}"
            )
        return self.decomposition[method]

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        data = asdict(self)
        data["decomposition"] = {
            method: {"c0_s": cost.c0, "c3_s": cost.c3, "r_squared": cost.r_squared}
            for method, cost in self.decomposition.items()
        }
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComputeProfile:
        """The profile ``to_dict`` wrote (or one written by hand in that format).

        Raises:
            ValueError: a missing or unknown key, or values that fail :meth:`problems`.
        """
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"compute profile: unknown keys {', '.join(unknown)}")
        if not isinstance(data.get("decomposition"), dict) or not isinstance(
            data.get("layers"), list | tuple
        ):
            raise ValueError("compute profile: 'decomposition' must be an object, 'layers' a list")
        try:
            decomposition = {
                method: CubicCost(
                    float(cost["c0_s"]), float(cost["c3_s"]), float(cost.get("r_squared", 1.0))
                )
                for method, cost in data["decomposition"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"compute profile: malformed decomposition ({error})") from None
        try:
            layers = tuple(LayerProfile(**layer) for layer in data["layers"])
            values = {k: v for k, v in data.items() if k not in ("decomposition", "layers")}
            return cls(decomposition=decomposition, layers=layers, **values)
        except (KeyError, TypeError) as error:
            raise ValueError(f"compute profile: missing or malformed entry ({error})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ComputeProfile:
        """Read a profile written by :meth:`save` (see :meth:`from_dict`)."""
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a compute profile is a JSON object")
        return cls.from_dict(data)
