"""A deep autoencoder, the shape of Martens and Grosse's (2015) K-FAC benchmark."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DeepAutoencoder", "sparse_init_"]

#: The initialisations :class:`DeepAutoencoder` accepts.
INITS: tuple[str, ...] = ("sparse", "default")


class DeepAutoencoder(nn.Module):
    """Encoder ``in-1000-500-250-code``, decoder back; logistic units, a linear code.

    As in Hinton and Salakhutdinov (2006) and Martens and Grosse (2015, section 13): every
    hidden layer is an ``nn.Linear`` followed by a sigmoid, the code layer is linear, and the
    output is the logits of each input value (train it with
    ``F.binary_cross_entropy_with_logits`` against inputs in ``[0, 1]``). Narrow deep sigmoid
    networks like this one are where first-order methods are slow.

    The benchmark's initialisation is Martens' (2010) sparse one (:func:`sparse_init_`), and so
    is this model's by default. ``init="default"`` keeps PyTorch's (uniform within
    ``±1/√fan_in``): through eight such layers and six sigmoids the output gradient shrinks
    about 10⁵-fold on its way to the first layer (its ``G`` factor, the gradient's second
    moment: largest eigenvalue 5·10⁻¹⁴ against 2·10⁻³ at the output, on the digits), and
    every optimiser whose step does
    not rescale each parameter (SGD, K-FAC with any damping tried) first sits on the plateau
    of predicting the mean image.

    Args:
        in_features: width of the input (64 for scikit-learn's 8x8 digits).
        hidden: widths of the encoder's hidden layers; the decoder mirrors them.
        code: width of the code layer.
        init: ``"sparse"`` (:func:`sparse_init_`, drawn from torch's global generator) or
            ``"default"`` (PyTorch's own).

    Raises:
        ValueError: a width below 1, or an unknown ``init``.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden: Sequence[int] = (1000, 500, 250),
        code: int = 30,
        init: str = "sparse",
    ) -> None:
        super().__init__()
        widths = [in_features, *hidden, code]
        if min(widths) < 1:
            raise ValueError(f"widths must be positive, got {widths}")
        if init not in INITS:
            raise ValueError(f"init={init!r} is not allowed: expected one of {', '.join(INITS)}")
        self.encoder = _logistic_stack(widths)
        self.decoder = _logistic_stack(widths[::-1])
        if init == "sparse":
            sparse_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the reconstruction of ``x`` (flattened to ``(N, in_features)``)."""
        return self.decoder(self.encoder(x.flatten(1)))  # type: ignore[no-any-return]


def sparse_init_(
    module: nn.Module, nonzero: int = 15, generator: torch.Generator | None = None
) -> None:
    """Martens' (2010) sparse initialisation of every ``nn.Linear`` in ``module``, in place.

    Each output unit gets exactly ``nonzero`` incoming weights (all of them when the layer has
    fewer inputs), at inputs chosen uniformly without replacement and drawn from ``N(0, 1)``;
    the other weights and the biases are zero. (The paper's words, a hard limit on the nonzero
    incoming weights; Martens' own code drew the inputs with replacement, so some of its units
    had fewer.) Units then start with large, diverse weights on a few inputs, so sigmoid layers
    neither saturate all at once nor pass on a vanishing gradient, whatever the layer's width.
    The draws are made on the CPU, then copied to each weight's device and dtype: the same seed
    gives the same weights on any device.

    Args:
        module: the module whose linear layers are initialised.
        nonzero: incoming weights per unit that are not zero (> 0).
        generator: a CPU random generator (``None``: torch's global CPU one).

    Raises:
        ValueError: ``nonzero`` is not a positive int, ``generator`` is not a CPU generator,
            or a lazy linear layer has no weight yet.
    """
    if isinstance(nonzero, bool) or not isinstance(nonzero, int) or nonzero < 1:
        raise ValueError(f"nonzero={nonzero!r}: expected a positive int")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(
            f"generator on {generator.device}: sparse_init_ draws on the CPU (the same weights "
            "on every device), pass a CPU torch.Generator"
        )
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear):
            continue
        weight = layer.weight
        if isinstance(weight, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"layer {name!r} is a lazy linear layer without its weight yet: run one forward "
                "pass before sparse_init_"
            )
        # The `nonzero` largest of uniform scores per row: a uniform choice of inputs.
        scores = torch.rand(weight.shape, generator=generator)
        chosen = scores.topk(min(nonzero, weight.shape[1]), dim=1).indices
        values = torch.randn(chosen.shape, generator=generator)
        with torch.no_grad():
            weight.zero_()
            weight.scatter_(1, chosen.to(weight.device), values.to(weight))
            if layer.bias is not None:
                layer.bias.zero_()


def _logistic_stack(widths: Sequence[int]) -> nn.Sequential:
    """``nn.Linear`` layers through ``widths``, a sigmoid after each but the last."""
    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if index < len(widths) - 2:
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)
