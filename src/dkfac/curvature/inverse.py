"""Decompositions of a layer's Kronecker factors and their use as a preconditioner.

Three methods, one interface (:class:`KroneckerInverse`):

* :class:`EigenInverse` stores ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` and applies
  exactly ``(A ⊗ G + γ I)⁻¹ vec(∇)`` as
  ``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``. The damping is applied at preconditioning
  time, so a changing damping schedule takes effect at once.
* :class:`TikhonovInverse` stores ``(A + √γ·π I)⁻¹`` and ``(G + √γ/π I)⁻¹`` (factored
  Tikhonov damping, Martens & Grosse 2015 §6.3) computed through Cholesky, with
  ``π = sqrt((tr A / d_A) / (tr G / d_G))``; it applies ``G_d⁻¹ ∇ A_d⁻¹``.
* :class:`CholeskyInverse` applies the same ``G_d⁻¹ ∇ A_d⁻¹`` by triangular solves with the
  damped factors' Cholesky factors, never forming the inverses: less work when each
  decomposition serves few steps.

Each method decomposes each factor on its own (:mod:`dkfac.curvature.factor_decomposition`:
each class owns the names, shapes and symmetry of its tensors, i.e. what travels; a factor
held as its diagonal decomposes elementwise and has no eigenvector matrix), which lets
distributed strategies place the two factors of one layer on different workers; only the
Tikhonov shift couples them, through ``π``, which the caller computes from both traces
(:func:`tikhonov_shifts`). Decompositions report success as a device boolean so the caller can
check many layers with a single host synchronisation.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import Tensor

from dkfac.curvature.factor_decomposition import (
    FactorDecomposition,
    decompose_factor,
    shifted_method,
)
from dkfac.curvature.factor_side import FACTOR_SIDES
from dkfac.curvature.gram import CUDA_MM_OUT_DTYPE
from dkfac.curvature.tikhonov import tikhonov_shifts, trace_mean


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


#: What ``precondition_precision`` may be (:meth:`KroneckerInverse.precondition`).
PRECONDITION_PRECISIONS: tuple[str, ...] = ("highest", "bf16")

Product = Callable[[Tensor, Tensor], Tensor]


def check_precondition_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECONDITION_PRECISIONS`.

    Raises:
        ValueError: it is not.
    """
    if precision not in PRECONDITION_PRECISIONS:
        raise ValueError(
            f"precondition_precision={precision!r} is not allowed: expected one of "
            f"{', '.join(map(repr, PRECONDITION_PRECISIONS))}"
        )
    return precision


