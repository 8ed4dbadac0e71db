"""``nn.Embedding`` as a Kronecker-factored block: one-hot inputs give a diagonal ``A``.

An embedding looks up row ``x`` of its weight ``W`` (``num_embeddings x dim``): it is a linear
layer without bias applied to the one-hot vector of the token, with its weight stored
``(in, out)``. The Gram of one-hot rows is diagonal, ``Σ a aᵀ = diag(c)`` with ``c_v`` the
number of rows (tokens) equal to ``v``, so ``A`` needs no product at all, only counts
(kfac-jax's treatment of embeddings). ``G`` is a linear layer's. See ``docs/math.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dkfac.curvature.blocks import FactorStatistic, TransposedLinearBlock, UnsupportedLayerError


class EmbeddingBlock(TransposedLinearBlock):
    """``nn.Embedding``: ``y = onehot(x) W``, ``W`` of ``(num_embeddings, embedding_dim)``.

    ``A`` (``num_embeddings`` square) is held as a dense matrix that is diagonal, so every
    strategy moves, averages and decomposes it like any factor (its running average stays
    diagonal, and so do its decompositions); ``max_factor_dim`` bounds the vocabulary this
    costs. A token that never occurred has ``A``'s entry 0: its row of the preconditioned
    gradient is its (zero) gradient row divided by the damping, so ``padding_idx``'s row stays
    untouched. Refused: ``sparse=True`` (a sparse gradient is not a matrix K-FAC can
    precondition in place) and ``scale_grad_by_freq=True`` (the gradient is then not the sum
    over the rows that the factors describe).
    """

    kind = "Embedding"

    def __init__(self, module: nn.Embedding) -> None:
        if module.sparse:
            raise UnsupportedLayerError(
                "an embedding with sparse=True is not supported (its gradient is a sparse "
                "tensor); use sparse=False or add its name to skip_layers"
            )
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                "an embedding with scale_grad_by_freq=True is not supported (its gradient "
                "is not the sum over the tokens that K-FAC's factors describe); add its name "
                "to skip_layers"
            )
        super().__init__(module)

    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``diag(c)``: how often each index occurs in ``x`` (one row per index)."""
        tokens = x.reshape(-1)
        # Counted by index_add, not bincount: bincount sizes its output from the largest index,
        # which a GPU would have to read back.
        counts = torch.zeros(self.a_dim, dtype=dtype, device=x.device)
        counts.index_add_(0, tokens, torch.ones(tokens.numel(), dtype=dtype, device=x.device))
        examples = int(x.shape[0]) if x.dim() >= 1 else 1
        return FactorStatistic(torch.diag(counts), tokens.numel(), examples)

    def rows_follow(self, x: Tensor, batch: int) -> bool:
        """Whether ``x`` holds ids of the pass's ``batch`` examples along dim 0.

        A position embedding looked up once for every sequence (ids ``(T,)`` or ``(1, T)``,
        as Hugging Face models pass them) does not: its output is broadcast over the batch,
        so its gradient is the examples' sum and no ``G`` from it is the examples' factor.
        """
        return (int(x.shape[0]) if x.dim() else 1) == batch

    def describe(self) -> str:
        """The layer's class (its ``A`` is diagonal)."""
        return f"{type(self.module).__name__} (diagonal A)"
