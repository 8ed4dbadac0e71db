"""Which curvature block a module gets: the user's, a registered one, a built-in one, or none."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType

from torch import nn

from dkfac.curvature.blocks import (
    KroneckerBlock,
    LinearBlock,
    TransposedLinearBlock,
    is_transposed_linear,
)
from dkfac.curvature.conv_blocks import Conv1dBlock, Conv2dBlock
from dkfac.curvature.embedding import EmbeddingBlock

#: A user's block for a module type: called with the module, returns its block.
BlockFactory = Callable[[nn.Module], KroneckerBlock]


#: The class attribute holding a type's registration. The registration lives on the type
#: itself (set by :func:`register_block`), not in a table of dkfac's: no module-level state,
#: and it goes away with the class.
REGISTERED_FACTORY = "__dkfac_block_factory__"


class BlockRegistration:
    """What :func:`register_block` returns: ``remove()`` undoes the registration.

    Also a context manager: ``with dkfac.register_block(T, f): ...`` registers for the block.

    Attributes:
        module_type: the registered type.
        factory: its factory.
    """

    def __init__(self, module_type: type[nn.Module], factory: BlockFactory) -> None:
        self.module_type = module_type
        self.factory = factory

    def remove(self) -> None:
        """Remove this registration (nothing to do if it was already removed)."""
        if vars(self.module_type).get(REGISTERED_FACTORY) is self:  # not a later one's
            delattr(self.module_type, REGISTERED_FACTORY)

    def __enter__(self) -> BlockRegistration:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"BlockRegistration({self.module_type.__qualname__}, {self.factory!r})"


def register_block(module_type: type[nn.Module], factory: BlockFactory) -> BlockRegistration:
    """Give every ``module_type`` module (and its subclasses') the block ``factory(module)``.

    For every preconditioner built afterwards, in this process: a preconditioner's own
    ``blocks=`` mapping comes first, then registered types (the nearest along the module's
    class hierarchy), then the built-in blocks; so a registered base class (``nn.Module``)
    takes even ``nn.Linear`` off its built-in block. Register where the layer's class is defined (at
    import), so that every worker process registers it too.

    Args:
        module_type: a subclass of ``torch.nn.Module``.
        factory: called with the module, returns its ``dkfac.curvature.KroneckerBlock``
            (a block class such as ``LinearBlock`` is such a callable).

    Returns:
        A handle: ``remove()`` undoes the registration (or use it as a context manager).

    Raises:
        ValueError: ``module_type`` is not a module type, ``factory`` is not callable, or the
            type already has a registration (remove it first: nothing is replaced silently).
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(
            f"module_type={module_type!r} is not allowed: expected a subclass of torch.nn.Module"
        )
    if not callable(factory):
        raise ValueError(
            f"factory={factory!r} is not allowed: expected a callable factory(module) returning "
            "a dkfac.curvature.KroneckerBlock"
        )
    existing = vars(module_type).get(REGISTERED_FACTORY)
    if existing is not None:
        raise ValueError(
            f"{module_type.__qualname__} already has the block factory {existing.factory!r}: "
            "call remove() on the handle register_block returned for it first"
        )
    registration = BlockRegistration(module_type, factory)
    setattr(module_type, REGISTERED_FACTORY, registration)
    return registration


def _factory(
    module: nn.Module, custom: Mapping[type[nn.Module], BlockFactory] | None
) -> tuple[type, BlockFactory] | None:
    """The user's factory for ``module`` (``blocks=``, then registered) and the type it is for."""
    hierarchy = type(module).__mro__
    for cls in hierarchy if custom else ():
        factory = custom.get(cls)  # type: ignore[union-attr]  # custom is set here
        if factory is not None:
            return cls, factory
    for cls in hierarchy:
        registered: BlockRegistration | None = vars(cls).get(REGISTERED_FACTORY)
        if registered is not None:
            return cls, registered.factory
    return None


def asked_for(module: nn.Module, custom: Mapping[type[nn.Module], BlockFactory] | None) -> bool:
    """Whether the user named a block for ``module``'s type or a base of it.

    Through ``custom`` (``blocks=``) or :func:`register_block`.
    """
    return _factory(module, custom) is not None


def make_block(
    module: nn.Module, custom: Mapping[type[nn.Module], BlockFactory] | None = None
) -> KroneckerBlock | None:
    """The block for ``module``, ``None`` when its type is not supported.

    Args:
        module: the module.
        custom: blocks for more module types (``KFACPreconditioner(blocks=...)``), looked up
            along the module's class hierarchy before the registered ones
            (:func:`register_block`), which come before the built-in ones.

    Raises:
        UnsupportedLayerError: the type is supported but this configuration is not.
        TypeError: a user's factory returned something that is not a ``KroneckerBlock``.
    """
    found = _factory(module, custom)
    if found is not None:
        cls, factory = found
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
