"""Gauss-Newton products ``vᵢᵀCvⱼ`` of a model on one batch, through forward-mode AD.

``C = Jᵀ H J``: ``J`` is the Jacobian of the model's outputs in the parameters, ``H`` the Hessian
of the loss in the outputs. For a vector ``v``, ``Jv`` is one Jacobian-vector product through
the model (``torch.func.jvp``) and ``H(Jv)`` one through the gradient of the loss in the
outputs, so ``vᵢᵀCvⱼ = (Jvᵢ)ᵀ H (Jvⱼ)`` without ever forming ``C``.

Every forward pass here starts from the same random state (:func:`replayed_randomness`): with
dropout, the products and the losses before and after a step then see the same masks, and
the training run's own random stream is left where it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp

from dkfac.adaptive.options import LossFunction

#: Called before every forward pass (puts the random state back).
Replay = Callable[[], None]
#: Dtypes whose losses are too coarse to compare before and after a step (2^-8 near 1).
LOW_PRECISION = (torch.float16, torch.bfloat16)


@contextmanager
def replayed_randomness(device: torch.device) -> Iterator[Replay]:
    """A function that restores the random state of entry; restored again on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def replay() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    try:
        yield replay
    finally:
        replay()


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
    """The model's outputs with ``state``; 16-bit outputs in float32 (see LOW_PRECISION)."""
    outputs = functional_call(model, state, tuple(inputs))
    if not isinstance(outputs, Tensor):
        raise ValueError(
            f"adaptive K-FAC needs a model that returns one tensor, not "
            f"{type(outputs).__name__}: wrap it so that loss_fn(model(*inputs), targets) "
            "takes a tensor"
        )
    return outputs.float() if outputs.dtype in LOW_PRECISION else outputs


def gauss_newton_products(
    model: nn.Module,
    parameters: Mapping[str, Tensor],
    vectors: Sequence[Mapping[str, Tensor]],
    inputs: Sequence[Any],
    targets: Any,
    loss_fn: LossFunction,
    replay: Replay = lambda: None,
) -> tuple[Tensor, Tensor]:
    """The loss at the current parameters and ``[vᵢᵀCvⱼ]`` (float64, on the model's device).

    Args:
        model: the model (unwrapped), in the mode it trains in.
        parameters: the parameters the vectors move, by their name in
            ``model.named_parameters()``; every other parameter stays fixed.
        vectors: each a tensor per name of ``parameters``, shaped like it.
        inputs: the positional arguments of ``model``.
        targets: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(outputs, targets)``, a scalar.
        replay: called before each forward pass.

    Returns:
        The loss (a float64 scalar) and the ``k × k`` products, without a host read.
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
        replay()
        result = jvp(outputs_of, primals, tangents)
        outputs, along = result[0], result[1]
        directional.append(along.to(outputs.dtype))
    if outputs is None:
        replay()
        outputs = outputs_of(*primals)
    curved = [jvp(loss_gradient, (outputs,), (along,))[1] for along in directional]
    k = len(vectors)
    rows = [
        torch.stack(
            [
                0.5 * ((directional[i] * curved[j]).sum() + (directional[j] * curved[i]).sum())
                for j in range(k)
            ]
        )
        for i in range(k)
    ]
    products = torch.stack(rows).double() if rows else torch.zeros(0, 0, dtype=torch.float64)
    loss = loss_fn(outputs, targets).detach().double()
    return loss, products


def loss_at(
    model: nn.Module,
    parameters: Mapping[str, Tensor],
    inputs: Sequence[Any],
    targets: Any,
    loss_fn: LossFunction,
    replay: Replay = lambda: None,
) -> Tensor:
    """The loss (a float64 scalar tensor) with ``parameters`` in place of the model's own.

    The model is left unchanged; ``replay`` is called before the forward pass.
    """
    with torch.no_grad():
        replay()
        outputs = _outputs(model, _state(model, parameters), inputs)
        return loss_fn(outputs, targets).detach().double()
