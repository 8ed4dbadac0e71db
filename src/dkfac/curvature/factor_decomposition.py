"""Each Kronecker factor's own decomposition, the tensors it consists of and their layout.

:class:`EigenFactor` (``F = Q Λ Qᵀ``), :class:`CholeskyFactor` (``(F + shift·I)⁻¹``) and
:class:`CholeskyRootFactor` (``F + shift·I = L Lᵀ``, no inverse formed) for a dense factor;
:class:`DiagonalEigenFactor` and :class:`DiagonalInverseFactor` for one held as its diagonal
(:mod:`dkfac.curvature.factor_side`), where both are elementwise. Each class owns the names,
shapes and symmetry of its tensors, i.e. what travels between workers and what ``state_dict``
holds; :mod:`dkfac.curvature.inverse` combines a layer's two into its inverse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import Tensor

from dkfac.curvature.factor_side import is_diagonal
from dkfac.curvature.finite import all_finite, finite_flags

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

    #: The ``inverse_method`` this class is named for (a diagonal factor's inverse,
    #: :class:`DiagonalInverseFactor`, serves ``"cholesky"`` too: see
    #: :data:`FACTOR_DECOMPOSITIONS`).
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
        ok = all_finite(eigenvectors) & all_finite(eigenvalues)
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
        cls,
        matrix: Tensor,
        side: str,
        dtype: torch.dtype,
        shift: Tensor,
        *,
        check_finite: bool = True,
    ) -> CholeskyFactor:
        """``(F + shift·I)⁻¹`` in ``dtype`` (``shift`` from :func:`tikhonov_shifts`).

        ``check_finite=False``: ``ok`` says only that the factorisation succeeded; the caller
        checks the inverses of many factors together (:func:`check_inverses_finite`).
        """
        damped = matrix.to(dtype, copy=True)
        damped.diagonal().add_(shift.to(dtype))
        factor, info = torch.linalg.cholesky_ex(damped)
        solution = cls._solution(factor)
        ((name, _, _),) = cls.layout(side, matrix.shape[0])
        ok = all_finite(solution) & (info == 0) if check_finite else info == 0
        return cls(side, {name: solution}, ok)

    @classmethod
    def compute_many(
        cls,
        matrices: Sequence[Tensor],
        sides: Sequence[str],
        dtype: torch.dtype,
        shifts: Sequence[Tensor],
    ) -> list[CholeskyFactor]:
        """:meth:`compute` of equal-size factors in one batched factorisation and inverse.

        On a GPU a few launches for all of them instead of a few per factor (on an H200,
        ResNet-32's factors: 7.0 ms against 12.7; ResNet-50's, up to 4608 wide: 0.136 s
        against 0.113, docs/benchmarks.md). Each result equals :meth:`compute`'s to round-off
        (a batched solver may order its arithmetic differently), has its own success flag
        and its own memory (a view would keep the whole batch alive).
        """
        damped = torch.stack([m.to(dtype) for m in matrices])
        shift = torch.stack([s.to(dtype) for s in shifts])
        damped.diagonal(dim1=-2, dim2=-1).add_(shift.unsqueeze(-1))
        factor, info = torch.linalg.cholesky_ex(damped)
        solution = cls._solution(factor)
        ok = finite_flags(list(solution)) & (info == 0)
        dim = damped.shape[-1]
        return [
            cls(side, {cls.layout(side, dim)[0][0]: solution[i].clone()}, ok[i])
            for i, side in enumerate(sides)
        ]

    @staticmethod
    def _solution(factor: Tensor) -> Tensor:
        """What is kept of the Cholesky factors ``L`` (one or a stack): the inverse."""
        return _symmetric_inverse(factor)


class CholeskyRootFactor(CholeskyFactor):
    """``F + shift·I = L Lᵀ``, kept as its Cholesky factor ``<side>_chol``: no inverse formed.

    A gradient is then preconditioned by triangular solves (:class:`~dkfac.curvature.inverse.
    CholeskyInverse`), which cost what the inverse's product costs in arithmetic, while the
    inverse itself (``torch.cholesky_inverse``: about twice the factorisation's time on a CPU,
    ``2d³`` operations of triangular solves on CUDA) is never made: the cheaper method when a
    decomposition serves few steps (docs/math.md, "Cholesky factors without inverses").

    The tensor is ``L`` in its lower triangle and ``Lᵀ`` in its upper one: a symmetric matrix,
    so only its upper triangle travels and the receiver's mirror restores it bit for bit, and
    ``torch.linalg.solve_triangular`` reads only the triangle it is told to (documented), ``L``
    or ``Lᵀ``, without a transposed copy.
    """

    method = "cholesky"

    @staticmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """The Cholesky factor, mirrored onto its upper triangle (symmetric)."""
        return [(f"{side}_chol", (dim, dim), True)]

    @staticmethod
    def _solution(factor: Tensor) -> Tensor:
        """``L`` with ``Lᵀ`` above its diagonal, row-major (as every received copy is).

        Sums with zeros, so every entry is exact. A sum takes its first operand's layout, and
        LAPACK's ``L`` is column-major: the symmetric result's transpose is then the same
        matrix, row-major, without a copy.
        """
        mirrored = torch.add(factor, factor.mT.triu(1))
        return mirrored.mT if mirrored.mT.is_contiguous() else mirrored.contiguous()


def check_inverses_finite(decompositions: Sequence[CholeskyFactor]) -> None:
    """``ok &= (the inverse, or Cholesky factor, is finite)`` for each, in a few launches.

    For decompositions computed with ``check_finite=False``: the same flags as their own check,
    without its launches per factor (on a GPU four each: about 430 for ResNet-50 on every
    decomposition step).
    """
    by_device: dict[torch.device, list[CholeskyFactor]] = {}
    for decomposition in decompositions:
        by_device.setdefault(decomposition.ok.device, []).append(decomposition)
    for group in by_device.values():
        inverses = [next(iter(decomposition.tensors.values())) for decomposition in group]
        oks = torch.stack([decomposition.ok for decomposition in group]) & finite_flags(inverses)
        for decomposition, ok in zip(group, oks, strict=True):
            decomposition.ok = ok


def _symmetric_inverse(factor: Tensor) -> Tensor:
    """The inverse from Cholesky factors (one or a stack), exactly symmetric and row-major.

    Only the upper triangle travels to other workers, so the owner's copy must be exactly
    symmetric. On the CPU, ATen mirrors LAPACK's one computed triangle onto the other,
    column-major: the transpose is the same matrix, row-major, without a copy. cuSOLVER's and
    MAGMA's inverses solve column by column (x_ij and x_ji round apart): (X + Xᵀ)/2 is
    exactly symmetric (addition commutes), written row-major (their X is column-major, and a
    sum takes its first operand's layout).
    """
    inverse = torch.cholesky_inverse(factor)
    if inverse.device.type == "cpu":
        return inverse.mT if inverse.mT.is_contiguous() else inverse.contiguous()
    symmetric = torch.empty_like(inverse, memory_format=torch.contiguous_format)
    return torch.add(inverse, inverse.mT, out=symmetric).mul_(0.5)


class DiagonalEigenFactor(FactorDecomposition):
    """A diagonal factor's eigendecomposition: its eigenvalues ``l<side>`` are its diagonal.

    The eigenvectors are the identity and are not stored; the eigenvalues stay in the
    factor's own order (index ``i`` is token ``i``), so a row is preconditioned by its own
    entry only.
    """

    method = "eigen"

    @staticmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """The eigenvalues."""
        return [(f"l{side}", (dim,), False)]

    @classmethod
    def compute(cls, diagonal: Tensor, side: str, dtype: torch.dtype) -> DiagonalEigenFactor:
        """The diagonal in ``dtype``; negative round-off clamped to zero, as in EigenFactor."""
        values = diagonal.to(dtype)
        return cls(side, {f"l{side}": values.clamp_min(0.0)}, all_finite(values))


class DiagonalInverseFactor(FactorDecomposition):
    """``(F + shift·I)⁻¹`` of a diagonal factor: the reciprocals ``<side>_inv`` of its entries."""

    method = "inverse"

    @staticmethod
    def layout(side: str, dim: int) -> list[TensorSpec]:
        """The damped inverse's diagonal."""
        return [(f"{side}_inv", (dim,), False)]

    @classmethod
    def compute(
        cls, diagonal: Tensor, side: str, dtype: torch.dtype, shift: Tensor
    ) -> DiagonalInverseFactor:
        """``1 / (d_i + shift)`` in ``dtype``; not ok unless every damped entry is positive."""
        damped = diagonal.to(dtype) + shift.to(dtype)
        inverse = damped.reciprocal()
        ok = all_finite(inverse) & (damped > 0).all()
        return cls(side, {f"{side}_inv": inverse}, ok)


#: The factor decomposition of each ``inverse_method``: of a dense factor, of a diagonal one.
FACTOR_DECOMPOSITIONS: Mapping[str, tuple[type[FactorDecomposition], type[FactorDecomposition]]]
FACTOR_DECOMPOSITIONS = MappingProxyType(
    {
        "eigen": (EigenFactor, DiagonalEigenFactor),
        "inverse": (CholeskyFactor, DiagonalInverseFactor),
        # A diagonal factor's inverse is elementwise: nothing to solve.
        "cholesky": (CholeskyRootFactor, DiagonalInverseFactor),
    }
)
#: What ``inverse_method`` may be.
INVERSE_METHODS: tuple[str, ...] = tuple(FACTOR_DECOMPOSITIONS)
#: The methods damped by factored Tikhonov shifts fixed when decomposed (``π`` from traces).
SHIFTED_METHODS: tuple[str, ...] = ("inverse", "cholesky")


def shifted_method(method: str) -> bool:
    """Whether ``method``'s factors are decomposed with their Tikhonov shifts."""
    return method in SHIFTED_METHODS


def _decomposition_class(method: str, diagonal: bool) -> type[FactorDecomposition]:
    dense, diagonal_class = FACTOR_DECOMPOSITIONS[method]
    return diagonal_class if diagonal else dense


def factor_tensor_shapes(method: str, side: str, dim: int) -> list[TensorSpec]:
    """``(name, shape, symmetric)`` of the tensors of one factor's decomposition, in order.

    Args:
        method: ``"eigen"``, ``"inverse"`` or ``"cholesky"``.
        side: ``"a"`` or ``"g"``.
        dim: the factor's side length ``d`` (a
            :class:`~dkfac.curvature.factor_side.DiagonalSide` for a diagonal factor).
    """
    return _decomposition_class(method, is_diagonal(dim)).layout(side, int(dim))


def factor_decomposition(
    method: str, side: str, tensors: dict[str, Tensor], ok: Tensor, *, diagonal: bool = False
) -> FactorDecomposition:
    """A received (or loaded) decomposition of factor ``side`` as its method's class."""
    return _decomposition_class(method, diagonal)(side, tensors, ok)


def decompose_factor(
    matrix: Tensor,
    side: str,
    method: str,
    dtype: torch.dtype,
    shift: Tensor | None = None,
    *,
    check_finite: bool = True,
) -> FactorDecomposition:
    """Decompose one factor in ``dtype``: by ``method``'s class of a dense factor.

    :class:`EigenFactor`, :class:`CholeskyFactor` (``"inverse"``) or
    :class:`CholeskyRootFactor` (``"cholesky"``). A vector is a diagonal factor:
    :class:`DiagonalEigenFactor` or :class:`DiagonalInverseFactor`. ``check_finite=False``
    leaves a dense Cholesky decomposition's finiteness to the caller
    (:func:`check_inverses_finite`); every other decomposition checks its own.

    Raises:
        ValueError: an unknown ``method``, or a shifted one without the Tikhonov ``shift``.
        torch.linalg.LinAlgError: the eigensolver did not converge.
    """
    diagonal = matrix.dim() == 1
    if method == "eigen":
        if diagonal:
            return DiagonalEigenFactor.compute(matrix, side, dtype)
        return EigenFactor.compute(matrix, side, dtype)
    if not shifted_method(method):
        raise ValueError(f"decompose_factor: unknown method {method!r}")
    if shift is None:
        raise ValueError(f"decompose_factor(method={method!r}) needs the Tikhonov shift")
    if diagonal:
        return DiagonalInverseFactor.compute(matrix, side, dtype, shift)
    dense = _decomposition_class(method, diagonal=False)
    assert issubclass(dense, CholeskyFactor)
    return dense.compute(matrix, side, dtype, shift, check_finite=check_finite)
