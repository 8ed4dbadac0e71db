"""Models as the dry run sees them: each preconditioned layer's two factor sides, no weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from dkfac.curvature.block_types import BlockFactory, make_block


@dataclass(frozen=True)
class LayerShape:
    """One preconditioned layer: its name and the sides of its two Kronecker factors."""

    name: str
    a_dim: int
    g_dim: int

    @property
    def dims(self) -> tuple[int, int]:
        """``(d_A, d_G)``."""
        return self.a_dim, self.g_dim


def conv2d_shape(
    name: str,
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    *,
    groups: int = 1,
    bias: bool = False,
) -> LayerShape:
    """A Conv2d: ``d_A = in_channels/groups · kh · kw`` (+1 with a bias), ``d_G = out``."""
    a_dim = in_channels // groups * kernel_size * kernel_size + (1 if bias else 0)
    return LayerShape(name, a_dim, out_channels)


def linear_shape(
    name: str, in_features: int, out_features: int, *, bias: bool = True
) -> LayerShape:
    """A Linear layer: ``d_A = in_features`` (+1 with a bias), ``d_G = out_features``."""
    return LayerShape(name, in_features + (1 if bias else 0), out_features)


def resnet50_layer_shapes(num_classes: int = 1000) -> list[LayerShape]:
    """ImageNet ResNet-50 (torchvision's layout and names): 53 Conv2d and the final Linear.

    Convolutions have no bias; the bottleneck's 3x3 convolution is ``conv2`` and the
    projection shortcut ``downsample.0`` comes after ``conv3`` (registration and forward
    order). Weights and the classifier bias: 25,503,912 parameters (torchvision's 25,557,032
    minus the 53,120 BatchNorm parameters, which K-FAC does not precondition).
    """
    layers = [conv2d_shape("conv1", 3, 64, 7)]
    channels = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            layers += [
                conv2d_shape(f"{prefix}.conv1", channels, width, 1),
                conv2d_shape(f"{prefix}.conv2", width, width, 3),
                conv2d_shape(f"{prefix}.conv3", width, 4 * width, 1),
            ]
            if block == 0:
                layers.append(conv2d_shape(f"{prefix}.downsample.0", channels, 4 * width, 1))
            channels = 4 * width
    layers.append(linear_shape("fc", channels, num_classes))
    return layers


def layer_shapes_of(
    model: nn.Module, blocks: Mapping[type[nn.Module], BlockFactory] | None = None
) -> list[LayerShape]:
    """Shapes of the layers K-FAC supports in ``model``, in registration order.

    Uses the preconditioner's own block rule (:func:`dkfac.curvature.block_types.make_block`,
    with the preconditioner's ``blocks=``); ``skip_layers`` and frozen parameters are not
    considered. A side held as its diagonal stays a
    :class:`~dkfac.curvature.factor_side.DiagonalSide`.
    """
    shapes = []
    for name, module in model.named_modules():
        if not list(module.parameters(recurse=False)):
            continue
        block = make_block(module, blocks)
        if block is not None:
            shapes.append(LayerShape(name or type(module).__name__, block.a_dim, block.g_dim))
    return shapes
