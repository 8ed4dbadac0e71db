"""The loss the command line trains with: cross-entropy over every label of a batch."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_cross_entropy(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of each label: one per example (classes) or per position (text).

    ``logits`` are ``(N, C)`` for ``(N,)`` labels, or ``(N, T, C)`` for ``(N, T)`` labels (a
    language model's next-token targets); the mean is over all ``N·T`` labels, so a batch of
    text counts every position as one prediction, as accuracy does.
    """
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction=reduction)
