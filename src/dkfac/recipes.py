"""Named configurations of :class:`dkfac.KFACPreconditioner`, each with what it was measured on.

A recipe is a function of what only the user knows (the loss) that returns the
preconditioner's keyword arguments, a new dict on every call: pass it on with ``**`` and
change any entry first. ``KFACPreconditioner``'s own defaults stay those of the plain method
(eigendecompositions at every step, all of each batch, float32 products, damping 0.003), the
ones its float64 oracle tests describe; a recipe is what a measurement chose on top of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from dkfac.adaptive import AdaptiveOptions, LossFunction

__all__ = ["FAST_TO_TARGET_SHARE", "RECIPES", "Recipe", "fast_to_target"]

#: A recipe: the loss in, the preconditioner's keyword arguments out.
Recipe = Callable[[LossFunction], dict[str, Any]]

#: The share of each batch the factors and adaptive K-FAC's quadratic model come from in
#: :func:`fast_to_target`.
FAST_TO_TARGET_SHARE = 0.125


def fast_to_target(loss_fn: LossFunction) -> dict[str, Any]:
    """Adaptive K-FAC as measured fastest to a target, one configuration for every workload.

    Measured against SGD and AdamW with their learning rates tuned by a grid, 5 seeds, one
    and two workers (docs/benchmarks.md, "Time to target"): the digits CNN and Martens and
    Grosse's deep autoencoder at full batch reach their targets in half of AdamW's time or less; a
    small character-level Transformer at 32 sequences reaches its target in fewer steps than
    AdamW, but not sooner (each step costs about twice AdamW's).

    What it sets, and why:

    * ``adaptive``: the step's length and momentum from the quadratic model on the first
      eighth of the batch (at least ``min_model_targets`` target elements, 32: a small
      batch's model is all of it), the damping by the Levenberg-Marquardt rule (its
      defaults: a check every step, halved while the model predicts well, down to 10⁻⁴);
      the learning rate and KL clip then play no part for the K-FAC layers.
    * ``damping=0.03``: the initial damping (the rule moves it within a few steps).
    * ``inverse_method="inverse"``: Cholesky inverses, cheaper than eigendecompositions.
    * ``statistics_fraction``: the factors from the first eighth of each batch.
    * ``precondition_precision="bf16"``: the preconditioning products in bfloat16.
    * both update intervals ``"auto"``: chosen from the run's own costs during its first steps
      (:class:`dkfac.IntervalBudget`), so that factors and decompositions take about a tenth
      of a step.

    Not set: ``strategy`` (on several workers choose one that communicates; the measurement
    used ``"dp"``) and the optimizer, which still moves the parameters K-FAC does not
    precondition (the measurement: SGD at 0.2 with momentum 0.9). ``dkfac compare`` runs it
    by default, at 32 images per worker (docs/benchmarks.md, "Small batches").

    Args:
        loss_fn: ``loss_fn(model(*inputs), targets)``, the loss the model is trained on,
            averaged over the batch (:class:`dkfac.AdaptiveOptions`).

    Returns:
        :class:`dkfac.KFACPreconditioner`'s keyword arguments.

    Example::

        pre = dkfac.KFACPreconditioner(model, **dkfac.fast_to_target(F.cross_entropy))
        loss.backward(); pre.step(inputs, targets); optimizer.step()
    """
    return {
        "adaptive": AdaptiveOptions(loss_fn=loss_fn, model_fraction=FAST_TO_TARGET_SHARE),
        "damping": 0.03,
        "inverse_method": "inverse",
        "statistics_fraction": FAST_TO_TARGET_SHARE,
        "precondition_precision": "bf16",
        "factor_update_steps": "auto",
        "inv_update_steps": "auto",
    }


#: Every recipe by name (the benchmarks' ``"recipe"`` key).
RECIPES: Mapping[str, Recipe] = MappingProxyType({"fast_to_target": fast_to_target})
