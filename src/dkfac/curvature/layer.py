"""The K-FAC state of one layer on one worker.

:class:`LayerCurvature` accumulates factor statistics over the micro-batches of a step,
normalises them into batch factors, keeps the running averages and the latest decomposition,
and preconditions the layer's gradient. It knows nothing about other workers: distributed
strategies decide which of these methods run where and move the results.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dkfac.curvature.blocks import FactorStatistic, KroneckerBlock
from dkfac.curvature.factor_decomposition import factor_tensor_shapes
from dkfac.curvature.factor_side import FACTOR_SIDES, factor_shape
from dkfac.curvature.inverse import (
    KroneckerInverse,
    check_precondition_precision,
    inverse_from_tensors,
)
from dkfac.curvature.kronecker_factor import DroppedFlag, KroneckerFactor
from dkfac.curvature.statistics import FactorStatistics

logger = logging.getLogger(__name__)


#: The kinds of numerical trouble counted per layer (:class:`LayerHealth`).
TROUBLE_KINDS = (
    "nonfinite_batches",
    "nonfinite_factors",
    "retried_in_float64",
    "failed_decompositions",
)


@dataclass(frozen=True)
class LayerHealth:
    """Numerical trouble of one layer on one worker since it was built.

    Attributes:
        nonfinite_batches: batch factors with NaN/Inf that were not folded in (counted when
            the layer's factors are next decomposed on this worker).
        nonfinite_factors: decompositions skipped because a running factor was not finite.
        retried_in_float64: decompositions that failed in ``inv_dtype`` and succeeded in
            float64.
        failed_decompositions: decompositions that failed in float64 too (the last good one
            was kept).
    """

    nonfinite_batches: int = 0
    nonfinite_factors: int = 0
    retried_in_float64: int = 0
    failed_decompositions: int = 0


@dataclass
class LayerCurvature:
    """Factors, running averages and decomposition of one preconditioned layer.

    Attributes:
        name: qualified module name (without a DDP ``module.`` prefix).
        block: the layer-type specific statistics.
        factor_dtype: dtype of the statistics and running averages.
        inverse: the latest good decomposition, ``None`` before the first one.
        precondition_precision: ``"highest"`` or ``"bf16"``, how the gradient is
            preconditioned (:meth:`KroneckerInverse.precondition`).
        factors: the two :class:`~dkfac.curvature.kronecker_factor.KroneckerFactor` by side,
            ``"a"`` (``d_A``) and ``"g"`` (``d_G``).
    """

    name: str
    block: KroneckerBlock
    factor_dtype: torch.dtype = torch.float32
    inverse: KroneckerInverse | None = None
    precondition_precision: str = "highest"
    factors: dict[str, KroneckerFactor] = field(init=False, repr=False)
    _trouble: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(TROUBLE_KINDS, 0), repr=False
    )

    def __post_init__(self) -> None:
        check_precondition_precision(self.precondition_precision)
        dims = (self.block.a_dim, self.block.g_dim)
        self.factors = {
            side: KroneckerFactor(side, dim, self.factor_dtype)
            for side, dim in zip(FACTOR_SIDES, dims, strict=True)
        }

    @property
    def a(self) -> Tensor | None:
        """Running average of ``A`` (``None`` before the first update; NaN: no finite one yet)."""
        return self.factors["a"].running

    @a.setter
    def a(self, value: Tensor | None) -> None:
        self.factors["a"].running = value

    @property
    def g(self) -> Tensor | None:
        """Running average of ``G`` (as :attr:`a`)."""
        return self.factors["g"].running

    @g.setter
    def g(self, value: Tensor | None) -> None:
        self.factors["g"].running = value

    # -- statistics ---------------------------------------------------------------------
    def accumulate_a(self, x: Tensor, pass_id: int) -> None:
        """Add the input statistics of one forward call made in forward pass ``pass_id``."""
        self.add_statistic("a", self.a_statistic(x), pass_id)

    def accumulate_g(self, dy: Tensor, pass_id: int, grad_scale: float | None = None) -> None:
        """Add the output-gradient statistics of one backward call.

        Args:
            dy: gradient of the loss w.r.t. the layer output.
            pass_id: the forward pass that made the output: its examples count once however
                many times the layer ran in it.
            grad_scale: the loss scale of a ``GradScaler`` (``dy`` is divided by it).
        """
        self.add_statistic("g", self.g_statistic(dy), pass_id, grad_scale)

    def a_statistic(self, x: Tensor) -> FactorStatistic:
        """The input statistic of one forward call, its sum in ``factor_dtype``.

        Computed in ``factor_dtype`` even inside ``torch.autocast`` (which would run the Gram
        products in bfloat16/float16); ``statistics_precision="bf16"`` rounds the operands on
        purpose and still sums in float32.
        """
        with torch.autocast(self.block.weight.device.type, enabled=False):
            return self._in_factor_dtype(self.block.a_statistic(x.detach(), self.factor_dtype))

    def a_statistics(self, xs: Sequence[Tensor]) -> list[FactorStatistic]:
        """:meth:`a_statistic` of inputs of equal ``block.a_batch_key``, formed together.

        Any layer whose block gives the same key and whose ``factor_dtype`` is the same gives
        the same statistics: one layer computes those of a group of layers.
        """
        with torch.autocast(self.block.weight.device.type, enabled=False):
            totals = self.block.a_statistics([x.detach() for x in xs], self.factor_dtype)
        return [self._in_factor_dtype(statistic) for statistic in totals]

    def g_statistic(self, dy: Tensor) -> FactorStatistic:
        """The output-gradient statistic of one backward call (as :meth:`a_statistic`)."""
        with torch.autocast(self.block.weight.device.type, enabled=False):
            return self._in_factor_dtype(self.block.g_statistic(dy.detach(), self.factor_dtype))

    def g_statistics(self, dys: Sequence[Tensor]) -> list[FactorStatistic]:
        """:meth:`g_statistic` of output gradients of equal ``block.g_batch_key``, together."""
        with torch.autocast(self.block.weight.device.type, enabled=False):
            totals = self.block.g_statistics([dy.detach() for dy in dys], self.factor_dtype)
        return [self._in_factor_dtype(statistic) for statistic in totals]

    def add_statistic(
        self,
        side: str,
        statistic: FactorStatistic,
        pass_id: int,
        grad_scale: float | None = None,
        weight: float = 1.0,
    ) -> None:
        """Add one call's statistic of factor ``side``, made in forward pass ``pass_id``.

        ``grad_scale``: a ``GradScaler``'s loss scale that ``G``'s output gradients carried;
        ``weight``: a multiplier of the statistic's sum (part of a call standing for all of
        it: :func:`~dkfac.curvature.statistics.whole_call_estimate`).
        """
        scale = 1.0 if grad_scale is None or side == "a" else 1.0 / (grad_scale * grad_scale)
        self.factors[side].statistics.add(statistic, pass_id, scale * weight)

    def _in_factor_dtype(self, statistic: FactorStatistic) -> FactorStatistic:
        """``statistic`` with its sum in ``factor_dtype`` (a user's block may return another)."""
        if statistic.total.dtype == self.factor_dtype:
            return statistic
        return statistic._replace(total=statistic.total.to(self.factor_dtype))

    def statistics(self, side: str) -> FactorStatistics:
        """The window's statistics of factor ``side`` (``"a"`` or ``"g"``)."""
        return self.factors[side].statistics

    @property
    def has_statistics(self) -> bool:
        """Whether both factors have statistics since the last update."""
        return all(factor.statistics.has_statistics for factor in self.factors.values())

    @property
    def backward_passes(self) -> int:
        """Forward passes of the window whose output gradient reached this layer."""
        return self.factors["g"].statistics.passes

    def statistic_updates(self, side: str) -> int:
        """Statistics of factor ``side`` this window, one per call, lost ones too (its shape)."""
        stats = self.factors[side].statistics
        return stats.updates + stats.lost

    def summed_factor(self, side: str, loss_reduction: str) -> tuple[Tensor, int]:
        """``(R·A, R)`` or ``(N·G, N)`` of the window: sums that add up across workers.

        Summing these over workers and dividing gives the factors of the union of their
        batches exactly, whatever each worker's batch size (each worker's loss being the mean
        over its own examples, as under DDP).
        """
        summed = self.factors[side].statistics.summed(loss_reduction)
        return summed.total, summed.count

    def zeros(self, side: str) -> Tensor:
        """A zero factor ``side`` (what a worker without statistics contributes)."""
        return self.factors[side].zeros(self.block.weight.device)

    def clear_statistics(self) -> None:
        """Forget the statistics of the current window."""
        for factor in self.factors.values():
            factor.statistics.clear()

    def forget(self) -> None:
        """Drop the statistics, running factors and decomposition (as if never updated)."""
        self.clear_statistics()
        for factor in self.factors.values():
            factor.running = None
        self.inverse = None

    def fold_factor(self, side: str, batch: Tensor, decay: float) -> None:
        """Fold one batch factor into its running average; a non-finite batch is dropped."""
        self.factors[side].fold(batch, decay)

    def factor(self, side: str) -> Tensor | None:
        """The running factor ``A`` (``side="a"``) or ``G`` (``"g"``)."""
        return self.factors[side].running

    def set_factor(self, side: str, value: Tensor | None) -> None:
        """Replace the running factor of ``side``."""
        self.factors[side].running = value

    def trace_means(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``tr(A)/d_A`` and ``tr(G)/d_G`` in ``dtype`` (the inputs of the Tikhonov ``π``)."""
        return self.factors["a"].trace_mean(dtype), self.factors["g"].trace_mean(dtype)

    # -- preconditioning ----------------------------------------------------------------
    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """The preconditioned gradient matrix, or ``grad`` itself before any decomposition."""
        if self.inverse is None:
            return grad
        return self.inverse.precondition(grad, damping, self.precondition_precision)

    # -- state --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Running factors and the decomposition, as plain tensors."""
        entry: dict[str, Any] = {side.upper(): f.running for side, f in self.factors.items()}
        if self.inverse is not None:
            entry["inverse"] = {
                "method": self.inverse.method,
                "tensors": dict(self.inverse.tensors()),
            }
        return entry

    def check_state(self, entry: dict[str, Any], inverse_method: str) -> None:
        """Raise ``ValueError`` if ``entry`` (from :meth:`state`) does not fit this layer.

        Its factors must have the layer's dims, and its decomposition (if any) must be one of
        ``inverse_method`` with exactly that method's tensors and shapes.
        """
        for side, factor in self.factors.items():
            key, shape = side.upper(), factor_shape(factor.dim)
            tensor = entry[key]
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"state_dict factor {key} of layer {self.name!r} has shape "
                    f"{tuple(tensor.shape)}, expected {shape}"
                )
        saved = entry.get("inverse")
        if saved is None:
            return
        if saved.get("method") != inverse_method:
            raise ValueError(
                f"state_dict decomposition of layer {self.name!r} is of inverse_method="
                f"{saved.get('method')!r}, this preconditioner's is {inverse_method!r}"
            )
        want = {
            name: shape
            for side, factor in self.factors.items()
            for name, shape, _ in factor_tensor_shapes(inverse_method, side, factor.dim)
        }
        got = {name: tuple(tensor.shape) for name, tensor in saved["tensors"].items()}
        if got != want:
            raise ValueError(
                f"state_dict decomposition of layer {self.name!r} has tensors {got}, "
                f"expected {want}"
            )

    def load_state(self, entry: dict[str, Any]) -> None:
        """Restore :meth:`state` output onto the layer's device; pending statistics are dropped."""
        device = self.block.weight.device

        def own(tensor: Tensor) -> Tensor:
            return tensor.detach().to(device).clone()

        for side, factor in self.factors.items():
            saved_factor = entry[side.upper()]
            factor.running = None if saved_factor is None else own(saved_factor)
        saved = entry.get("inverse")
        self.inverse = (
            None
            if saved is None
            else inverse_from_tensors(
                saved["method"], {key: own(value) for key, value in saved["tensors"].items()}
            )
        )
        self.clear_statistics()

    def report(self, kind: str, message: str, times: int = 1) -> None:
        """Count ``times`` occurrences of trouble ``kind``; warn while it keeps happening.

        A RuntimeWarning (and a log record) is emitted each time the count reaches a power of
        two (1, 2, 4, 8, ...): persistent failures stay visible without flooding the log.
        """
        previous = self._trouble[kind]
        count = previous + times
        self._trouble[kind] = count
        if count.bit_length() > previous.bit_length():
            text = message if count == 1 else f"{message} ({count} times so far)"
            logger.warning(text)
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def health(self) -> LayerHealth:
        """How often each kind of numerical trouble happened to this layer on this worker."""
        return LayerHealth(**self._trouble)

    def take_nonfinite_flags(self, side: str) -> list[DroppedFlag]:
        """Factor ``side``'s dropped-batch flags since the last call (their sum is the count)."""
        return self.factors[side].take_nonfinite_flags()