def bf16_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of bfloat16 matrices (or stacks of them), summed in float32, rounded once.

    On CUDA through a float32 output (cuBLAS may otherwise round partial sums of a split
    reduction to bfloat16: ``allow_bf16_reduced_precision_reduction``); CPU products of
    bfloat16 matrices sum in float32 already.
    """
    if a.device.type == "cuda" and CUDA_MM_OUT_DTYPE:
        product = torch.bmm if a.dim() == 3 else torch.mm
        return product(a, b, out_dtype=torch.float32).to(torch.bfloat16)
    return a @ b


class KroneckerInverse(ABC):
    """The inverse of one layer's damped Kronecker curvature, ready to precondition.

    ``precision="bf16"`` rounds the decomposition's tensors (once: the rounded copies are kept
    with the inverse, which is replaced, never changed, at each decomposition, and take half
    its bytes again) and the gradient to bfloat16, sums each matrix product in float32 and
    rounds it, and every elementwise result, to bfloat16: the products then run on bfloat16
    units (tensor cores; AVX-512 BF16 on CPUs, about 3x a float32 product; slower than
    float32 where there are none), at a relative error of at most 2⁻⁸ per rounding
    (docs/math.md, "Preconditioning in bfloat16").
    """

    method: ClassVar[str]
    #: Whether ``precision="bf16"`` is possible (triangular solves have no bfloat16 kernel).
    bf16_products: ClassVar[bool] = True

    def __init__(self) -> None:
        self._rounded: dict[str, Tensor] | None = None
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype, torch.device], ...] = ()

    def precondition(self, grad: Tensor, damping: float, precision: str = "highest") -> Tensor:
        """``(A ⊗ G + damping)⁻¹``-like product with the ``(d_G, d_A)`` gradient matrix.

        Args:
            grad: the layer's gradient matrix; or a stack of them, one per matrix of an
                inverse whose tensors are stacked the same way (:func:`stack_inverses`).
            damping: ``γ`` (used by ``"eigen"``; the shifted methods fixed it when decomposed).
            precision: ``"highest"``: computed in the decomposition's dtype; ``"bf16"``: in
                bfloat16 (see the class).

        Returns:
            The preconditioned gradient, in ``grad``'s dtype.

        Raises:
            ValueError: an unknown ``precision``, or ``"bf16"`` for a method without
                bfloat16 products.
        """
        product: Product = torch.matmul
        if check_precondition_precision(precision) == "highest":
            tensors = self.tensors()
        else:
            check_method_precision(self.method, precision)
            tensors, product = self.bf16_tensors(), bf16_product
        work = next(iter(tensors.values())).dtype
        # No cast asked for where none is needed: a plain step preconditions every layer.
        result = self._apply(
            tensors, grad if grad.dtype == work else grad.to(work), damping, product
        )
        return result if result.dtype == grad.dtype else result.to(grad.dtype)

    def bf16_tensors(self) -> dict[str, Tensor]:
        """:meth:`tensors` rounded to bfloat16, made once and kept (``precision="bf16"``)."""
        if self._rounded is None:
            self._rounded = {k: t.to(torch.bfloat16) for k, t in self.tensors().items()}
        return self._rounded

    def layout(self) -> tuple[tuple[str, tuple[int, ...], torch.dtype, torch.device], ...]:
        """Each tensor's name, shape, dtype and device, in :meth:`tensors` order.

        Made on the first call and kept: an inverse's tensors are fixed when it is made (a new
        decomposition makes a new inverse), and a plain step asks once per layer.
        """
        if not self._layout:
            self._layout = tuple(
                (name, tuple(t.shape), t.dtype, t.device) for name, t in self.tensors().items()
            )
        return self._layout

    def held_tensors(self) -> list[Tensor]:
        """Every tensor this inverse keeps: :meth:`tensors` and, once made, their bf16 copies."""
        rounded = [] if self._rounded is None else list(self._rounded.values())
        return [*self.tensors().values(), *rounded]

    @abstractmethod
    def _apply(
        self, tensors: Mapping[str, Tensor], grad: Tensor, damping: float, product: Product
    ) -> Tensor:
        """The product with ``grad``: operands in one dtype, matrix products by ``product``."""

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The tensors that define this inverse (for state_dict)."""


