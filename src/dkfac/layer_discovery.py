"""Which modules of a model K-FAC preconditions, which it leaves alone and why."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from dkfac.config import KFACConfig
from dkfac.curvature.block_types import BlockFactory, asked_for, make_block
from dkfac.curvature.blocks import UnsupportedLayerError
from dkfac.curvature.factor_side import largest_dense_side
from dkfac.curvature.gram import GramPrecision
from dkfac.curvature.layer import LayerCurvature
from dkfac.layer_table import SkippedModule

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP/DataParallel and ``torch.compile`` wrappers.

    Names then carry no ``module.`` or ``_orig_mod.`` prefix, so a compiled model's layers,
    state dict and plan read as the eager model's; the hooks sit on the same submodules,
    which the compiled forward calls.

    Raises:
        ValueError: a sharded model (:func:`refuse_sharded_parameters`).
    """
    model = list(_wrapped(model))[-1]
    refuse_sharded_parameters(model)
    return model


def _wrapped(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each module it wraps (DDP, DataParallel, torch.compile), outer first."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while True:
        yield model
        compiled = getattr(model, "_orig_mod", None)
        if isinstance(model, wrappers):
            model = model.module
        elif _is_optimized_module(model) and isinstance(compiled, nn.Module):
            model = compiled
        else:
            return


def _is_optimized_module(model: nn.Module) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returns."""
    return type(model).__name__ == "OptimizedModule"


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs under ``torch.compile``.

    Wrapped by it (at any depth of DDP wrappers), or any of its modules compiled (in place,
    ``module.compile()``, or replaced by ``torch.compile(module)``). Not seen: a training
    function compiled around an eager model.
    """
    wrapped = list(_wrapped(model))
    if any(_is_optimized_module(module) for module in wrapped):
        return True
    return any(
        _is_optimized_module(module) or getattr(module, "_compiled_call_impl", None) is not None
        for module in wrapped[-1].modules()
    )


def refuse_sharded_parameters(model: nn.Module) -> None:
    """Refuse a model whose parameters are sharded (FSDP, FSDP2 ``fully_shard``, DTensor).

    K-FAC here preconditions each layer's whole weight gradient; a shard of it is not a
    Kronecker-factored block, so a sharded model is refused instead of failing later in an
    obscure tensor operation.

    Raises:
        ValueError: naming the sharded module and what is supported instead.
    """
    for name, module in model.named_modules():
        sharded = type(module).__name__ == "FullyShardedDataParallel" or any(
            base.__name__ == "FSDPModule" for base in type(module).__mro__
        )
        dtensor = any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False))
        if sharded or dtensor:
            what = "a DTensor parameter" if dtensor and not sharded else "FSDP"
            raise ValueError(
                f"model module {name or '<root>'!r} ({type(module).__name__}) is sharded "
                f"({what}): dkfac preconditions whole weight gradients and does not support "
                "FSDP, FSDP2 (fully_shard) or tensor parallelism; wrap the model in "
                "DistributedDataParallel (or use dkfac.DeAR) instead"
            )


