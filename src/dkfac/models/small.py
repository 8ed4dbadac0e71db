"""Small networks for quick experiments and tests."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["MLP", "SmallCNN"]


class SmallCNN(nn.Module):
    """A two-convolution network for 8x8 images such as scikit-learn's digits.

    Architecture: ``Conv(3x3) -> ReLU -> Conv(3x3) -> ReLU -> MaxPool(2) -> Linear ->
    ReLU -> Linear``. The convolutions keep the spatial size (padding 1), so the input
    must be 8x8 for the first linear layer's shape to match.

    Args:
        in_channels: Number of input channels.
        num_classes: Number of output classes.
        width: Channels of the first convolution; the second has ``2 * width``.
        hidden: Width of the hidden linear layer.
        image_size: Side length of the square input images (must be even).

    Raises:
        ValueError: If a size argument is not positive or ``image_size`` is odd.

    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 16,
        hidden: int = 64,
        image_size: int = 8,
    ) -> None:
        super().__init__()
        if min(in_channels, num_classes, width, hidden, image_size) < 1:
            raise ValueError("SmallCNN size arguments must all be positive")
        if image_size % 2 != 0:
            raise ValueError(f"image_size must be even, got {image_size}")
        pooled = image_size // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * pooled * pooled, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Compute class logits.

        Args:
            x: Images of shape ``(N, in_channels, image_size, image_size)``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        """
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


class MLP(nn.Module):
    """A fully connected network with ReLU activations.

    Inputs with more than two dimensions are flattened from dimension 1 on.

    Args:
        in_features: Number of input features (after flattening).
        hidden: Widths of the hidden layers, in order; may be empty, in which case the
            model is a single linear layer.
        num_classes: Number of output classes.

    Raises:
        ValueError: If any width is not positive.

    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int = 10) -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        if min(widths) < 1:
            raise ValueError(f"MLP layer widths must all be positive, got {widths}")
        layers: list[nn.Module] = [nn.Flatten()]
        for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Compute class logits.

        Args:
            x: Inputs of shape ``(N, in_features)`` or ``(N, *dims)`` with
                ``prod(dims) == in_features``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        """
        logits: torch.Tensor = self.net(x)
        return logits
