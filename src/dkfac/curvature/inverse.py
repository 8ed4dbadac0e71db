"""Decompositions of a layer's Kronecker factors and their use as a preconditioner.

Two methods, one interface (:class:`KroneckerInverse`):

* :class:`EigenInverse` stores ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` and applies
  exactly ``(A ⊗ G + γ I)⁻¹ vec(∇)`` as
  ``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``. The damping is applied at preconditioning
  time, so a changing damping schedule takes effect at once.
* :class:`TikhonovInverse` stores ``(A + √γ·π I)⁻¹`` and ``(G + √γ/π I)⁻¹`` (factored
  Tikhonov damping, Martens & Grosse 2015 §6.3) computed through Cholesky, with
  ``π = sqrt((tr A / d_A) / (tr G / d_G))``; it applies ``G_d⁻¹ ∇ A_d⁻¹``.

Both methods decompose each factor on its own (:class:`EigenFactor`, :class:`CholeskyFactor`,
each owning the names, shapes and symmetry of its tensors, i.e. what travels), which lets
distributed strategies place the two factors of one layer on different workers; only the
Tikhonov shift couples them, through ``π``, which the caller computes from both traces
(:func:`tikhonov_shifts`). Decompositions report success as a device boolean so the caller can
check many layers with a single host synchronisation.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import Tensor

#: The two Kronecker factors of a layer: ``"a"`` (input side) and ``"g"`` (output gradient side).
FACTOR_SIDES: tuple[str, str] = ("a", "g")

#: One tensor of a factor's decomposition: its name, shape and whether it is a symmetric matrix
#: (then only its upper triangle travels).
TensorSpec = tuple[str, tuple[int, ...], bool]


class FactorDecomposition(ABC):
    """The decomposition of one Kronecker factor; each method owns its tensors' layout.

    Args:
        side: ``"a"`` or ``"g"``.
        tensors: named as :meth:`layout` says.
        ok: device boolean: finite, and the factorisation succeeded.
    """

    #: The ``inverse_method`` this class implements.
    method: ClassVar[str]

    def __init__(self, side: str, tensors: dict[str, Tensor], ok: Tensor) -> None:
        self.side = side
        self.tensors = tensors
        self.ok = ok

    @staticmethod
    @abstractmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """``(name, shape, symmetric)`` of the tensors of a ``d × d`` factor, in wire order.

        The first is a ``d × d`` matrix; the others are ``d``-vectors. The names are the
        keys of ``state_dict`` and of the layer's :meth:`KroneckerInverse.tensors`.
        """


class EigenFactor(FactorDecomposition):
    """``F = Q Λ Qᵀ``: eigenvectors ``q<side>`` (``d × d``) and eigenvalues ``l<side>``."""

    method = "eigen"

    @staticmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """Eigenvectors (not symmetric), then eigenvalues."""
        return [(f"q{side}", (dim, dim), False), (f"l{side}", (dim,), False)]

    @classmethod
    def compute(cls, matrix: Tensor, side: str, dtype: torch.dtype) -> EigenFactor:
        """Eigendecomposition in ``dtype``; round-off negative eigenvalues clamped to zero.

        The clamp keeps ``λ_G λ_A + γ >= γ > 0``; eigenvectors are stored row-major like any
        received copy, so every worker's GEMMs take the same path and round identically.

        Raises:
            torch.linalg.LinAlgError: the eigensolver did not converge.
        """
        eigenvalues, eigenvectors = torch.linalg.eigh(matrix.to(dtype))
        return cls._from_solution(side, eigenvalues, eigenvectors)

    @classmethod
    def compute_many(
        cls, matrices: Sequence[Tensor], sides: Sequence[str], dtype: torch.dtype
    ) -> list[EigenFactor]:
        """:meth:`compute` of equal-size factors in one batched ``eigh`` call.

        On a GPU one call waits for the device once (``eigh`` reads its error flags on the
        host) instead of once per factor, and factors of up to 32 rows take the batched
        Jacobi solver. Each result is an eigendecomposition of its factor in ``dtype``, equal
        to :meth:`compute`'s to round-off (a batched solver may order its arithmetic
        differently, and on the CPU a matrix's result depends on where it sits in the batch).

        Raises:
            torch.linalg.LinAlgError: the eigensolver did not converge for some factor.
        """
        eigenvalues, eigenvectors = torch.linalg.eigh(torch.stack([m.to(dtype) for m in matrices]))
        return [
            cls._from_solution(side, values, vectors)
            for side, values, vectors in zip(sides, eigenvalues, eigenvectors, strict=True)
        ]

    @classmethod
    def _from_solution(cls, side: str, eigenvalues: Tensor, eigenvectors: Tensor) -> EigenFactor:
        (q_name, _, _), (l_name, _, _) = cls.layout(side, eigenvalues.shape[0])
        ok = torch.isfinite(eigenvectors).all() & torch.isfinite(eigenvalues).all()
        tensors = {q_name: eigenvectors.contiguous(), l_name: eigenvalues.clamp_min(0.0)}
        return cls(side, tensors, ok)


class CholeskyFactor(FactorDecomposition):
    """``(F + shift·I)⁻¹`` through Cholesky: one symmetric matrix ``<side>_inv``."""

    method = "inverse"

    @staticmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """The damped inverse (symmetric)."""
        return [(f"{side}_inv", (dim, dim), True)]

    @classmethod
    def compute(
        cls, matrix: Tensor, side: str, dtype: torch.dtype, shift: Tensor
    ) -> CholeskyFactor:
        """``(F + shift·I)⁻¹`` in ``dtype`` (``shift`` from :func:`tikhonov_shifts`)."""
        damped = matrix.to(dtype) + torch.diag_embed(shift.to(dtype).expand(matrix.shape[0]))
        factor, info = torch.linalg.cholesky_ex(damped)
        inverse = torch.cholesky_inverse(factor)
        ((name, _, _),) = cls.layout(side, matrix.shape[0])
        ok = torch.isfinite(inverse).all() & (info == 0)
        return cls(side, {name: inverse.contiguous()}, ok)


#: The factor decomposition of each ``inverse_method``.
FACTOR_DECOMPOSITIONS: Mapping[str, type[FactorDecomposition]] = MappingProxyType(
    {"eigen": EigenFactor, "inverse": CholeskyFactor}
)


def factor_tensor_shapes(method: str, side: str, dim: int) -> list[TensorSpec]:
    """``(name, shape, symmetric)`` of the tensors of one factor's decomposition, in order.

    Args:
        method: ``"eigen"`` or ``"inverse"``.
        side: ``"a"`` or ``"g"``.
        dim: the factor's side length ``d``.
    """
    return FACTOR_DECOMPOSITIONS[method].layout(side, dim)


def factor_decomposition(
    method: str, side: str, tensors: dict[str, Tensor], ok: Tensor
) -> FactorDecomposition:
    """A received (or loaded) decomposition of factor ``side`` as its method's class."""
    return FACTOR_DECOMPOSITIONS[method](side, tensors, ok)


