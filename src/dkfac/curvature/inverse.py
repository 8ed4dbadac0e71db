"""Decompositions of a layer's Kronecker factors and their use as a preconditioner.

Two methods, one interface (:class:`KroneckerInverse`):

* :class:`EigenInverse` stores ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ`` and applies
  exactly ``(A ⊗ G + γ I)⁻¹ vec(∇)`` as
  ``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``. The damping is applied at preconditioning
  time, so a changing damping schedule takes effect at once.
* :class:`TikhonovInverse` stores ``(A + √γ·π I)⁻¹`` and ``(G + √γ/π I)⁻¹`` (factored
  Tikhonov damping, Martens & Grosse 2015 §6.3) computed through Cholesky, with
  ``π = sqrt((tr A / d_A) / (tr G / d_G))``; it applies ``G_d⁻¹ ∇ A_d⁻¹``.

Decompositions report success as a device boolean so the caller can check many layers with a
single host synchronisation.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor


class DecompositionError(RuntimeError):
    """A factor could not be decomposed (not finite, or the algorithm failed)."""


class KroneckerInverse(ABC):
    """The inverse of one layer's damped Kronecker curvature, ready to precondition."""

    method: ClassVar[str]

    @abstractmethod
    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``(A ⊗ G + damping)⁻¹``-like product with the ``(d_G, d_A)`` gradient matrix."""

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The tensors that define this inverse (for state_dict)."""

    @abstractmethod
    def ok(self) -> Tensor:
        """Device boolean: every stored tensor is finite (and factorisations succeeded)."""


class EigenInverse(KroneckerInverse):
    """Eigendecompositions of both factors; exact damped Kronecker inverse."""

    method = "eigen"

    def __init__(self, qa: Tensor, la: Tensor, qg: Tensor, lg: Tensor) -> None:
        self.qa, self.la, self.qg, self.lg = qa, la, qg, lg

    @classmethod
    def from_factors(cls, a: Tensor, g: Tensor, damping: float, dtype: torch.dtype) -> EigenInverse:
        """Eigendecompose ``A`` and ``G`` in ``dtype``.

        Tiny negative eigenvalues from round-off are clamped to zero, which keeps
        ``λ_G λ_A + γ >= γ > 0``.

        Raises:
            torch.linalg.LinAlgError: the eigensolver did not converge.
        """
        la, qa = torch.linalg.eigh(a.to(dtype))
        lg, qg = torch.linalg.eigh(g.to(dtype))
        # eigh returns column-major eigenvectors; store them row-major like any received copy,
        # so that every worker's GEMMs take the same path and round identically.
        return cls(qa.contiguous(), la.clamp_min(0.0), qg.contiguous(), lg.clamp_min(0.0))

    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``."""
        g = grad.to(self.qa.dtype)
        rotated = self.qg.t() @ g @ self.qa
        rotated = rotated / (torch.outer(self.lg, self.la) + damping)
        return (self.qg @ rotated @ self.qa.t()).to(grad.dtype)

    def tensors(self) -> dict[str, Tensor]:
        """Eigenvectors and eigenvalues of both factors."""
        return {"qa": self.qa, "la": self.la, "qg": self.qg, "lg": self.lg}

    def ok(self) -> Tensor:
        """All eigenpairs finite."""
        return torch.stack([torch.isfinite(t).all() for t in self.tensors().values()]).all()


def tikhonov_pi(a: Tensor, g: Tensor) -> Tensor:
    """``π = sqrt((tr A / d_A) / (tr G / d_G))``, 1 when either trace is not positive."""
    mean_a = torch.diagonal(a).sum() / a.shape[0]
    mean_g = torch.diagonal(g).sum() / g.shape[0]
    valid = (mean_a > 0) & (mean_g > 0)
    ratio = torch.where(valid, mean_a / torch.where(valid, mean_g, 1.0), 1.0)
    return torch.sqrt(ratio)


class TikhonovInverse(KroneckerInverse):
    """Inverses of the π-damped factors, through Cholesky."""

    method = "inverse"

    def __init__(self, a_inv: Tensor, g_inv: Tensor, info: Tensor | None = None) -> None:
        self.a_inv, self.g_inv = a_inv, g_inv
        self.info = info

    @classmethod
    def from_factors(
        cls, a: Tensor, g: Tensor, damping: float, dtype: torch.dtype
    ) -> TikhonovInverse:
        """``(A + √γ·π I)⁻¹`` and ``(G + √γ/π I)⁻¹`` in ``dtype``."""
        a, g = a.to(dtype), g.to(dtype)
        pi = tikhonov_pi(a, g)
        root = math.sqrt(damping)
        a_inv, a_info = _cholesky_inverse(a, root * pi)
        g_inv, g_info = _cholesky_inverse(g, root / pi)
        return cls(a_inv.contiguous(), g_inv.contiguous(), a_info | g_info)

    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """``(G + √γ/π I)⁻¹ ∇ (A + √γ·π I)⁻¹`` (damping fixed at decomposition time)."""
        g = grad.to(self.a_inv.dtype)
        return (self.g_inv @ g @ self.a_inv).to(grad.dtype)

    def tensors(self) -> dict[str, Tensor]:
        """The two damped inverses."""
        return {"a_inv": self.a_inv, "g_inv": self.g_inv}

    def ok(self) -> Tensor:
        """Both Cholesky factorisations succeeded and the inverses are finite."""
        finite = torch.isfinite(self.a_inv).all() & torch.isfinite(self.g_inv).all()
        return finite if self.info is None else finite & (self.info == 0)


def _cholesky_inverse(matrix: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """``(matrix + shift·I)⁻¹`` via Cholesky, with the LAPACK info code (0 on success)."""
    damped = matrix + torch.diag_embed(shift.expand(matrix.shape[0]))
    factor, info = torch.linalg.cholesky_ex(damped)
    return torch.cholesky_inverse(factor), info


def decompose(
    a: Tensor, g: Tensor, damping: float, method: str, dtype: torch.dtype
) -> KroneckerInverse:
    """Decompose a factor pair with ``method`` in ``dtype``.

    Raises:
        torch.linalg.LinAlgError: the decomposition algorithm itself failed.
    """
    if method == "eigen":
        return EigenInverse.from_factors(a, g, damping, dtype)
    return TikhonovInverse.from_factors(a, g, damping, dtype)


def inverse_from_tensors(method: str, tensors: dict[str, Tensor]) -> KroneckerInverse:
    """Rebuild an inverse from :meth:`KroneckerInverse.tensors` (for load_state_dict)."""
    if method == "eigen":
        return EigenInverse(tensors["qa"], tensors["la"], tensors["qg"], tensors["lg"])
    return TikhonovInverse(tensors["a_inv"], tensors["g_inv"])
