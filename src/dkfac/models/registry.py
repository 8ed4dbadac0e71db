"""Build a reference model by name for a dataset's input shape, classes and kind."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from torch import nn

from dkfac.models.resnet import CifarResNet
from dkfac.models.small import MLP, SmallCNN
from dkfac.models.transformer import TransformerClassifier, TransformerLM

logger = logging.getLogger(__name__)

__all__ = ["MODEL_KINDS", "MODEL_NAMES", "DataInfo", "build_model"]

MODEL_NAMES: tuple[str, ...] = (
    "mlp",
    "cnn",
    "resnet20",
    "resnet32",
    "resnet56",
    "transformer",
    "lm",
)
"""Names accepted by :func:`build_model`."""

MODEL_KINDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "mlp": ("image", "vector"),
        "cnn": ("image",),
        "resnet20": ("image",),
        "resnet32": ("image",),
        "resnet56": ("image",),
        "transformer": ("tokens",),
        "lm": ("text",),
    }
)
"""Input kinds (see ``dkfac.data.registry.DATASET_KINDS``) each model accepts."""

_RESNET_DEPTHS: Mapping[str, int] = MappingProxyType(
    {"resnet20": 20, "resnet32": 32, "resnet56": 56}
)
_OPTIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "mlp": frozenset({"hidden"}),
        "cnn": frozenset({"width", "hidden"}),
        "resnet20": frozenset(),
        "resnet32": frozenset(),
        "resnet56": frozenset(),
        "transformer": frozenset({"d_model", "heads", "layers", "seq_len", "dropout"}),
        "lm": frozenset({"d_model", "heads", "layers", "seq_len", "dropout"}),
    }
)


class DataInfo(Protocol):
    """What :func:`build_model` reads from a dataset (``dkfac.data.registry.DatasetSpec`` fits)."""

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input without the batch dimension."""
        ...

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        ...

    @property
    def kind(self) -> str:
        """``"image"``, ``"vector"``, ``"tokens"`` or ``"text"``."""
        ...

    @property
    def vocab_size(self) -> int | None:
        """Number of token ids for ``"tokens"`` data, else ``None``."""
        ...


def build_model(
    name: str,
    data: DataInfo | None = None,
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    kind: str | None = None,
    vocab_size: int | None = None,
    **options: Any,
) -> nn.Module:
    """Build the model registered under ``name`` for the given data.

    The data is described either by ``data`` (e.g. a ``DatasetSpec``) or by the keyword
    arguments ``input_shape``, ``num_classes``, ``kind`` (default ``"image"``) and, for
    token data, ``vocab_size``; keywords given alongside ``data`` override its fields.

    Models and their options:

    * ``mlp`` (image or vector data): ``MLP`` on the flattened input; ``hidden``
      (``(128, 64)``) are the hidden widths.
    * ``cnn`` (square images with an even side): ``SmallCNN`` with ``in_channels`` and
      ``image_size`` taken from ``input_shape``; ``width`` (16), ``hidden`` (64).
    * ``resnet20``, ``resnet32``, ``resnet56`` (images): ``CifarResNet`` with
      ``in_channels`` from ``input_shape``.
    * ``transformer`` (tokens): ``TransformerClassifier`` with ``seq_len`` from
      ``input_shape`` and ``vocab_size`` from the data; ``d_model`` (64), ``heads`` (4),
      ``layers`` (2), ``seq_len``, ``dropout`` (0.0).
    * ``lm`` (text): ``TransformerLM``, a causal character or token language model, with
      the same options and defaults as ``transformer``.

    Args:
        name: One of :data:`MODEL_NAMES`.
        data: Description of the dataset, or ``None`` to use the keywords only.
        input_shape: Shape of one input without the batch dimension.
        num_classes: Number of output classes.
        kind: ``"image"``, ``"vector"``, ``"tokens"`` or ``"text"``.
        vocab_size: Number of token ids (token data only).
        **options: Model-specific options listed above.

    Returns:
        The freshly initialized model.

    Raises:
        ValueError: If ``name`` is unknown, the model does not fit the data (kind or
            shape), an option is not accepted by the model, or a required description
            (``input_shape``, ``num_classes``, ``vocab_size``) is missing.

    """
    if name not in MODEL_NAMES:
        raise ValueError(f"model={name!r} is not allowed: expected one of {', '.join(MODEL_NAMES)}")
    if data is not None:
        input_shape = data.input_shape if input_shape is None else input_shape
        num_classes = data.num_classes if num_classes is None else num_classes
        kind = data.kind if kind is None else kind
        vocab_size = data.vocab_size if vocab_size is None else vocab_size
    kind = "image" if kind is None else kind
    if input_shape is None or num_classes is None:
        raise ValueError(f"build_model({name!r}) needs input_shape and num_classes (or data=)")
    shape = tuple(int(d) for d in input_shape)
    if kind not in MODEL_KINDS[name]:
        raise ValueError(
            f"model {name!r} does not fit dataset kind {kind!r} (input shape {shape}): "
            f"{name!r} accepts {' or '.join(MODEL_KINDS[name])} data"
        )
    unknown = sorted(set(options) - _OPTIONS[name])
    if unknown:
        accepted = ", ".join(sorted(_OPTIONS[name])) or "none"
        raise ValueError(
            f"option(s) {', '.join(unknown)} not accepted by model {name!r} (accepted: {accepted})"
        )

    model: nn.Module
    if name == "mlp":
        hidden = tuple(options.get("hidden", (128, 64)))
        model = MLP(math.prod(shape), hidden, num_classes)
    elif name == "cnn":
        channels, side = _square_image(name, shape, kind)
        if side % 2 != 0:
            raise ValueError(
                f"model 'cnn' does not fit dataset images of shape {shape}: SmallCNN needs an "
                "even image side"
            )
        model = SmallCNN(
            in_channels=channels,
            num_classes=num_classes,
            width=int(options.get("width", 16)),
            hidden=int(options.get("hidden", 64)),
            image_size=side,
        )
    elif name in _RESNET_DEPTHS:
        if len(shape) != 3:
            raise ValueError(
                f"model {name!r} does not fit dataset inputs of shape {shape}: expected (C, H, W)"
            )
        model = CifarResNet(_RESNET_DEPTHS[name], num_classes, in_channels=shape[0])
    else:
        if vocab_size is None:
            raise ValueError(
                f"model {name!r} needs the vocabulary size of the token data: pass "
                "vocab_size= or the DatasetSpec as data="
            )
        if len(shape) != 1:
            raise ValueError(
                f"model {name!r} does not fit dataset inputs of shape {shape}: expected "
                "(seq_len,) token ids"
            )
        seq_len = int(options.pop("seq_len", shape[0]))
        if seq_len < shape[0]:
            raise ValueError(
                f"seq_len={seq_len} is shorter than the dataset's sequences ({shape[0]} tokens)"
            )
        if name == "lm":
            model = TransformerLM(vocab_size, seq_len=seq_len, **options)
        else:
            model = TransformerClassifier(vocab_size, num_classes, seq_len=seq_len, **options)
    logger.debug("Built model %r for %s data of shape %s", name, kind, shape)
    return model


def _square_image(name: str, shape: tuple[int, ...], kind: str) -> tuple[int, int]:
    """``(channels, side)`` of ``(C, S, S)`` images, or a ValueError naming model and data."""
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(
            f"model {name!r} does not fit dataset {kind} inputs of shape {shape}: expected "
            "square images (C, S, S)"
        )
    return shape[0], shape[1]
