"""Small pre-norm Transformers: a token-sequence classifier and a causal language model.

Every projection is an ``nn.Linear`` (queries, keys, values, the attention output and
both MLP layers, plus the classification or next-token head), so K-FAC preconditions all
of them; the embeddings and layer norms are the only other modules with parameters.
Attention is computed explicitly from the projections rather than through
``nn.MultiheadAttention``, whose fused input projection is not an ``nn.Linear`` module.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["SelfAttention", "TransformerBlock", "TransformerClassifier", "TransformerLM"]


class SelfAttention(nn.Module):
    """Multi-head self-attention built from four ``nn.Linear`` layers.

    Args:
        d_model: Width of the token representations.
        heads: Number of attention heads; must divide ``d_model``.
        dropout: Dropout probability on the attention weights.
        causal: Whether each position attends only to itself and earlier positions (a
            language model); otherwise every position attends to every position.

    Raises:
        ValueError: If ``heads`` does not divide ``d_model``.

    """

    def __init__(
        self, d_model: int, heads: int, dropout: float = 0.0, *, causal: bool = False
    ) -> None:
        super().__init__()
        if d_model % heads != 0:
            raise ValueError(f"heads={heads} must divide d_model={d_model}")
        self.causal = causal
        self.heads = heads
        self.head_dim = d_model // heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, T, D)`` -> ``(N, heads, T, head_dim)``."""
        n, t, _ = x.shape
        return x.view(n, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend every position to every position (to the earlier ones only when causal).

        Args:
            x: Representations of shape ``(N, T, d_model)``.

        Returns:
            Output of shape ``(N, T, d_model)``.

        """
        n, t, d = x.shape
        q = self._split(self.query(x))
        k = self._split(self.key(x))
        v = self._split(self.value(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.causal:
            # Made per call, not kept as a buffer: DDP and DeAR would broadcast a buffer
            # every step, and a (T, T) mask is cheap next to the projections.
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        weights = self.dropout(torch.softmax(scores, dim=-1))
        mixed = (weights @ v).transpose(1, 2).reshape(n, t, d)
        result: torch.Tensor = self.out(mixed)
        return result


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``.

    Args:
        d_model: Width of the token representations.
        heads: Number of attention heads.
        dropout: Dropout probability on attention weights and residual branches.
        mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
        causal: Whether the attention is causal (see :class:`SelfAttention`).

    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        dropout: float = 0.0,
        mlp_ratio: int = 4,
        *,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, heads, dropout, causal=causal)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.activation = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Representations of shape ``(N, T, d_model)``.

        Returns:
            Output of the same shape.

        """
        x = x + self.dropout(self.attention(self.norm1(x)))
        hidden = self.fc2(self.activation(self.fc1(self.norm2(x))))
        result: torch.Tensor = x + self.dropout(hidden)
        return result


def _check_sizes(
    model: str, sizes: dict[str, int], d_model: int, heads: int, dropout: float
) -> None:
    """Refuse sizes that are not positive, heads that do not divide ``d_model``, bad dropout."""
    bad = {key: value for key, value in sizes.items() if value < 1}
    if bad:
        raise ValueError(f"{model} sizes must be positive, got {bad}")
    if d_model % heads != 0:
        raise ValueError(f"heads={heads} must divide d_model={d_model}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def _embed(
    tokens: torch.Tensor, token_embedding: nn.Embedding, position_embedding: nn.Embedding
) -> torch.Tensor:
    """Token plus learned position embeddings of ``(N, T)`` ids, checked against ``seq_len``."""
    if tokens.ndim != 2:
        raise ValueError(f"expected token ids of shape (N, T), got {tuple(tokens.shape)}")
    length, seq_len = tokens.shape[1], position_embedding.num_embeddings
    if length > seq_len:
        raise ValueError(f"sequence length {length} exceeds seq_len={seq_len}")
    # Looked up per sequence (not once and broadcast): one row per token of every example, as
    # dkfac's EmbeddingBlock needs (a broadcast lookup is detected and passed through).
    positions = torch.arange(length, device=tokens.device).expand(tokens.shape[0], -1)
    embedded: torch.Tensor = token_embedding(tokens) + position_embedding(positions)
    return embedded


class _TokenTransformer(nn.Module):
    """What both token models hold, under the same names, created in the same order.

    Embeddings of the tokens and of their positions, dropout, ``layers`` blocks made by
    ``block``, a final norm and a linear head of ``outputs`` features. One order for both
    models: the same seed gives the same weights, and state dicts keep their key order.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        seq_len: int,
        dropout: float,
        outputs: int,
        block: Callable[[], nn.Module],
        layers: int,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(block() for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, outputs)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)
        logger.debug(
            "Built %s with %d parameters",
            type(self).__name__,
            sum(p.numel() for p in self.parameters()),
        )


class TransformerClassifier(_TokenTransformer):
    """Token embeddings, pre-norm Transformer blocks, mean pooling and a linear head.

    Positions are encoded by a learned ``nn.Embedding`` over ``range(seq_len)``; inputs
    may be shorter than ``seq_len`` but not longer.

    Args:
        vocab_size: Number of distinct token ids.
        num_classes: Number of output classes.
        d_model: Width of the token representations.
        heads: Number of attention heads; must divide ``d_model``.
        layers: Number of Transformer blocks.
        seq_len: Longest accepted sequence.
        dropout: Dropout probability, in ``[0, 1)``.

    Raises:
        ValueError: If a size argument is not positive, ``heads`` does not divide
            ``d_model``, or ``dropout`` is outside ``[0, 1)``.

    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 32,
        dropout: float = 0.0,
    ) -> None:
        sizes = {
            "vocab_size": vocab_size,
            "num_classes": num_classes,
            "d_model": d_model,
            "heads": heads,
            "layers": layers,
            "seq_len": seq_len,
        }
        _check_sizes("TransformerClassifier", sizes, d_model, heads, dropout)
        super().__init__(
            vocab_size,
            d_model,
            seq_len,
            dropout,
            num_classes,
            lambda: TransformerBlock(d_model, heads, dropout),
            layers,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute class logits.

        Args:
            tokens: Integer token ids of shape ``(N, T)`` with ``T <= seq_len``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        Raises:
            ValueError: If ``tokens`` is not 2-D or longer than ``seq_len``.

        """
        x = _embed(tokens, self.token_embedding, self.position_embedding)
        x = self.norm(self.blocks(self.dropout(x)))
        logits: torch.Tensor = self.head(x.mean(dim=1))
        return logits


class TransformerLM(_TokenTransformer):
    """A causal language model: token embeddings, causal pre-norm blocks, a next-token head.

    The logits at position ``t`` depend on the tokens at positions ``0..t`` only, so
    ``cross_entropy(logits[:, t], tokens[:, t + 1])`` trains next-token prediction. The
    head is its own ``nn.Linear`` (not tied to the token embedding) so that K-FAC
    preconditions it and every parameter is used through the module that holds it.

    Args:
        vocab_size: Number of distinct token ids (the width of the head's output).
        d_model: Width of the token representations.
        heads: Number of attention heads; must divide ``d_model``.
        layers: Number of Transformer blocks.
        seq_len: Longest accepted sequence.
        mlp_ratio: Hidden width of each block's MLP as a multiple of ``d_model``.
        dropout: Dropout probability, in ``[0, 1)``.

    Raises:
        ValueError: If a size argument is not positive, ``heads`` does not divide
            ``d_model``, or ``dropout`` is outside ``[0, 1)``.

    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 32,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        sizes = {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "heads": heads,
            "layers": layers,
            "seq_len": seq_len,
            "mlp_ratio": mlp_ratio,
        }
        _check_sizes("TransformerLM", sizes, d_model, heads, dropout)
        super().__init__(
            vocab_size,
            d_model,
            seq_len,
            dropout,
            vocab_size,
            lambda: TransformerBlock(d_model, heads, dropout, mlp_ratio, causal=True),
            layers,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits at every position.

        Args:
            tokens: Integer token ids of shape ``(N, T)`` with ``T <= seq_len``.

        Returns:
            Logits of shape ``(N, T, vocab_size)``.

        Raises:
            ValueError: If ``tokens`` is not 2-D or longer than ``seq_len``.

        """
        x = _embed(tokens, self.token_embedding, self.position_embedding)
        x = self.norm(self.blocks(self.dropout(x)))
        logits: torch.Tensor = self.head(x)
        return logits
