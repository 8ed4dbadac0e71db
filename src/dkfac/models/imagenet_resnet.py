"""ResNet-50 for ImageNet-sized inputs (He et al., 2016), written for the GPU benchmarks.

The 50-layer network of *Deep Residual Learning for Image Recognition*, Table 1: a 7x7 stem
convolution (stride 2) and 3x3 max pooling, four stages of 3, 4, 6 and 3 bottleneck blocks
(1x1 reduce, 3x3, 1x1 expand by 4; 64, 128, 256 and 512 inner channels; stages 2-4 halve
the resolution in their first block's 3x3 convolution), global average pooling and a linear
classifier: 53 convolutions and one linear layer K-FAC preconditions, about 25.6M
parameters. Its factor sizes are what the seeds' ResNet-50 figures are about.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ImageNetResNet", "resnet50"]

_EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand, each with batch norm.

    The shortcut is a projection (1x1 convolution and batch norm) when the shape changes.

    Args:
        in_channels: channels of the block's input.
        width: inner channels (the output has ``4 * width``).
        stride: stride of the 3x3 convolution and the shortcut.
    """

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * _EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output ``relu(F(x) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        result: torch.Tensor = self.relu(out + self.shortcut(x))
        return result


class ImageNetResNet(nn.Module):
    """A bottleneck ResNet for ImageNet-sized inputs.

    Args:
        blocks: bottleneck blocks per stage (ResNet-50: ``(3, 4, 6, 3)``).
        num_classes: outputs of the classifier.
    """

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_channels = 64
        for index, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
            layers = []
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(Bottleneck(in_channels, width, stride))
                in_channels = width * _EXPANSION
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(N, num_classes)`` for images ``(N, 3, H, W)``."""
        out = torch.flatten(self.pool(self.stages(self.stem(x))), 1)
        logits: torch.Tensor = self.fc(out)
        return logits


def resnet50(num_classes: int = 1000) -> ImageNetResNet:
    """A freshly initialised ResNet-50 (about 25.6M parameters with 1000 classes)."""
    return ImageNetResNet((3, 4, 6, 3), num_classes)