def parameter_holders(model: nn.Module) -> dict[int, list[str]]:
    """Per parameter (by id), the names of the modules that register it directly."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return holders


def discover_layers(
    model: nn.Module,
    config: KFACConfig,
    blocks: Mapping[type[nn.Module], BlockFactory] | None = None,
) -> tuple[list[tuple[str, LayerCurvature]], list[SkippedModule]]:
    """Every module of ``model`` with parameters: a (path, curvature) pair, or a skipped entry.

    Args:
        model: the unwrapped model.
        config: what the layers are built with: ``skip_patterns`` (a module whose path or
            class name matches one is skipped), ``factor_dtype``, ``statistics_precision``,
            ``conv_patches``,
            ``precondition_precision`` and ``max_factor_dim`` (a layer with a larger factor
            side is skipped).
        blocks: the user's blocks for more module types (:func:`make_block`).

    Raises:
        ValueError: a layer of a supported type cannot be handled, or no layer can be
            preconditioned.
    """
    skip_patterns, factor_dtype = config.skip_patterns, config.factor_dtype
    max_factor_dim, precision = config.max_factor_dim, GramPrecision(config.statistics_precision)
    layers: list[tuple[str, LayerCurvature]] = []
    skipped: list[SkippedModule] = []
    holders = parameter_holders(model)
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        kind = type(module).__name__
        if any(p.search(name) or p.search(kind) for p in skip_patterns):
            skipped.append(SkippedModule(name, kind, "matches skip_layers"))
            continue
        try:
            block = make_block(module, blocks)
        except UnsupportedLayerError as error:
            if not any(p.requires_grad for p in params):  # frozen: nothing to precondition
                skipped.append(SkippedModule(name, kind, "parameters do not require grad"))
                continue
            if isinstance(module, nn.Embedding) and not asked_for(module, blocks):
                # Preconditioned by default, not on request: an embedding K-FAC cannot
                # handle exactly (sparse=True, ...) keeps its plain gradient.
                skipped.append(SkippedModule(name, kind, f"not preconditioned: {error}"))
                continue
            raise ValueError(f"layer {name!r} ({kind}): {error}") from None
        if block is None:
            skipped.append(SkippedModule(name, kind, "unsupported type"))
        elif (
            max_factor_dim is not None
            and (side := largest_dense_side((block.a_dim, block.g_dim))) > max_factor_dim
        ):  # a diagonal factor (an embedding's A) holds one value per row: never too large
            size = side * side * factor_dtype.itemsize
            reason = (
                f"factor side {side} > max_factor_dim={max_factor_dim} (one factor would "
                f"take {size / 2**30:.1f} GiB, its decomposition as much again)"
            )
            logger.warning(
                "K-FAC skips layer %r: %s; raise max_factor_dim to include it", name, reason
            )
            skipped.append(SkippedModule(name, kind, reason))
        elif not all(p.requires_grad for p in block.parameters()):
            skipped.append(SkippedModule(name, kind, "parameters do not require grad"))
        elif others := sorted({other for p in params for other in holders[id(p)] if other != name}):
            # A tied parameter's gradient sums its uses in every holder (GPT-2's LM head and
            # token embedding): this layer's factors describe only its own use.
            shared = ", ".join(repr(other) for other in others)
            skipped.append(SkippedModule(name, kind, f"parameter shared with {shared}"))
        else:
            block.precision, block.patches = precision, config.conv_patches
            layer = LayerCurvature(
                name or kind,
                block,
                factor_dtype,
                precondition_precision=config.precondition_precision,
            )
            layers.append((name, layer))
    if not layers:
        found = ", ".join(sorted({s.kind for s in skipped})) or "no module with parameters"
        raise ValueError(
            f"model={type(model).__name__} is not allowed: it has no "
            "layer K-FAC can precondition (nn.Linear, nn.Conv2d, nn.Conv1d, transformers' "
            f"Conv1D); found: {found}"
        )
    return layers, skipped


class LayerWatch:
    """Raises if a preconditioned layer was replaced or resized since it was discovered.

    Checked at every step, so it must cost little: walking each layer's module path through
    ``nn.Module.__getattr__`` took ~0.4 ms a step for ResNet-32's 34 layers on this
    project's CPU, a plain step's largest host cost after the products. The watch keeps
    every parent-child link on the layers' paths (each once: ``layer1`` is on many paths)
    and checks that each parent still holds its child (and that no instance attribute of
    that name shadows it, as ``getattr`` would see), then each layer's weight. Only if a
    link changed does it walk the paths as before: a container replaced by one holding the
    same layers is still the same model there, and its links are then taken afresh.

    Args:
        model: the unwrapped model.
        paths: each layer's module path, as discovered.
        layers: the preconditioned layers.
    """

    def __init__(
        self, model: nn.Module, paths: Sequence[str], layers: Sequence[LayerCurvature]
    ) -> None:
        self.paths = list(paths)
        self._model = model
        self._layers = list(layers)
        self._links = self._current_links()
        # What the unchanged model has at each layer: its module, weight and weight shape.
        self._weights = [
            (layer.block.module, layer.block.weight, torch.Size(layer.block.weight_shape))
            for layer in self._layers
        ]

    def _current_links(self) -> list[tuple[nn.Module, str, nn.Module]] | None:
        """``(parent, name, child)`` of every link on the paths; None if a path is not one."""
        links: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
        for path, layer in zip(self.paths, self._layers, strict=True):
            module = self._model
            for name in path.split(".") if path else ():
                child = module._modules.get(name)
                if child is None:
                    return None  # not a registered submodule's name: walked every step
                links[(id(module), name)] = (module, name, child)
                module = child
            if module is not layer.block.module:
                return None
        return list(links.values())

    def check(self) -> None:
        """Raise if a layer's module, its weight or the weight's shape changed.

        Raises:
            RuntimeError: the module at a layer's path, its weight or the weight's shape
                changed.
        """
        # A registered weight that no instance attribute shadows is what getattr returns,
        # read without nn.Module.__getattr__; in one pass over tuples made once (a step
        # checks every layer). Anything else: each layer checked as below, the first raises.
        if (
            self._links is not None
            and all(
                parent._modules.get(name) is child and name not in parent.__dict__
                for parent, name, child in self._links
            )
            and all(
                module._parameters.get("weight") is weight
                and "weight" not in module.__dict__
                and weight.shape == shape
                for module, weight, shape in self._weights
            )
        ):
            return
        for layer, path in zip(self._layers, self.paths, strict=True):
            try:
                current: nn.Module | None = self._model.get_submodule(path)
            except AttributeError:
                current = None
            _check_weight(layer, current)
        self._links = self._current_links()


def _check_weight(layer: LayerCurvature, current: nn.Module | None) -> None:
    """Raise unless ``current`` is ``layer``'s module, with its weight of its shape."""
    block = layer.block
    if (
        current is not block.module
        or getattr(current, "weight", None) is not block.weight
        or tuple(block.weight.shape) != block.weight_shape
    ):
        raise RuntimeError(
            f"the model changed after KFACPreconditioner was built: layer {layer.name!r} "
            "was replaced or resized. Build the preconditioner after the model is final "
            "(call pre.remove() and create a new one)"
        )
