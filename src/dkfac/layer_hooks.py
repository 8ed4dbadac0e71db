"""The forward hooks dkfac puts on its layers: present only while they have work to do.

A module with a forward hook takes ``nn.Module``'s slower call path on every call, so the
capture attaches its layer hooks for factor windows only (docs/benchmarks.md, "Layer hooks
only in factor windows"), and a compiled model keeps them (adding or removing a hook would
recompile its graph).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

#: A layer hook: ``hook(index, module, inputs, output)``, the index of the layer in the list.
IndexedHook = Callable[[int, nn.Module, tuple[Any, ...], Any], Any]


class LayerHooks:
    """One forward hook per layer, registered while attached.

    Args:
        modules: the layers' modules, in the layers' order.
        hook: what each module's hook calls, with the layer's index first.
        first: register each hook first among its module's forward hooks (re-attached, it
            is first again, as when it was registered first).
    """

    def __init__(self, modules: Sequence[nn.Module], hook: IndexedHook, first: bool) -> None:
        self._modules = list(modules)
        self._hook = hook
        self._first = first
        self._handles: list[RemovableHandle] = []

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> None:
        """Register every layer's hook, unless they are registered."""
        if self._handles:
            return
        self._handles = [
            module.register_forward_hook(functools.partial(self._hook, index), prepend=self._first)
            for index, module in enumerate(self._modules)
        ]

    def detach(self) -> None:
        """Remove every layer's hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def warn_about_earlier_hooks(
    modules: Sequence[tuple[str, nn.Module]], owner: type, stacklevel: int
) -> None:
    """Name the layers whose forward hooks run before dkfac's on the identity-function path.

    Such a hook sees the layer's raw output, not the tensor whose gradient feeds ``G`` while
    compiling: a gradient that reaches the layer only through an output it keeps (an auxiliary
    loss on a feature) is left out of ``G``. Hooks bound to an ``owner`` (another
    preconditioner's capture) are not counted: theirs chain correctly.

    Args:
        modules: the captured layers' names and modules.
        owner: the class whose bound methods are dkfac's own hooks.
        stacklevel: passed to :func:`warnings.warn`.
    """
    hooked = [
        name
        for name, module in modules
        if any(
            not isinstance(getattr(getattr(hook, "func", None), "__self__", None), owner)
            for hook in module._forward_hooks.values()
        )
    ]
    if hooked:
        warnings.warn(
            f"torch {torch.__version__} < 2.13 under torch.compile: layers {hooked} have "
            "forward hooks registered before the preconditioner; an output such a hook "
            "keeps is not the one K-FAC's G statistic watches, so a gradient through it "
            "alone is left out of G. Register those hooks after building the "
            "preconditioner, or use torch >= 2.13.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
