"""Which curvature block a module gets: the user's, a built-in one, or none."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from dkfac.curvature.blocks import (
    Conv1dBlock,
    Conv2dBlock,
    KroneckerBlock,
    LinearBlock,
    TransposedLinearBlock,
    is_transposed_linear,
)
from dkfac.curvature.embedding import EmbeddingBlock

#: A user's block for a module type: called with the module, returns its block.
BlockFactory = Callable[[nn.Module], KroneckerBlock]


def asked_for(module: nn.Module, custom: Mapping[type[nn.Module], BlockFactory] | None) -> bool:
    """Whether ``custom`` (``blocks=``) names a block for ``module``'s type or a base of it."""
    if not custom:
        return False
    return any(cls in custom for cls in type(module).__mro__)


def make_block(
    module: nn.Module, custom: Mapping[type[nn.Module], BlockFactory] | None = None
) -> KroneckerBlock | None:
    """The block for ``module``, ``None`` when its type is not supported.

    Args:
        module: the module.
        custom: blocks for more module types (``KFACPreconditioner(blocks=...)``), looked up
            along the module's class hierarchy before the built-in ones.

    Raises:
        UnsupportedLayerError: the type is supported but this configuration is not.
        TypeError: a custom factory returned something that is not a ``KroneckerBlock``.
    """
    for cls in type(module).__mro__ if custom else ():
        factory = custom.get(cls)  # type: ignore[union-attr]  # custom is set here
        if factory is not None:
            block = factory(module)
            if not isinstance(block, KroneckerBlock):
                raise TypeError(
                    f"the block factory for {cls.__name__} returned {type(block).__name__}, "
                    "not a dkfac.curvature.KroneckerBlock"
                )
            return block
    if isinstance(module, nn.Linear):
        return LinearBlock(module)
    if isinstance(module, nn.Conv2d):
        return Conv2dBlock(module)
    if isinstance(module, nn.Conv1d):
        return Conv1dBlock(module)
    if is_transposed_linear(module):
        return TransposedLinearBlock(module)
    # A subclass with its own forward() looks up something other than its input (BART's
    # learned positions): not an embedding of its input, so not supported by default.
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return EmbeddingBlock(module)
    return None
