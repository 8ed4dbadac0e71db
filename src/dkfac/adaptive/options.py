"""Validated options of adaptive K-FAC: the quadratic model's step, Levenberg-Marquardt damping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dkfac.validation import check_float, check_int

#: ``loss_fn(outputs, targets)``: the training loss of the model's outputs, a scalar tensor.
LossFunction = Callable[[Any, Any], Tensor]


@dataclass(frozen=True)
class AdaptiveOptions:
    """Adaptive K-FAC (Martens and Grosse 2015, sections 6.4-7; kfac-jax's adaptive mode).

    Every step, the update is ``δ = α·Δ + μ·δ₀``: ``Δ`` is minus the K-FAC direction, ``δ₀``
    the previous update, and ``(α, μ)`` minimise the quadratic model
    ``M(δ) = ∇hᵀδ + ½·δᵀ(C + λI)δ`` on the current batch, where ``C`` is the exact
    Gauss-Newton matrix of ``loss_fn`` (two Jacobian-vector products through the model) and
    ``λ`` the damping. At step 0 and every ``damping_interval`` steps the loss is measured
    again after the update, and the ratio ``ρ`` of the actual to the predicted change drives
    ``λ`` by the Levenberg-Marquardt rule: ``ρ > 3/4`` multiplies it by
    ``ω = damping_decay ** interval``, ``ρ < 1/4`` divides it by ``ω``, within
    ``[min_damping, max_damping]``. A step that raised the loss (``ρ < 0``) is not taken, the
    next ones are checked until one is, and each refusal in a row doubles the increase. A
    step whose quadratic model is not finite is not taken either (every parameter's ``.grad``
    is cleared: the optimizer moves nothing); if the step before it went unchecked, the
    parameters it started from are put back (a copy kept while ``damping_interval > 1``). The
    same ``λ`` is the preconditioner's damping. docs/math.md derives it and states its cost.

    The defaults check every step and move ``λ`` fast (halve it while the model predicts
    well, down to 10⁻⁴): measured on three workloads (docs/benchmarks.md, "Adaptive K-FAC's
    defaults"), they reach each target in fewer seconds than Martens and Grosse's rule
    (``damping_interval=5, damping_decay=0.95``), which lowers ``λ`` by at most 5% a step.
    The floor guards what the quadratic model cannot see: it is built on one batch, and
    with ``λ`` near zero it lets a step go far along directions that batch barely curves,
    fitting it at the other examples' cost (a floor of 10⁻⁹ wrecked a small-batch language
    model's validation loss; at 10⁻⁵ a CNN at 32 images a worker, its model on all of them,
    lost 6 and 11 points of test accuracy late in 2 runs of 15; docs/benchmarks.md, "Small
    batches").

    Args:
        loss_fn: ``loss_fn(model(*inputs), targets)``, the loss the model is trained on, averaged
            over the batch (adaptive K-FAC requires ``loss_reduction="mean"``). Its Hessian in the
            outputs must be positive semi-definite (cross-entropy, squared error), so that the
            Gauss-Newton matrix is. Its randomness (and the model's: dropout) is replayed:
            every extra forward pass draws what the first one drew.
        damping_interval: steps ``T`` between damping adaptations (each costs one extra forward
            pass).
        damping_decay: per-step factor of the Levenberg-Marquardt rule, in (0, 1).
        min_damping: lower bound of ``λ`` (> 0).
        max_damping: upper bound of ``λ``.
        momentum: include the previous update (``μ``); ``False`` chooses ``α`` alone.
        trusted_decrease: between damping adaptations, a step whose quadratic model
            predicts a decrease of more than this share of the loss before it
            (``−M(δ) > trusted_decrease·h(θ)``) is checked as well, and refused if the loss
            rose; ``None``: never. A model that promises much is the likeliest to be wrong:
            with the damping near its floor, an unchecked step fitted to a few examples
            (a large multiple of the previous update) can blow the loss up; the steps
            that promise a quarter of the loss are a few percent of a run's.
        model_fraction: the share ``f`` of the batch the quadratic model is built on, in
            (0, 1]: its first ``⌈f·N⌉`` examples along dim 0 of every tensor input and of the
            targets give ``C``, the slopes ``∇hᵀv`` and the losses of the damping's checks,
            as if the batch were that part; the K-FAC direction stays the whole batch's.
            Cuts the two Jacobian-vector products, most of adaptive K-FAC's price, by ``f``.
        min_model_targets: the fewest target elements the model's part keeps:
            ``model_fraction`` is raised for a batch whose share would hold fewer, up to the
            whole batch. Target elements count the loss's terms when the targets hold one
            value per term (a class index per image, a token id per position, a pixel per
            reconstructed pixel); one-hot or soft labels count each class, so give such a
            loss a minimum in those units. A model of a few examples lets through steps
            that fit them and undo the run's progress (measured: a CNN's model on 4 of 32
            images a worker; docs/benchmarks.md, "Small batches").
    """

    loss_fn: LossFunction
    damping_interval: int = 1
    damping_decay: float = 0.5
    min_damping: float = 1e-4
    max_damping: float = 1e3
    momentum: bool = True
    model_fraction: float = 1.0
    trusted_decrease: float | None = 0.25
    min_model_targets: int = 32

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise ValueError(
                f"loss_fn={self.loss_fn!r} is not allowed: expected a callable "
                "loss_fn(outputs, targets) returning the scalar training loss"
            )
        check_int("damping_interval", self.damping_interval)
        check_float(
            "damping_decay",
            self.damping_decay,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            allowed="a number in (0, 1)",
        )
        check_float(
            "min_damping",
            self.min_damping,
            low=0.0,
            low_open=True,
            allowed="a finite number > 0",
        )
        check_float(
            "max_damping",
            self.max_damping,
            low=self.min_damping,
            allowed=f"a finite number >= min_damping={self.min_damping!r}",
        )
        check_float(
            "model_fraction",
            self.model_fraction,
            low=0.0,
            high=1.0,
            low_open=True,
            allowed="a number in (0, 1]",
        )
        check_int("min_model_targets", self.min_model_targets)
        if self.trusted_decrease is not None:
            check_float(
                "trusted_decrease",
                self.trusted_decrease,
                low=0.0,
                low_open=True,
                allowed="a finite number > 0, or None (never check between adaptations)",
            )
        if not isinstance(self.momentum, bool):
            raise ValueError(f"momentum={self.momentum!r} is not allowed: expected True or False")

    @property
    def omega(self) -> float:
        """The Levenberg-Marquardt factor per adaptation: ``damping_decay ** damping_interval``."""
        return float(self.damping_decay**self.damping_interval)
