"""One adaptive K-FAC step: choose ``α``, ``μ`` on the quadratic model, move, adapt the damping."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.adaptive.gauss_newton import (
    LOW_PRECISION,
    BatchedPasses,
    ModelBatch,
    gauss_newton_products,
    load_forward_mode,
    loss_at,
    model_batch,
    replayed_randomness,
)
from dkfac.adaptive.options import AdaptiveOptions
from dkfac.adaptive.quadratic_model import (
    levenberg_marquardt,
    minimise_quadratic_model,
    reduction_ratio,
)
from dkfac.adaptive.saved_state import check_saved_state
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
        loss: the batch loss before the step (mean over workers); with
            ``model_fraction < 1``, the loss of the part the quadratic model is built on.
        ratio: ``ρ`` when the damping was adapted at this step, else ``None``.
        damping: ``λ`` after the step.
        moved: ``False`` when the step was not taken: on a damping step the loss rose
            (``ρ < 0``, also a non-finite loss after), or the quadratic model was not finite;
            nothing moved (but an unchecked step before a non-finite model is taken back)
            and ``λ`` grew.
    """

    step: int
    learning_rate: float
    momentum: float
    predicted_change: float
    loss: float
    ratio: float | None
    damping: float
    moved: bool = True


def _wide(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 if it is 16-bit (its products then round to 2⁻²⁴, not 2⁻⁸)."""
    return tensor.float() if tensor.dtype in LOW_PRECISION else tensor


class AdaptiveStep:
    """Adaptive K-FAC's state (damping, previous update) and its step.

    Args:
        options: the validated options.
        damping: the initial ``λ``.
        model: the unwrapped model (names its parameters for ``torch.func``).
    """

    def __init__(self, options: AdaptiveOptions, damping: float, model: nn.Module) -> None:
        self.options = options
        self.damping = damping  # within the bounds (KFACConfig checks it)
        self._model = model
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._previous: dict[str, Tensor] = {}
        self.last: AdaptiveReport | None = None
        #: Steps not taken (the loss rose, or the quadratic model was not finite).
        self.rejected_steps = 0
        # Steps not taken in a row (the loss rose, or the model was not finite): while > 0,
        # every step is checked.
        self._refusals = 0
        # The moved parameters before the last update, by the model's parameter names, if it
        # was taken without a check (between damping adaptations); empty after a checked one.
        self._before: dict[str, Tensor] = {}
        self._passes = BatchedPasses()
        load_forward_mode()

    def _named(
        self, blocks: Sequence[KroneckerBlock], matrices: Sequence[Tensor]
    ) -> dict[str, Tensor]:
        named = {}
        for block, matrix in zip(blocks, matrices, strict=True):
            for parameter, part in zip(block.parameters(), block.split_matrix(matrix), strict=True):
                named[self._names[id(parameter)]] = part
        return named

    def model_batch(self, inputs: Any, targets: Any) -> ModelBatch:
        """The examples of a step's batch the quadratic model is built on (``model_fraction``).

        Called before anything of the step changes, so a batch it refuses (``ValueError``)
        leaves the preconditioner as it was.
        """
        options = self.options
        return model_batch(inputs, targets, options.model_fraction, options.min_model_targets)

    def step(
        self,
        step: int,
        names: Sequence[str],
        blocks: Sequence[KroneckerBlock],
        grads: Sequence[Tensor],
        directions: Sequence[Tensor],
        batch: ModelBatch,
        average: Average,
    ) -> None:
        """Move the layers' parameters by ``δ = α·(−direction) + μ·δ₀`` and clear their ``.grad``.

        Args:
            step: the K-FAC step (completed ``step()`` calls before this one).
            names: the layers' names (key the previous update).
            blocks: the layers' blocks (their parameters move).
            grads: the gradient matrices, the same on every worker.
            directions: the K-FAC directions, the same on every worker.
            batch: what the quadratic model is built on, from this step's batch on this
                worker (:meth:`model_batch`).
            average: the mean of a float64 vector over the workers.
        """
        options = self.options
        vectors = [[-direction for direction in directions]]
        if options.momentum:
            vectors.append(
                [
                    self._previous.get(name, torch.zeros_like(direction))
                    for name, direction in zip(names, directions, strict=True)
                ]
            )
        k = len(vectors)

        def dot(left: Sequence[Tensor], right: Sequence[Tensor]) -> Tensor:
            # Each product rounded once in the working dtype, every sum in float64: as exact
            # as products of float64 copies to 2⁻²⁴ per term, with one float64 buffer (the
            # reduction's) instead of two copies and their product (on the autoencoder's 1.4M
            # parameters the dots took 7 ms a step). A float32 product can overflow where a
            # float64 one would not: the model is then not finite and the step refused.
            pairs = zip(left, right, strict=True)
            return torch.stack([(_wide(u) * v).sum(dtype=torch.float64) for u, v in pairs]).sum()

        # V is symmetric: each pair once.
        upper = {(i, j): dot(vectors[i], vectors[j]) for i in range(k) for j in range(i, k)}
        inner = torch.stack(
            [torch.stack([upper[min(i, j), max(i, j)] for j in range(k)]) for i in range(k)]
        )
        parameters = {self._names[id(p)]: p for block in blocks for p in block.parameters()}
        device = directions[0].device  # collectives run on the model's device
        checked = step % options.damping_interval == 0 or self._refusals > 0
        named = [self._named(blocks, vector) for vector in vectors]
        with replayed_randomness(device) as replay:
            try:
                loss, curvature, slopes = self._passes(
                    lambda batched: gauss_newton_products(
                        self._model,
                        parameters,
                        named,
                        batch.inputs,
                        batch.targets,
                        options.loss_fn,
                        replay,
                        batched,
                    ),
                    k,
                )
            except (RuntimeError, NotImplementedError) as error:
                if isinstance(error, torch.OutOfMemoryError):
                    raise
                raise ValueError(
                    "adaptive K-FAC could not take forward-mode derivatives of the model "
                    f"(torch.func.jvp): {error}. Not supported: reentrant activation "
                    "checkpointing, SyncBatchNorm, autograd Functions without a forward-mode "
                    "rule"
                ) from error
            # On a part, its own slopes: a model whose gradient and curvature came from
            # different examples can have its minimum far out (a direction curved little in
            # the part but steep in the batch), and the unchecked steps would take it. On the
            # whole batch, the gradient backward computed (it differs from the slopes by
            # rounding, and by what backward saw that loss_fn does not: other dropout masks,
            # extra loss terms).
            linear = (
                slopes if batch.part else torch.stack([dot(grads, vector) for vector in vectors])
            )
            # Everything the solution depends on, averaged together and read back once: every
            # worker then solves the same system bit for bit.
            local = torch.cat(
                [curvature.reshape(-1), inner.reshape(-1), linear, loss.reshape(1)]
            ).to(device)
            agreed = average(local).cpu()
            curvature = agreed[: k * k].reshape(k, k)
            inner = agreed[k * k : 2 * k * k].reshape(k, k)
            linear = agreed[2 * k * k : 2 * k * k + k]
            loss_before = float(agreed[-1])
            if not bool(torch.isfinite(agreed).all()):
                # A non-finite gradient, direction or loss on some worker: no model to trust.
                # If the last update went unchecked, it may be what broke the loss: the
                # parameters before it are put back (exactly: a copy, not a subtraction that
                # a huge update would leave to rounding), else every later step would meet
                # the same parameters and be refused too. The next steps are checked.
                undone = bool(self._before)
                if undone:
                    self._undo()
                self.damping = levenberg_marquardt(
                    self.damping, -math.inf, options.omega, options.min_damping, options.max_damping
                )
                self._refusals += 1
                self._stay(step, names, blocks, directions, loss_before, -math.inf)
                # Nor does the optimizer move the other parameters (normalisation, skipped
                # layers) with gradients of a non-finite loss: it finds none, as after a
                # GradScaler's skipped step, and a parameter made NaN cannot be taken back.
                for parameter in self._model.parameters():
                    parameter.grad = None
                logger.warning(
                    "adaptive K-FAC step %d did not move%s: its quadratic model is not finite "
                    "(loss before %s); damping raised to %.3g",
                    step,
                    ", and took back the last step (taken without a check)" if undone else "",
                    loss_before,
                    self.damping,
                )
                return
            chosen = minimise_quadratic_model(curvature, inner, linear, self.damping)
            promised = options.trusted_decrease
            # A loss <= 0 gives no scale to compare a promise with: only the interval then.
            if promised is not None and loss_before > 0.0:
                # The model promises too much to go unchecked.
                checked = checked or not -chosen.predicted_change <= promised * loss_before
            updates = []
            for index, direction in enumerate(directions):
                update = torch.zeros_like(direction)
                for coefficient, vector in zip(chosen.coefficients, vectors, strict=True):
                    update.add_(vector[index].to(direction), alpha=coefficient)
                updates.append(update)
            ratio = None
            if checked:
                moved = {
                    name: parameters[name].detach() + part
                    for name, part in self._named(blocks, updates).items()
                }
                after = loss_at(
                    self._model, moved, batch.inputs, batch.targets, options.loss_fn, replay
                )
                loss_after = float(average(after.reshape(1).to(device))[0])
                ratio = reduction_ratio(loss_before, loss_after, chosen.predicted_change)
                self.damping = levenberg_marquardt(
                    self.damping, ratio, options.omega, options.min_damping, options.max_damping
                )
                if not ratio >= 0.0:
                    # A step that raised the loss is not taken; the next steps are checked
                    # too until one is, and each further refusal in a row doubles the
                    # damping's increase (Nielsen's rule for Levenberg-Marquardt): a model far
                    # off, as at a start with too little damping, is corrected in a few
                    # steps, not dozens.
                    self._refusals += 1
                    self.damping = min(
                        options.max_damping, self.damping * 2.0 ** (self._refusals - 1)
                    )
                    self._stay(step, names, blocks, directions, loss_before, ratio)
                    return
                self._refusals = 0
        self._before = {} if checked else self._snapshot(blocks)
        self._move(names, blocks, updates)
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

    def _move(
        self, names: Sequence[str], blocks: Sequence[KroneckerBlock], updates: Sequence[Tensor]
    ) -> None:
        """Add each update to its layer's parameters, clear their ``.grad``, remember it."""
        with torch.no_grad():
            for block, update in zip(blocks, updates, strict=True):
                for parameter, part in zip(
                    block.parameters(), block.split_matrix(update), strict=True
                ):
                    parameter.add_(part)
                    parameter.grad = None
        self._previous = dict(zip(names, updates, strict=True))

    def _snapshot(self, blocks: Sequence[KroneckerBlock]) -> dict[str, Tensor]:
        """A copy of the layers' parameters by name (into the last copy's buffers if they fit)."""
        kept = {}
        for block in blocks:
            for parameter in block.parameters():
                name, value = self._names[id(parameter)], parameter.detach()
                old = self._before.get(name)
                layout = (value.shape, value.dtype, value.device)
                if old is not None and (old.shape, old.dtype, old.device) == layout:
                    kept[name] = old.copy_(value)
                else:
                    kept[name] = value.clone()
        return kept

    def _undo(self) -> None:
        """Put back the parameters the last (unchecked) update started from: those it moved."""
        parameters = dict(self._model.named_parameters())
        with torch.no_grad():
            for name, kept in self._before.items():
                parameters[name].copy_(kept)

    def _stay(
        self,
        step: int,
        names: Sequence[str],
        blocks: Sequence[KroneckerBlock],
        directions: Sequence[Tensor],
        loss: float,
        ratio: float,
    ) -> None:
        """A step not taken: nothing moves (no momentum either), the ``.grad`` are cleared."""
        self._move(names, blocks, [torch.zeros_like(d) for d in directions])
        self._before = {}
        self.rejected_steps += 1
        self.last = AdaptiveReport(
            step=step,
            learning_rate=0.0,
            momentum=0.0,
            predicted_change=0.0,
            loss=loss,
            ratio=ratio,
            damping=self.damping,
            moved=False,
        )
        logger.debug("adaptive K-FAC step %d not taken (ratio %s)", step, ratio)

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What continues the run identically.

        The damping, the refusals, the previous update, and the parameters before it if it
        went unchecked.
        """
        return {
            "damping": self.damping,
            "refusals": self._refusals,
            "rejected_steps": self.rejected_steps,
            "before": {name: kept.clone() for name, kept in self._before.items()},
            "previous": {name: update.clone() for name, update in self._previous.items()},
        }

    def check_state(self, state: Any, blocks: Mapping[str, KroneckerBlock]) -> None:
        """Raise unless ``state`` is :meth:`state` output for the layers ``blocks``.

        Args:
            state: the saved adaptive state.
            blocks: each preconditioned layer's block, by name.

        Raises:
            ValueError: as :func:`~dkfac.adaptive.saved_state.check_saved_state`.
        """
        moved = {id(p) for block in blocks.values() for p in block.parameters()}
        parameters = {n: p for n, p in self._model.named_parameters() if id(p) in moved}
        check_saved_state(state, self.options, blocks, parameters)

    def load(self, state: Any, blocks: Mapping[str, KroneckerBlock]) -> None:
        """Restore :meth:`state` output (checked by :meth:`check_state`) onto the layers' device."""
        self.check_state(state, blocks)
        self.damping = float(state["damping"])
        self._refusals = int(state["refusals"])
        self.rejected_steps = int(state["rejected_steps"])
        parameters = dict(self._model.named_parameters())
        self._before = {
            name: kept.to(parameters[name].device, parameters[name].dtype, copy=True)
            for name, kept in state.get("before", {}).items()
        }
        self._previous = {
            name: update.to(blocks[name].weight.device, blocks[name].weight.dtype, copy=True)
            for name, update in state["previous"].items()
        }
