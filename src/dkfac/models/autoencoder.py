"""A deep autoencoder, the shape of Martens and Grosse's (2015) K-FAC benchmark."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DeepAutoencoder"]


class DeepAutoencoder(nn.Module):
    """Encoder ``in-1000-500-250-code``, decoder back; logistic units, a linear code.

    As in Hinton and Salakhutdinov (2006) and Martens and Grosse (2015, section 13): every
    hidden layer is an ``nn.Linear`` followed by a sigmoid, the code layer is linear, and the
    output is the logits of each input value (train it with
    ``F.binary_cross_entropy_with_logits`` against inputs in ``[0, 1]``). Narrow deep sigmoid
    networks like this one are where first-order methods are slow.

    Args:
        in_features: width of the input (64 for scikit-learn's 8x8 digits).
        hidden: widths of the encoder's hidden layers; the decoder mirrors them.
        code: width of the code layer.
    """

    def __init__(
        self, in_features: int = 64, hidden: Sequence[int] = (1000, 500, 250), code: int = 30
    ) -> None:
        super().__init__()
        widths = [in_features, *hidden, code]
        if min(widths) < 1:
            raise ValueError(f"widths must be positive, got {widths}")
        self.encoder = _logistic_stack(widths)
        self.decoder = _logistic_stack(widths[::-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the reconstruction of ``x`` (flattened to ``(N, in_features)``)."""
        return self.decoder(self.encoder(x.flatten(1)))  # type: ignore[no-any-return]


def _logistic_stack(widths: Sequence[int]) -> nn.Sequential:
    """``nn.Linear`` layers through ``widths``, a sigmoid after each but the last."""
    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if index < len(widths) - 2:
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)