def decompose_factor(
    matrix: Tensor, side: str, method: str, dtype: torch.dtype, shift: Tensor | None = None
) -> FactorDecomposition:
    """Decompose one factor in ``dtype``: :class:`EigenFactor` or :class:`CholeskyFactor`.

    Raises:
        ValueError: ``"inverse"`` without the Tikhonov ``shift``.
        torch.linalg.LinAlgError: the eigensolver did not converge.
    """
    if method == "eigen":
        return EigenFactor.compute(matrix, side, dtype)
    if shift is None:
        raise ValueError("decompose_factor(method='inverse') needs the Tikhonov shift")
    return CholeskyFactor.compute(matrix, side, dtype, shift)


def tikhonov_shift(side: str, mean_a: Tensor, mean_g: Tensor, damping: float) -> Tensor:
    """The shift of factor ``side`` from :func:`tikhonov_shifts`."""
    return tikhonov_shifts(mean_a, mean_g, damping)[FACTOR_SIDES.index(side)]


def tikhonov_shifts(mean_a: Tensor, mean_g: Tensor, damping: float) -> tuple[Tensor, Tensor]:
    """Shifts ``√γ·π`` (for A) and ``√γ/π`` (for G), ``π = sqrt(mean_a / mean_g)``.

    ``mean_a``, ``mean_g`` are ``tr(F)/d`` of the factors (see :func:`trace_mean`); ``π = 1``
    when either is not positive.
    """
    valid = (mean_a > 0) & (mean_g > 0)
    pi = torch.sqrt(torch.where(valid, mean_a / torch.where(valid, mean_g, 1.0), 1.0))
    root = math.sqrt(damping)
    return root * pi, root / pi


def trace_mean(matrix: Tensor, dtype: torch.dtype) -> Tensor:
    """``tr(F) / d`` of a factor in ``dtype`` (the input of ``π``)."""
    return torch.diagonal(matrix.to(dtype)).sum() / matrix.shape[0]


