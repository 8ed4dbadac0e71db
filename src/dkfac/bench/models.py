"""The models ``dkfac bench`` times, their synthetic batches and their loss.

``resnet20`` and ``resnet32``: the CIFAR ResNets on 3x32x32 images. ``mlp6``: a 6-layer MLP
with 1024-wide layers on 1024-feature vectors (large factors, small compute: the
communication-bound case). ``transformer``: a causal Transformer language model
(:class:`dkfac.models.TransformerLM`, d_model 256, 4 blocks, MLP 1024, 64 tokens of a
256-token vocabulary) whose K-FAC factors are 257x257 for every attention projection and the
head and 1025x1025 / 1024x1024 for the MLPs, trained on next-token prediction.

Image and vector models get random normal inputs and random class labels; the language model
gets random token ids and, as targets, the same sequence shifted by one token.
:func:`batch_loss` is the cross-entropy of either (per token for the language model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.models import MLP, TransformerLM, resnet20, resnet32

NUM_CLASSES = 10

#: Width of the input and of every hidden layer of ``mlp6``.
MLP6_WIDTH = 1024
#: Hidden layers of ``mlp6`` (six ``nn.Linear`` in all, counting the classifier).
MLP6_HIDDEN_LAYERS = 5

#: Sizes of ``transformer``: tokens per sequence, vocabulary, width, blocks, heads, MLP width.
LM_SEQ_LEN = 64
LM_VOCAB = 256
LM_D_MODEL = 256
LM_LAYERS = 4
LM_HEADS = 4
LM_MLP_RATIO = 4


def mlp6(num_classes: int = NUM_CLASSES) -> nn.Module:
    """A 6-layer MLP with wide layers: 1024 -> 1024 (x5) -> ``num_classes``, ReLU between.

    Large K-FAC factors (1025x1025 and 1024x1024 per layer) for little forward and backward
    compute: the communication-bound case of the benchmark.

    Args:
        num_classes: Number of output classes.

    Returns:
        The model, whose inputs are vectors of :data:`MLP6_WIDTH` features.

    """
    return MLP(MLP6_WIDTH, [MLP6_WIDTH] * MLP6_HIDDEN_LAYERS, num_classes=num_classes)


def transformer_lm(num_classes: int | None = None) -> nn.Module:
    """The benchmark's causal language model (its sizes are the ``LM_*`` constants).

    Args:
        num_classes: Ignored: the outputs are the :data:`LM_VOCAB` next-token logits. Taken so
            that every model of :data:`MODELS` is built the same way.

    Returns:
        A :class:`~dkfac.models.TransformerLM` taking ``(N, LM_SEQ_LEN)`` token ids and
        returning ``(N, LM_SEQ_LEN, LM_VOCAB)`` logits.

    """
    del num_classes  # the vocabulary is the output
    return TransformerLM(
        LM_VOCAB,
        d_model=LM_D_MODEL,
        heads=LM_HEADS,
        layers=LM_LAYERS,
        seq_len=LM_SEQ_LEN,
        mlp_ratio=LM_MLP_RATIO,
    )


MODELS: Mapping[str, Callable[..., nn.Module]] = MappingProxyType(
    {
        "resnet20": resnet20,
        "resnet32": resnet32,
        "mlp6": mlp6,
        "transformer": transformer_lm,
    }
)
MODEL_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "resnet20": "ResNet-20",
        "resnet32": "ResNet-32",
        "mlp6": "MLP-6 (1024 wide)",
        "transformer": "Transformer LM (4x256)",
    }
)
#: Shape of one synthetic input of each model, without the batch dimension.
INPUT_SHAPES: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {
        "resnet20": (3, 32, 32),
        "resnet32": (3, 32, 32),
        "mlp6": (MLP6_WIDTH,),
        "transformer": (LM_SEQ_LEN,),
    }
)
#: Vocabulary of the models whose inputs are token ids (the others take real vectors).
TOKEN_VOCABULARIES: Mapping[str, int] = MappingProxyType({"transformer": LM_VOCAB})


def make_batch(
    batch_size: int, seed: int, shape: Sequence[int], *, vocab: int | None = None
) -> tuple[Tensor, Tensor]:
    """One random input batch and its targets, drawn from ``seed``.

    Args:
        batch_size: Number of samples.
        seed: Seed of the generator the inputs and then the targets are drawn from.
        shape: Shape of one input without the batch dimension (see :data:`INPUT_SHAPES`).
        vocab: For a language model (see :data:`TOKEN_VOCABULARIES`): the number of token ids.

    Returns:
        Without ``vocab``: normal inputs of shape ``(batch_size, *shape)`` and labels in
        ``[0, NUM_CLASSES)``. With it: token ids of that shape and, as targets, the next token
        of every position (one sequence a token longer is drawn, then split).

    """
    generator = torch.Generator().manual_seed(seed)
    if vocab is not None:
        *leading, length = shape
        tokens = torch.randint(0, vocab, (batch_size, *leading, length + 1), generator=generator)
        return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
    x = torch.randn(batch_size, *shape, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return x, y


def model_batch(model: str, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """:func:`make_batch` with ``model``'s input shape, and its vocabulary if it takes tokens."""
    return make_batch(batch_size, seed, INPUT_SHAPES[model], vocab=TOKEN_VOCABULARIES.get(model))


def batch_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of class logits ``(N, C)`` or per-token logits ``(N, T, V)``.

    Every position of a language model's output counts as one prediction, as in
    ``cross_entropy`` over the flattened ``(N * T, V)`` logits.
    """
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
