"""One adaptive K-FAC step: choose ``α``, ``μ`` on the quadratic model, move, adapt the damping."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.adaptive.gauss_newton import gauss_newton_products, loss_at
from dkfac.adaptive.options import AdaptiveOptions
from dkfac.adaptive.quadratic_model import (
    levenberg_marquardt,
    minimise_quadratic_model,
    reduction_ratio,
)
from dkfac.curvature.blocks import KroneckerBlock

logger = logging.getLogger(__name__)

#: ``average(values)``: the element-wise mean of a float64 vector over every worker.
Average = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class AdaptiveReport:
    """What the last adaptive step chose.

    Attributes:
        step: the K-FAC step it was.
        learning_rate: ``α``, the multiple of minus the K-FAC direction.
        momentum: ``μ``, the multiple of the previous update (0 on the first step).
        predicted_change: ``M(δ)``, the quadratic model's change of the loss (<= 0).
        loss: the batch loss before the step (mean over workers).
        ratio: ``ρ`` when the damping was adapted at this step, else ``None``.
        damping: ``λ`` after the step.
    """

    step: int
    learning_rate: float
    momentum: float
    predicted_change: float
    loss: float
    ratio: float | None
    damping: float


class AdaptiveStep:
    """Adaptive K-FAC's state (damping, previous update) and its step.

    Args:
        options: the validated options.
        damping: the initial ``λ``.
        model: the unwrapped model (names its parameters for ``torch.func``).
    """

    def __init__(self, options: AdaptiveOptions, damping: float, model: nn.Module) -> None:
        self.options = options
        self.damping = min(options.max_damping, max(options.min_damping, damping))
        self._model = model
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._previous: dict[str, Tensor] = {}
        self.last: AdaptiveReport | None = None

    def _named(
        self, blocks: Sequence[KroneckerBlock], matrices: Sequence[Tensor]
    ) -> dict[str, Tensor]:
        named = {}
        for block, matrix in zip(blocks, matrices, strict=True):
            for parameter, part in zip(block.parameters(), block.split_matrix(matrix), strict=True):
                named[self._names[id(parameter)]] = part
        return named

    def step(
        self,
        step: int,
        names: Sequence[str],
        blocks: Sequence[KroneckerBlock],
        grads: Sequence[Tensor],
        directions: Sequence[Tensor],
        batch: tuple[Sequence[Any], Any],
        average: Average,
    ) -> None:
        """Move the layers' parameters by ``δ = α·(−direction) + μ·δ₀`` and clear their ``.grad``.

        Args:
            step: the K-FAC step (completed ``step()`` calls before this one).
            names: the layers' names (key the previous update).
            blocks: the layers' blocks (their parameters move).
            grads: the gradient matrices, the same on every worker.
            directions: the K-FAC directions, the same on every worker.
            batch: ``(inputs, targets)`` of this step on this worker.
            average: the mean of a float64 vector over the workers.
        """
        options, (inputs, targets) = self.options, batch
        vectors = [[-direction for direction in directions]]
        if options.momentum:
            vectors.append(
                [
                    self._previous.get(name, torch.zeros_like(direction))
                    for name, direction in zip(names, directions, strict=True)
                ]
            )
        k = len(vectors)
        inner = torch.zeros(k, k, dtype=torch.float64)
        linear = torch.zeros(k, dtype=torch.float64)
        for i, vector in enumerate(vectors):
            linear[i] = sum(
                (g.double() * v.double()).sum() for g, v in zip(grads, vector, strict=True)
            )
            for j in range(i, k):
                inner[i, j] = inner[j, i] = sum(
                    (u.double() * v.double()).sum() for u, v in zip(vector, vectors[j], strict=True)
                )
        parameters = {self._names[id(p)]: p for block in blocks for p in block.parameters()}
        loss, curvature = gauss_newton_products(
            self._model,
            parameters,
            [self._named(blocks, vector) for vector in vectors],
            inputs,
            targets,
            options.loss_fn,
        )
        # Everything the solution depends on, averaged together: every worker then solves the
        # same system bit for bit (gradients and directions already agree; this makes sure).
        device = directions[0].device  # collectives run on the model's device
        local = torch.cat([curvature.reshape(-1), inner.reshape(-1), linear, loss.reshape(1)])
        agreed = average(local.to(device)).cpu()
        curvature = agreed[: k * k].reshape(k, k)
        inner = agreed[k * k : 2 * k * k].reshape(k, k)
        linear = agreed[2 * k * k : 2 * k * k + k]
        loss_before = float(agreed[-1])
        chosen = minimise_quadratic_model(curvature, inner, linear, self.damping)
        updates = []
        for index, direction in enumerate(directions):
            update = torch.zeros_like(direction)
            for coefficient, vector in zip(chosen.coefficients, vectors, strict=True):
                update.add_(vector[index].to(direction), alpha=coefficient)
            updates.append(update)
        ratio = None
        if (step + 1) % options.damping_interval == 0:
            moved = {
                name: parameters[name].detach() + part
                for name, part in self._named(blocks, updates).items()
            }
            after = loss_at(self._model, moved, inputs, targets, options.loss_fn)
            loss_after = float(
                average(torch.tensor([after], dtype=torch.float64, device=device))[0]
            )
            ratio = reduction_ratio(loss_before, loss_after, chosen.predicted_change)
            self.damping = levenberg_marquardt(
                self.damping, ratio, options.omega, options.min_damping, options.max_damping
            )
        with torch.no_grad():
            for block, update in zip(blocks, updates, strict=True):
                for parameter, part in zip(
                    block.parameters(), block.split_matrix(update), strict=True
                ):
                    parameter.add_(part)
                    parameter.grad = None
        self._previous = dict(zip(names, updates, strict=True))
        coefficients = (*chosen.coefficients, 0.0)
        self.last = AdaptiveReport(
            step=step,
            learning_rate=coefficients[0],
            momentum=coefficients[1],
            predicted_change=chosen.predicted_change,
            loss=loss_before,
            ratio=ratio,
            damping=self.damping,
        )
        logger.debug("adaptive K-FAC: %s", self.last)

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The damping and the previous update (to continue identically)."""
        return {
            "damping": self.damping,
            "previous": {name: update.clone() for name, update in self._previous.items()},
        }

    @staticmethod
    def check_state(state: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise unless ``state`` is :meth:`state` output for layers of ``shapes``.

        Args:
            state: the saved adaptive state.
            shapes: each layer's gradient-matrix shape, by name.

        Raises:
            ValueError: the state is missing or does not match (a layer unknown, a shape).
        """
        if not isinstance(state, dict) or set(state) != {"damping", "previous"}:
            raise ValueError(
                "state_dict has no adaptive K-FAC state ('adaptive': damping and previous "
                "update): it was saved without adaptive=..."
            )
        for name, update in state["previous"].items():
            if name not in shapes or tuple(update.shape) != shapes[name]:
                raise ValueError(
                    f"adaptive state's previous update of {name!r} does not match the model "
                    f"(expected a matrix of shape {shapes.get(name)})"
                )

    def load(self, state: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Restore :meth:`state` output (checked by :meth:`check_state`)."""
        self.check_state(state, shapes)
        self.damping = float(state["damping"])
        self._previous = {name: update.clone() for name, update in state["previous"].items()}