class EigenInverse(KroneckerInverse):
    """Eigendecompositions of both factors; exact damped Kronecker inverse.

    A diagonal factor has no eigenvector matrix (``qa`` or ``qg`` is ``None``: the identity),
    and its rotations are skipped.
    """

    method = "eigen"

    def __init__(self, qa: Tensor | None, la: Tensor, qg: Tensor | None, lg: Tensor) -> None:
        super().__init__()
        self.qa, self.la, self.qg, self.lg = qa, la, qg, lg

    def _apply(
        self, tensors: Mapping[str, Tensor], grad: Tensor, damping: float, product: Product
    ) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``."""
        qa, qg = tensors.get("qa"), tensors.get("qg")
        rotated = grad if qg is None else product(qg.mT, grad)
        rotated = rotated if qa is None else product(rotated, qa)
        # λ_G λ_Aᵀ, of each matrix in a stack too (torch.outer's one product per entry).
        outer = tensors["lg"].unsqueeze(-1) * tensors["la"].unsqueeze(-2)
        rotated = rotated / (outer + damping)
        rotated = rotated if qg is None else product(qg, rotated)
        return rotated if qa is None else product(rotated, qa.mT)

    def tensors(self) -> dict[str, Tensor]:
        """Eigenvectors (of a dense factor) and eigenvalues of both factors."""
        named = {"qa": self.qa, "la": self.la, "qg": self.qg, "lg": self.lg}
        return {name: tensor for name, tensor in named.items() if tensor is not None}


class TikhonovInverse(KroneckerInverse):
    """Inverses of the π-damped factors, through Cholesky."""

    method = "inverse"

    def __init__(self, a_inv: Tensor, g_inv: Tensor) -> None:
        super().__init__()
        self.a_inv, self.g_inv = a_inv, g_inv

    def _apply(
        self, tensors: Mapping[str, Tensor], grad: Tensor, damping: float, product: Product
    ) -> Tensor:
        """``(G + √γ/π I)⁻¹ ∇ (A + √γ·π I)⁻¹`` (damping fixed at decomposition time).

        A diagonal factor's inverse is a vector: it scales the rows (``G``) or columns (``A``).
        """
        a_inv, g_inv = tensors["a_inv"], tensors["g_inv"]
        vector = grad.dim() - 1  # a diagonal factor's inverse is a vector (per matrix)
        left = g_inv.unsqueeze(-1) * grad if g_inv.dim() == vector else product(g_inv, grad)
        return left * a_inv.unsqueeze(-2) if a_inv.dim() == vector else product(left, a_inv)

    def tensors(self) -> dict[str, Tensor]:
        """The two damped inverses."""
        return {"a_inv": self.a_inv, "g_inv": self.g_inv}


class CholeskyInverse(KroneckerInverse):
    """The π-damped factors' Cholesky factors: ``G_d⁻¹ ∇ A_d⁻¹`` by triangular solves.

    Each dense side is held as :class:`~dkfac.curvature.factor_decomposition.
    CholeskyRootFactor` holds it (``<side>_chol``: ``L`` below the diagonal, ``Lᵀ`` above),
    a diagonal side as its inverse's entries (``<side>_inv``). ``G_d⁻¹ ∇ = L_G⁻ᵀ (L_G⁻¹ ∇)``
    and ``X A_d⁻¹ = (X L_A⁻ᵀ) L_A⁻¹``: four triangular solves, whose arithmetic equals the two
    products with formed inverses (``d²·n`` each against ``2·d²·n``).
    """

    method = "cholesky"
    bf16_products = False

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        names = ("a_chol", "a_inv", "g_chol", "g_inv")
        self._tensors = {name: tensors[name] for name in names if name in tensors}
        if len(self._tensors) != len(FACTOR_SIDES) or len(tensors) != len(FACTOR_SIDES):
            raise ValueError(
                f"CholeskyInverse needs one of a_chol/a_inv and one of g_chol/g_inv, got "
                f"{sorted(tensors)}"
            )

    def _apply(
        self, tensors: Mapping[str, Tensor], grad: Tensor, damping: float, product: Product
    ) -> Tensor:
        """``G_d⁻¹ ∇ A_d⁻¹``; a diagonal side scales rows (``G``) or columns (``A``).

        A solve returns its solution column-major; each side is solved for the transpose, so
        the result is row-major like a product's: the KL clip's sums over a received copy
        (row-major) and the solver's own then add in one order, and workers agree bit for bit.
        """
        solve = torch.linalg.solve_triangular
        g_root = tensors.get("g_chol")
        if g_root is None:
            left = tensors["g_inv"].unsqueeze(-1) * grad
        else:  # (∇ᵀ L_G⁻ᵀ) L_G⁻¹ = (G_d⁻¹ ∇)ᵀ: the upper triangle is L_Gᵀ, the lower L_G
            half = solve(g_root, grad.mT, upper=True, left=False)
            left = solve(g_root, half, upper=False, left=False).mT
        a_root = tensors.get("a_chol")
        if a_root is None:
            return left * tensors["a_inv"].unsqueeze(-2)
        # L_A⁻ᵀ (L_A⁻¹ Xᵀ) = (X A_d⁻¹)ᵀ.
        result: Tensor = solve(a_root, solve(a_root, left.mT, upper=False), upper=True).mT
        return result

    def tensors(self) -> dict[str, Tensor]:
        """Each side's Cholesky factor (dense) or inverse entries (diagonal)."""
        return dict(self._tensors)


