"""Gauss-Newton products ``vᵢᵀCvⱼ`` of a model on one batch, through forward-mode AD.

``C = Jᵀ H J``: ``J`` is the Jacobian of the model's outputs in the parameters, ``H`` the Hessian
of the loss in the outputs. For a vector ``v``, ``Jv`` is one Jacobian-vector product through
the model (``torch.func.jvp``) and ``H(Jv)`` one through the gradient of the loss in the
outputs, so ``vᵢᵀCvⱼ = (Jvᵢ)ᵀ H (Jvⱼ)`` without ever forming ``C``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp

from dkfac.adaptive.options import LossFunction


def _state(model: nn.Module, moved: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every parameter and buffer of ``model`` by name, ``moved`` ones replaced.

    Buffers are copies: a batch-norm layer in training mode updates its running statistics
    in place, and these forward passes must leave the model exactly as it was.
    """
    state = {name: p.detach() for name, p in model.named_parameters() if name not in moved}
    state.update({name: b.detach().clone() for name, b in model.named_buffers()})
    state.update(moved)
    return state


def _outputs(model: nn.Module, state: dict[str, Tensor], inputs: Sequence[Any]) -> Tensor:
    outputs = functional_call(model, state, tuple(inputs))
    if not isinstance(outputs, Tensor):
        raise ValueError(
            f"adaptive K-FAC needs a model that returns one tensor, not "
            f"{type(outputs).__name__}: wrap it so that loss_fn(model(*inputs), targets) "
            "takes a tensor"
        )
    return outputs


def gauss_newton_products(
    model: nn.Module,
    parameters: Mapping[str, Tensor],
    vectors: Sequence[Mapping[str, Tensor]],
    inputs: Sequence[Any],
    targets: Any,
    loss_fn: LossFunction,
) -> tuple[Tensor, Tensor]:
    """The loss at the current parameters and ``[vᵢᵀCvⱼ]`` for ``vectors`` (float64, ``k × k``).

    Args:
        model: the model (unwrapped), in the mode it trains in.
        parameters: the parameters the vectors move, by their name in
            ``model.named_parameters()``; every other parameter stays fixed.
        vectors: each a tensor per name of ``parameters``, shaped like it.
        inputs: the positional arguments of ``model``.
        targets: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(outputs, targets)``, a scalar.
    """
    names = list(parameters)
    primals = tuple(parameters[name].detach() for name in names)

    def outputs_of(*values: Tensor) -> Tensor:
        return _outputs(model, _state(model, dict(zip(names, values, strict=True))), inputs)

    def loss_gradient(outputs: Tensor) -> Tensor:
        return grad(lambda o: loss_fn(o, targets))(outputs)  # type: ignore[no-any-return]

    outputs: Tensor | None = None
    directional: list[Tensor] = []
    for vector in vectors:
        tangents = tuple(vector[name].to(primals[i].dtype) for i, name in enumerate(names))
        result = jvp(outputs_of, primals, tangents)
        outputs, along = result[0], result[1]
        directional.append(along)
    if outputs is None:
        outputs = outputs_of(*primals)
    curved = [jvp(loss_gradient, (outputs,), (along,))[1] for along in directional]
    k = len(vectors)
    products = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(i, k):
            value = 0.5 * (
                (directional[i].double() * curved[j].double()).sum()
                + (directional[j].double() * curved[i].double()).sum()
            )
            products[i, j] = products[j, i] = value
    loss = loss_fn(outputs, targets).detach().double().cpu()
    return loss, products


def loss_at(
    model: nn.Module,
    parameters: Mapping[str, Tensor],
    inputs: Sequence[Any],
    targets: Any,
    loss_fn: LossFunction,
) -> float:
    """The loss with ``parameters`` in place of the model's own, the model left unchanged."""
    with torch.no_grad():
        outputs = _outputs(model, _state(model, parameters), inputs)
        return float(loss_fn(outputs, targets))