def combine_factors(
    method: str, a: FactorDecomposition, g: FactorDecomposition
) -> KroneckerInverse:
    """The layer's inverse from its two factor decompositions, in their widest dtype.

    One factor retried in float64 (its decomposition failed in the working dtype) makes the
    layer's inverse float64: both sides' products then run in one dtype.
    """
    tensors = {**a.tensors, **g.tensors}
    wide = functools.reduce(torch.promote_types, (t.dtype for t in tensors.values()))
    return inverse_from_tensors(method, {name: t.to(wide) for name, t in tensors.items()})


class KroneckerInverse(ABC):
    """The inverse of one layer's damped Kronecker curvature, ready to precondition."""

    method: ClassVar[str]

    @abstractmethod
    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``(A ⊗ G + damping)⁻¹``-like product with the ``(d_G, d_A)`` gradient matrix."""

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The tensors that define this inverse (for state_dict)."""


class EigenInverse(KroneckerInverse):
    """Eigendecompositions of both factors; exact damped Kronecker inverse."""

    method = "eigen"

    def __init__(self, qa: Tensor, la: Tensor, qg: Tensor, lg: Tensor) -> None:
        self.qa, self.la, self.qg, self.lg = qa, la, qg, lg

    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``."""
        g = grad.to(self.qa.dtype)
        rotated = self.qg.t() @ g @ self.qa
        rotated = rotated / (torch.outer(self.lg, self.la) + damping)
        return (self.qg @ rotated @ self.qa.t()).to(grad.dtype)

    def tensors(self) -> dict[str, Tensor]:
        """Eigenvectors and eigenvalues of both factors."""
        return {"qa": self.qa, "la": self.la, "qg": self.qg, "lg": self.lg}


class TikhonovInverse(KroneckerInverse):
    """Inverses of the π-damped factors, through Cholesky."""

    method = "inverse"

    def __init__(self, a_inv: Tensor, g_inv: Tensor) -> None:
        self.a_inv, self.g_inv = a_inv, g_inv

    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``(G + √γ/π I)⁻¹ ∇ (A + √γ·π I)⁻¹`` (damping fixed at decomposition time)."""
        g = grad.to(self.a_inv.dtype)
        return (self.g_inv @ g @ self.a_inv).to(grad.dtype)

    def tensors(self) -> dict[str, Tensor]:
        """The two damped inverses."""
        return {"a_inv": self.a_inv, "g_inv": self.g_inv}


def decompose(
    a: Tensor, g: Tensor, damping: float, method: str, dtype: torch.dtype
) -> tuple[KroneckerInverse, Tensor]:
    """Decompose a factor pair with ``method`` in ``dtype``; also the device success flag.

    Raises:
        torch.linalg.LinAlgError: the decomposition algorithm itself failed.
    """
    shift_a = shift_g = None
    if method == "inverse":
        shift_a, shift_g = tikhonov_shifts(trace_mean(a, dtype), trace_mean(g, dtype), damping)
    a_part = decompose_factor(a, "a", method, dtype, shift_a)
    g_part = decompose_factor(g, "g", method, dtype, shift_g)
    return combine_factors(method, a_part, g_part), a_part.ok & g_part.ok


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(tensors: Mapping[str, Tensor]) -> Tensor:
    """An int64 device checksum of the exact bits of ``tensors`` (in key order).

    Each value's bit pattern, read as an integer, is weighted by its position and summed in
    int64 (wrapping): integer sums do not depend on the order of summation, so equal bits give
    equal checksums on any hardware, and a changed, swapped or rounded-differently value
    changes it (but for a chance of 2⁻⁶⁴).
    """
    total: Tensor | None = None
    offset = 0
    for name in sorted(tensors):
        flat = tensors[name].detach().contiguous().reshape(-1)
        bits = flat.view(_SAME_SIZE_INT[flat.element_size()]).to(torch.int64)
        weights = torch.arange(offset + 1, offset + 1 + bits.numel(), device=bits.device)
        part = (bits * weights).sum()
        total = part if total is None else total + part
        offset += bits.numel()
    assert total is not None, "bit_checksum of nothing"
    return total


def inverse_from_tensors(method: str, tensors: dict[str, Tensor]) -> KroneckerInverse:
    """Rebuild an inverse from :meth:`KroneckerInverse.tensors` (for load_state_dict)."""
    if method == "eigen":
        return EigenInverse(tensors["qa"], tensors["la"], tensors["qg"], tensors["lg"])
    return TikhonovInverse(tensors["a_inv"], tensors["g_inv"])