#: Each ``inverse_method``'s inverse.
INVERSE_CLASSES: Mapping[str, type[KroneckerInverse]] = MappingProxyType(
    {"eigen": EigenInverse, "inverse": TikhonovInverse, "cholesky": CholeskyInverse}
)


def check_method_precision(method: str, precision: str) -> None:
    """Refuse ``precision="bf16"`` for a method without bfloat16 products.

    Raises:
        ValueError: ``"bf16"`` with ``"cholesky"`` (triangular solves have no bfloat16 kernel).
    """
    if precision == "bf16" and not INVERSE_CLASSES[method].bf16_products:
        raise ValueError(
            f"precondition_precision='bf16' is not allowed with inverse_method={method!r}: "
            "triangular solves have no bfloat16 kernel (use 'inverse' for bf16 products)"
        )


def decompose(
    a: Tensor, g: Tensor, damping: float, method: str, dtype: torch.dtype
) -> tuple[KroneckerInverse, Tensor]:
    """Decompose a factor pair with ``method`` in ``dtype``; also the device success flag.

    Raises:
        torch.linalg.LinAlgError: the decomposition algorithm itself failed.
    """
    shift_a = shift_g = None
    if shifted_method(method):
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


def stack_inverses(inverses: Sequence[KroneckerInverse]) -> KroneckerInverse:
    """One inverse of the same method whose tensors stack those of ``inverses`` (a new dim 0).

    Its :meth:`~KroneckerInverse.precondition` of a stack of gradients is each inverse's
    product with its gradient, in one batched product per matrix product.

    Raises:
        ValueError: no inverses, or inverses of different methods or tensor names.
    """
    if not inverses:
        raise ValueError("stack_inverses needs at least one inverse")
    method, names = inverses[0].method, list(inverses[0].tensors())
    if any(i.method != method or list(i.tensors()) != names for i in inverses):
        raise ValueError("stack_inverses: inverses of different methods or tensors")
    tensors = {name: torch.stack([i.tensors()[name] for i in inverses]) for name in names}
    return inverse_from_tensors(method, tensors)


def unstack_inverse(stacked: KroneckerInverse) -> list[KroneckerInverse]:
    """The inverses a :func:`stack_inverses` result holds, as views of its tensors.

    Bfloat16 copies the stack made already (:meth:`KroneckerInverse.bf16_tensors`) are shared
    the same way: a view rounds nothing again, and its ``held_tensors`` count its share.
    """
    tensors, rounded = stacked.tensors(), stacked._rounded
    views = []
    for i in range(next(iter(tensors.values())).shape[0]):
        view = inverse_from_tensors(stacked.method, {name: t[i] for name, t in tensors.items()})
        if rounded is not None:
            view._rounded = {name: t[i] for name, t in rounded.items()}
        views.append(view)
    return views


def owned_copy(inverse: KroneckerInverse) -> KroneckerInverse:
    """``inverse`` with tensors (and bf16 copies, if made) of its own: no view of a stack."""
    copy = inverse_from_tensors(
        inverse.method, {k: t.clone() for k, t in inverse.tensors().items()}
    )
    if inverse._rounded is not None:
        copy._rounded = {k: t.clone() for k, t in inverse._rounded.items()}
    return copy


def inverse_from_tensors(method: str, tensors: dict[str, Tensor]) -> KroneckerInverse:
    """Rebuild an inverse from :meth:`KroneckerInverse.tensors` (for load_state_dict)."""
    if method == "eigen":  # a diagonal factor has no eigenvectors
        return EigenInverse(tensors.get("qa"), tensors["la"], tensors.get("qg"), tensors["lg"])
    if method == "cholesky":
        return CholeskyInverse(tensors)
    return TikhonovInverse(tensors["a_inv"], tensors["g_inv"])
