"""CIFAR-style residual networks (He et al., 2016).

The networks follow the CIFAR-10 variant described in *Deep Residual Learning for
Image Recognition*: a 3x3 stem convolution with 16 channels, three stages of ``n``
basic blocks with 16, 32 and 64 channels (the second and third stage halve the
spatial resolution), global average pooling and a linear classifier. The depth is
``6 * n + 2``. Whenever a block changes the shape of its input, the shortcut is a
1x1 convolution followed by batch normalization (the "option B" projection).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["BasicBlock", "CifarResNet", "resnet20", "resnet32", "resnet56"]

_STAGE_CHANNELS: tuple[int, int, int] = (16, 32, 64)


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """Return a bias-free 3x3 convolution with padding 1."""
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch normalization and a residual connection.

    Args:
        in_channels: Number of input channels.
        out_channels: Number of output channels.
        stride: Stride of the first convolution; ``2`` halves the resolution.

    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(N, in_channels, H, W)``.

        Returns:
            Output of shape ``(N, out_channels, H // stride, W // stride)``.

        """
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.shortcut(x)
        result: torch.Tensor = self.relu2(out)
        return result


class CifarResNet(nn.Module):
    """ResNet for 3x32x32 inputs with depth ``6 * n + 2``.

    Args:
        depth: Total number of weighted layers; ``(depth - 2)`` must be a positive
            multiple of 6 (e.g. 20, 32, 44, 56, 110).
        num_classes: Number of output classes.
        in_channels: Number of input image channels.

    Raises:
        ValueError: If ``depth`` is not of the form ``6 * n + 2`` with ``n >= 1``, or
            ``num_classes`` is not positive.

    """

    def __init__(self, depth: int, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(
                f"CifarResNet depth must be 6 * n + 2 with n >= 1 (e.g. 20, 32, 56), got {depth}"
            )
        if num_classes < 1:
            raise ValueError(f"num_classes must be positive, got {num_classes}")
        self.depth = depth
        blocks_per_stage = (depth - 2) // 6

        self.conv1 = _conv3x3(in_channels, _STAGE_CHANNELS[0])
        self.bn1 = nn.BatchNorm2d(_STAGE_CHANNELS[0])
        self.relu = nn.ReLU()

        stages: list[nn.Sequential] = []
        channels = _STAGE_CHANNELS[0]
        for index, out_channels in enumerate(_STAGE_CHANNELS):
            first_stride = 1 if index == 0 else 2
            blocks: list[nn.Module] = []
            for block_index in range(blocks_per_stage):
                stride = first_stride if block_index == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages

        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(_STAGE_CHANNELS[-1], num_classes)
        self._init_weights()
        logger.debug(
            "Built CifarResNet-%d with %d parameters",
            depth,
            sum(p.numel() for p in self.parameters()),
        )

    def _init_weights(self) -> None:
        """Kaiming-initialize convolutions and reset batch-norm affine parameters."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Compute class logits.

        Args:
            x: Images of shape ``(N, in_channels, H, W)``, typically ``H = W = 32``.

        Returns:
            Logits of shape ``(N, num_classes)``.

        """
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = torch.flatten(self.pool(out), 1)
        logits: torch.Tensor = self.fc(out)
        return logits


def resnet20(num_classes: int = 10) -> CifarResNet:
    """Return a ResNet-20 for CIFAR-sized inputs (about 0.27M parameters).

    Args:
        num_classes: Number of output classes.

    Returns:
        The freshly initialized network.

    """
    return CifarResNet(20, num_classes)


def resnet32(num_classes: int = 10) -> CifarResNet:
    """Return a ResNet-32 for CIFAR-sized inputs (about 0.46M parameters).

    Args:
        num_classes: Number of output classes.

    Returns:
        The freshly initialized network.

    """
    return CifarResNet(32, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    """Return a ResNet-56 for CIFAR-sized inputs (about 0.85M parameters).

    Args:
        num_classes: Number of output classes.

    Returns:
        The freshly initialized network.

    """
    return CifarResNet(56, num_classes)
