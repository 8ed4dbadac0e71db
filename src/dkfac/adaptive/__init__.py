"""Adaptive K-FAC: the quadratic model's learning rate and momentum, Levenberg-Marquardt damping."""

from dkfac.adaptive.controller import AdaptiveReport, AdaptiveStep
from dkfac.adaptive.gauss_newton import ModelBatch
from dkfac.adaptive.options import AdaptiveOptions, LossFunction
from dkfac.adaptive.quadratic_model import (
    QuadraticStep,
    levenberg_marquardt,
    minimise_quadratic_model,
    reduction_ratio,
)

__all__ = [
    "AdaptiveOptions",
    "AdaptiveReport",
    "AdaptiveStep",
    "LossFunction",
    "ModelBatch",
    "QuadraticStep",
    "levenberg_marquardt",
    "minimise_quadratic_model",
    "reduction_ratio",
]
