"""Equal-shaped layers preconditioned together: their inverses kept stacked between decompositions.

A step that decomposes nothing costs K-FAC two small matrix products per layer. On a GPU each
is a kernel the host launches and that occupies a fraction of the device (ResNet-50's 54
layers: 108 products of 1.6 ms together on an H200, docs/benchmarks.md); its 54 layers have
only 21 shapes. :class:`LayerStacks` preconditions the layers of one shape in one batched
product per matrix product: their inverses are stacked once after each decomposition
(:func:`~dkfac.curvature.inverse.stack_inverses`), and each layer's inverse becomes a view of
its stack, so holding the stack takes no memory beyond the inverses (building it copies
them once; each batched step stacks the group's gradients, a transient copy).

A batched product may add its terms in another order than one matrix at a time (on a GPU the
library may pick another kernel for another batch): the results agree to round-off, not to
the bit. Workers that precondition the same layer must therefore batch it with the same other
layers, or their replicas would drift apart by round-off: the caller gives each layer a
``domain`` (for a distributed strategy, the set of workers that hold the layer's inverse, the
same on each of them), and only layers of one domain are stacked together.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dkfac.curvature.inverse import (
    KroneckerInverse,
    owned_copy,
    stack_inverses,
    unstack_inverse,
)
from dkfac.curvature.layer import LayerCurvature

logger = logging.getLogger(__name__)


def stack_signature(layer: LayerCurvature, grad: Tensor) -> Hashable | None:
    """What layers must share to be preconditioned by one batched product (``None``: alone).

    The inverse's method, tensors (names, shapes, dtypes, device), the preconditioning
    precision and the gradient's shape and dtype; a layer without an inverse is left alone.
    """
    inverse = layer.inverse
    if inverse is None:
        return None
    return (
        inverse.method,
        layer.precondition_precision,
        inverse.layout(),
        tuple(grad.shape),
        grad.dtype,
    )


#: What a dead weak reference is compared as: nothing a layer can hold.
_DEAD = object()


@dataclass(frozen=True)
class _Grouping:
    """How one call's layers were preconditioned; it holds while they keep their inverses.

    ``groups``: positions in the call and their stacked inverse (``None``: one at a time).
    Layers, domains and inverses are compared by identity: a new inverse (a decomposition,
    a loaded state) or another placement's domains group the layers again; so does a
    gradient of another dtype (a model converted in place). A gradient's shape needs no
    check: it is its parameter's, and :class:`~dkfac.layer_discovery.LayerWatch` refuses a
    replaced or resized weight. The inverses are referenced weakly: a replaced one is freed
    when its layer drops it, not when the layers are next preconditioned.
    """

    layers: tuple[LayerCurvature, ...]
    domains: tuple[Hashable, ...]
    dtypes: tuple[torch.dtype, ...]
    inverses: tuple[weakref.ref[KroneckerInverse] | None, ...]
    groups: tuple[tuple[tuple[int, ...], KroneckerInverse | None], ...]

    def fits(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        domains: Sequence[Hashable],
    ) -> bool:
        """Whether a call with ``layers``, ``grads`` and ``domains`` is grouped as this one."""
        return (
            len(layers) == len(self.layers)
            and all(a is b for a, b in zip(layers, self.layers, strict=True))
            and all(a is b for a, b in zip(domains, self.domains, strict=True))
            and all(g.dtype is d for g, d in zip(grads, self.dtypes, strict=True))
            and all(
                # A dead reference is no match, whatever the layer holds now (even None).
                layer.inverse is None if ref is None else layer.inverse is (ref() or _DEAD)
                for layer, ref in zip(layers, self.inverses, strict=True)
            )
        )


@dataclass(frozen=True)
class _Stack:
    """A stacked inverse, its layers and the per-layer views of it that they hold."""

    stacked: KroneckerInverse
    layers: tuple[LayerCurvature, ...]
    views: tuple[KroneckerInverse, ...]

    def held(self) -> bool:
        """Whether some layer still holds the view this stack gave it."""
        return any(
            layer.inverse is view for layer, view in zip(self.layers, self.views, strict=True)
        )


class LayerStacks:
    """Preconditions layers of one shape and domain together (see the module docstring).

    A stack is built the first time its layers are preconditioned together after one of
    their inverses was replaced (a decomposition, a loaded state): one copy of their inverses
    per decomposition, after which each layer's ``inverse`` is a view of the stack. A step
    whose layers of one shape are a different set of already stacked layers (some had no
    gradient) preconditions them one at a time through their views instead of restacking:
    only a new inverse is worth a copy.

    Args:
        stack: ``False``: every layer alone, as :meth:`LayerCurvature.precondition`.
    """

    def __init__(self, stack: bool = True) -> None:
        self.stack = stack
        self._stacks: dict[tuple[str, ...], _Stack] = {}
        self._stack_of_layer: dict[str, tuple[str, ...]] = {}
        self._grouping: _Grouping | None = None  # the last call's (a plain step repeats it)

    def precondition(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
        domains: Sequence[Hashable],
    ) -> list[Tensor]:
        """``layers[i].precondition(grads[i], damping)`` for each ``i``, stacked where possible.

        Args:
            layers: the layers, each at most once.
            grads: their gradient matrices.
            damping: ``γ``.
            domains: one per layer: only layers of equal domains are stacked together.
        """
        if self._grouping is not None and not self._grouping.fits(layers, grads, domains):
            self._grouping = None  # its stacks go with the others, before new ones are made
        self._drop_unheld()
        if self._grouping is None:
            self._grouping = self._group(layers, grads, domains)
        grouping = self._grouping
        results: list[Tensor] = list(grads)
        for positions, stacked in grouping.groups:
            if stacked is None:
                for position in positions:
                    results[position] = layers[position].precondition(grads[position], damping)
                continue
            product = stacked.precondition(
                torch.stack([grads[p] for p in positions]),
                damping,
                layers[positions[0]].precondition_precision,
            )
            for position, row in zip(positions, product.unbind(0), strict=True):
                results[position] = row  # one unbind: no indexing call per layer
        return results

    def _group(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        domains: Sequence[Hashable],
    ) -> _Grouping:
        """Group the layers by domain and :func:`stack_signature`, stacking where it pays."""
        groups: dict[Hashable, list[int]] = {}
        for position, (layer, grad, domain) in enumerate(zip(layers, grads, domains, strict=True)):
            signature = stack_signature(layer, grad) if self.stack else None
            key = (domain, signature) if signature is not None else ("alone", position)
            groups.setdefault(key, []).append(position)
        stacked = [
            (tuple(positions), self._stack_for([layers[p] for p in positions]))
            if len(positions) > 1
            else (tuple(positions), None)
            for positions in groups.values()
        ]
        # After _stack_for, which gives stacked layers views as their inverses.
        inverses = tuple(
            None if layer.inverse is None else weakref.ref(layer.inverse) for layer in layers
        )
        dtypes = tuple(grad.dtype for grad in grads)
        return _Grouping(tuple(layers), tuple(domains), dtypes, inverses, tuple(stacked))

    def _stack_for(self, members: Sequence[LayerCurvature]) -> KroneckerInverse | None:
        """The stack of exactly ``members`` (built if one has a new inverse); else ``None``."""
        key = tuple(layer.name for layer in members)
        stack = self._stacks.get(key)
        if stack is not None and all(
            layer.inverse is view for layer, view in zip(members, stack.views, strict=True)
        ):
            return stack.stacked
        if all(self._is_stacked(layer) for layer in members):
            return None  # another set of stacked layers this step: one at a time, no copy
        self._release(set(key))
        inverses = [layer.inverse for layer in members]
        assert all(inverse is not None for inverse in inverses), "stack_signature checked"
        stacked = stack_inverses([inverse for inverse in inverses if inverse is not None])
        if members[0].precondition_precision == "bf16":
            stacked.bf16_tensors()  # rounded once, shared by the views
        views = tuple(unstack_inverse(stacked))
        for layer, view in zip(members, views, strict=True):
            layer.inverse = view
            self._stack_of_layer[layer.name] = key
        self._stacks[key] = _Stack(stacked, tuple(members), views)
        logger.debug("stacked the inverses of %d layers: %s", len(members), ", ".join(key))
        return stacked

    def _drop_unheld(self) -> None:
        """Forget the stacks none of whose layers still holds its view (all got new inverses).

        Their memory would otherwise live beside the new inverses until those are stacked,
        which never happens for layers that are not preconditioned together again.
        """
        self._stacks = {key: stack for key, stack in self._stacks.items() if stack.held()}

    def _is_stacked(self, layer: LayerCurvature) -> bool:
        """Whether ``layer``'s inverse is still the view a live stack gave it."""
        stack = self._stacks.get(self._stack_of_layer.get(layer.name, ()))
        if stack is None:
            return False
        return any(view is layer.inverse for view in stack.views)

    def _release(self, names: set[str]) -> None:
        """Drop the stacks that hold any of ``names``; their other layers get own copies.

        A layer still holding a view of a dropped stack would keep the whole stack's memory.
        """
        for key in [key for key in self._stacks if not names.isdisjoint(key)]:
            stack = self._stacks.pop(key)
            for layer, view in zip(stack.layers, stack.views, strict=True):
                self._stack_of_layer.pop(layer.name, None)
                if layer.name not in names and layer.inverse is view:
                    layer.inverse = owned_copy(view)
