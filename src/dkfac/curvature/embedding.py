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
from dkfac.curvature.factor_side import DiagonalSide


class EmbeddingBlock(TransposedLinearBlock):
    """``nn.Embedding``: ``y = onehot(x) W``, ``W`` of ``(num_embeddings, embedding_dim)``.

    Built for every ``nn.Embedding`` (not for subclasses with their own ``forward``, unless
    asked for with ``blocks={MyEmbedding: EmbeddingBlock}``, which refuses them). Exact only
    for ids holding one row per example along dim 0 (token ids ``(N, T)``, positions expanded
    per sequence): one looked up once and broadcast over the batch (Hugging Face's position
    ids ``(1, T)``) sees the examples' summed output gradient, from which no exact ``G`` exists.
    Such a layer is found at the first factor update whose passes can tell (its ids' dim 0
    differs from the model input's, :mod:`dkfac.broadcast_check`) and passes its gradient
    through, with a warning; ids ``(T,)`` with ``T`` equal to the batch size cannot be told
    apart (skip such a layer by name).

    ``A`` is held as its diagonal, a ``num_embeddings``-vector (its side is a
    :class:`~dkfac.curvature.factor_side.DiagonalSide`): every strategy averages and sends the
    vector, and decomposes it elementwise (its eigenvectors are the identity), so a
    vocabulary of 50,000 tokens costs 50,000 numbers, not a 10 GB matrix, and
    ``max_factor_dim`` bounds only ``G``. A diagonal ``A`` preconditions each token's row on its
    own, so a row whose gradient is zero (``padding_idx``, a token absent from the batch)
    stays zero. Refused:
    subclasses with their own ``forward`` (their input is not the ids they look up),
    ``sparse=True`` (a sparse gradient is not a matrix K-FAC can precondition in place) and
    ``scale_grad_by_freq=True`` (the gradient is then not the sum over the rows that the
    factors describe).
    """

    kind = "Embedding"
    # Ids of any shape, examples along dim 0 (a 1-D input holds one token per example).
    batched_dims = 1
    # A is counts, cheap to take from every token; from part of a call, a token of the other
    # part would count 0 while its row has a gradient (preconditioned by about 1/damping).
    a_from_part = False
    needs_examples_in_dim0 = True

    def __init__(self, module: nn.Embedding) -> None:
        if type(module).forward is not nn.Embedding.forward:
            raise UnsupportedLayerError(
                f"{type(module).__name__} computes its own lookup (its forward() is not "
                "nn.Embedding's: a learned position embedding that derives positions from "
                "its input, a scaled embedding); its ids are not its input, so its factors "
                "cannot be formed from it; add its name to skip_layers"
            )
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
        self.a_dim = DiagonalSide(module.num_embeddings)
        # The plain int: TorchDynamo 2.11 cannot trace an int subclass (DiagonalSide) as a size.
        self._vocabulary = int(module.num_embeddings)

    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``c``, the diagonal of ``Σ a aᵀ``: how often each index occurs in ``x``."""
        tokens = x.reshape(-1)
        # Counted by index_add, not bincount: bincount sizes its output from the largest index,
        # which a GPU would have to read back.
        counts = torch.zeros(self._vocabulary, dtype=dtype, device=x.device)
        counts.index_add_(0, tokens, torch.ones(tokens.numel(), dtype=dtype, device=x.device))
        examples = int(x.shape[0]) if x.dim() >= 1 else 1
        return FactorStatistic(counts, tokens.numel(), examples)

    def describe(self) -> str:
        """The layer's class (its ``A`` is diagonal)."""
        return f"{type(self.module).__name__} (diagonal A)"
