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

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vmap

from dkfac.adaptive.options import LossFunction
from dkfac.curvature.statistics import kept_examples

logger = logging.getLogger(__name__)

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


def load_forward_mode() -> None:
    """Load what forward-mode AD needs on its first use, now: a Jacobian-vector product.

    The first ``torch.func.jvp`` of a process loads and scripts PyTorch's decompositions for
    forward mode (``torch._decomp.decompositions_for_jvp``: about 130 ms on one CPU thread);
    done when the preconditioner is built, the first adaptive step costs what every later one
    does.
    """
    jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))


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


class GaussNewtonModel(NamedTuple):
    """A batch's quadratic model in the span of some vectors (float64, on the model's device).

    Attributes:
        loss: ``h``, the loss at the current parameters.
        products: ``[vᵢᵀCvⱼ]``, ``k × k``.
        slopes: ``[∇hᵀvᵢ]``, ``k``.
    """

    loss: Tensor
    products: Tensor
    slopes: Tensor


def gauss_newton_products(
    model: nn.Module,
    parameters: Mapping[str, Tensor],
    vectors: Sequence[Mapping[str, Tensor]],
    inputs: Sequence[Any],
    targets: Any,
    loss_fn: LossFunction,
    replay: Replay = lambda: None,
    batched: bool = True,
) -> GaussNewtonModel:
    """The loss, ``[vᵢᵀCvⱼ]`` and ``[∇hᵀvᵢ]`` at the current parameters, without a host read.

    Args:
        model: the model (unwrapped), in the mode it trains in.
        parameters: the parameters the vectors move, by their name in
            ``model.named_parameters()``; every other parameter stays fixed.
        vectors: each a tensor per name of ``parameters``, shaped like it.
        inputs: the positional arguments of ``model``.
        targets: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(outputs, targets)``, a scalar.
        replay: called before each forward pass.
        batched: one forward-mode pass for all the vectors (``torch.func.vmap``); ``False``:
            one pass per vector (for models whose operations vmap cannot batch).

    Returns:
        The :class:`GaussNewtonModel` of the batch.
    """
    names = list(parameters)
    primals = tuple(parameters[name].detach() for name in names)

    def outputs_of(*values: Tensor) -> Tensor:
        return _outputs(model, _state(model, dict(zip(names, values, strict=True))), inputs)

    def loss_gradient(outputs: Tensor) -> Tensor:
        return grad(lambda o: loss_fn(o, targets))(outputs)  # type: ignore[no-any-return]

    tangents = [
        tuple(vector[name].to(primal.dtype) for name, primal in zip(names, primals, strict=True))
        for vector in vectors
    ]
    outputs, directional, slopes_at_outputs, curved = _forward_mode_passes(
        outputs_of, loss_gradient, primals, tangents, replay, batched
    )
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
    # ∇hᵀvᵢ = (∇ₒ loss)ᵀ(Jvᵢ): the batch's slopes along each vector, free from the passes above.
    slopes = (
        torch.stack([(slopes_at_outputs * along).sum(dtype=torch.float64) for along in directional])
        if slopes_at_outputs is not None
        else torch.zeros(0, dtype=torch.float64)
    )
    loss = loss_fn(outputs, targets).detach().double()
    return GaussNewtonModel(loss, products, slopes)


class _Passes(NamedTuple):
    """What the forward-mode passes give: outputs, ``Jvᵢ``, ``∇ₒ loss`` and ``H·Jvᵢ``."""

    outputs: Tensor
    directional: list[Tensor]
    gradient: Tensor | None  # None without vectors
    curved: list[Tensor]


def _forward_mode_passes(
    outputs_of: Callable[..., Tensor],
    loss_gradient: Callable[[Tensor], Tensor],
    primals: tuple[Tensor, ...],
    tangents: Sequence[tuple[Tensor, ...]],
    replay: Replay,
    batched: bool,
) -> _Passes:
    """The model's outputs, and per vector its Jacobian product and the loss's Hessian's on that.

    ``batched`` with several vectors: one forward-mode pass through the model for all of them
    (vmap over the tangents). On a small batch each operation's fixed cost dominates and one
    batched pass costs about half of two (the character LM's model on 4 sequences, one CPU
    thread: 13 ms against 24). The outputs do not depend on the tangents (``out_dims`` None);
    ``"same"`` randomness draws one dropout mask for every vector from the replayed state, as
    each pass does without ``batched``. No vectors: the outputs alone.
    """

    def through_model(*tangent: Tensor) -> tuple[Tensor, Tensor]:
        result = jvp(outputs_of, primals, tangent)
        return result[0], result[1].to(result[0].dtype)

    def through_loss(outputs: Tensor, along: Tensor) -> tuple[Tensor, Tensor]:
        result = jvp(loss_gradient, (outputs,), (along,))
        return result[0], result[1]

    if not tangents:
        replay()
        return _Passes(outputs_of(*primals), [], None, [])
    if batched and len(tangents) > 1:
        columns = tuple(torch.stack(column) for column in zip(*tangents, strict=True))
        unbatched_first: Any = (None, 0)  # torch's stub omits None inside the tuple
        replay()
        outputs, along = vmap(through_model, out_dims=unbatched_first, randomness="same")(*columns)
        gradient, curved = vmap(through_loss, in_dims=(None, 0), out_dims=unbatched_first)(
            outputs, along
        )
        return _Passes(outputs, list(along.unbind()), gradient, list(curved.unbind()))
    directional = []
    for tangent in tangents:
        replay()
        outputs, along = through_model(*tangent)
        directional.append(along)
    pairs = [through_loss(outputs, along) for along in directional]
    return _Passes(outputs, directional, pairs[-1][0], [curved for _, curved in pairs])


class BatchedPasses:
    """Batches the forward-mode passes over the vectors while the model allows it.

    A model with an operation that ``torch.func.vmap`` cannot batch (an autograd Function
    without a vmap rule, an in-place write into an input), or whose batched pass does not fit
    in memory, fails the batched pass; when a pass per vector then succeeds, every later step
    takes that (the same products up to rounding, slower). If it fails too, its error is the
    caller's and the next step tries the batched pass again.
    """

    def __init__(self) -> None:
        self.batched = True

    def __call__(
        self, products: Callable[[bool], GaussNewtonModel], vectors: int
    ) -> GaussNewtonModel:
        """``products(batched)``, batched while that works and there are several vectors.

        Args:
            products: :func:`gauss_newton_products` with every argument but ``batched``.
            vectors: how many vectors it takes.

        Returns:
            The :class:`GaussNewtonModel`.

        Raises:
            RuntimeError: (or what else ``products`` raises) from the pass per vector.
        """
        if not (self.batched and vectors > 1):
            return products(False)
        try:
            return products(True)
        except (RuntimeError, NotImplementedError) as error:  # OutOfMemoryError included
            failure = error
        model = products(False)
        self.batched = False
        logger.warning(
            "adaptive K-FAC: one forward-mode pass per vector from now on (slower), the batched "
            "pass failed: %s",
            failure,
        )
        return model


class ModelBatch(NamedTuple):
    """The examples adaptive K-FAC's quadratic model is built on.

    Attributes:
        inputs: the model's positional arguments.
        targets: the second argument of ``loss_fn``.
        part: whether these are fewer examples than the step's batch (the model then takes
            their own slopes, not the batch's gradient).
    """

    inputs: tuple[Any, ...]
    targets: Any
    part: bool


def model_batch(inputs: Any, targets: Any, fraction: float, min_targets: int = 1) -> ModelBatch:
    """The batch's first examples, along dim 0 of every batched input and of the targets.

    ``k = min(N, max(⌈fraction·N⌉, ⌈min_targets / t⌉))`` of them, ``t`` the target elements
    of one example (every example when ``t = 0``).

    Args:
        inputs: the model's positional arguments (a tuple as given, anything else as the only
            one).
        targets: the second argument of ``loss_fn``.
        fraction: ``model_fraction``, in (0, 1].
        min_targets: ``min_model_targets``: at least this many target elements are kept
            (``⌈min_targets / t⌉`` examples of ``t`` elements each), or the whole batch.

    Returns:
        The whole batch at ``fraction`` 1 or when ``k = N``, else its first ``k`` examples:
        ``N`` is dim 0 of the first tensor input with a dim; other tensors with dims and the
        targets must have it too, scalar tensors and non-tensor arguments (flags, sizes) pass
        unchanged.

    Raises:
        ValueError: (``fraction < 1``) no batched tensor input, a tensor inside a container
            (it would not be cut), a tensor or the targets without ``N`` along dim 0
            (sequence-first data), or targets that are not one tensor. A part of a batch is
            only well defined when every tensor carries the examples along dim 0, so anything
            else is refused rather than cut along another dimension.
    """
    arguments = inputs if isinstance(inputs, tuple) else (inputs,)
    if fraction >= 1.0:
        return ModelBatch(arguments, targets, False)
    nested = [type(value).__name__ for value in arguments if _holds_tensor(value)]
    if nested:
        raise ValueError(
            f"model_fraction < 1 cannot cut the tensors inside a model argument of type "
            f"{nested[0]}: pass them as positional tensors, or use model_fraction=1.0"
        )
    batched = [value for value in arguments if isinstance(value, Tensor) and value.dim() > 0]
    if not batched:
        raise ValueError(
            "model_fraction < 1 needs a batched tensor among the model's inputs (its "
            "examples along dim 0)"
        )
    if not isinstance(targets, Tensor):
        raise ValueError(
            f"model_fraction < 1 needs the targets as one tensor, not {type(targets).__name__}"
        )
    examples = batched[0].shape[0]
    shapes = [tuple(value.shape) for value in batched]
    if any(shape[0] != examples for shape in shapes) or targets.shape[:1] != (examples,):
        raise ValueError(
            f"model_fraction < 1 keeps the first examples along dim 0, but the model's "
            f"tensor inputs {shapes} and targets {tuple(targets.shape)} do not all have "
            f"{examples} there (sequence-first data: transpose it, or use 1.0)"
        )
    # Target elements per example: one for a class, the tokens of a sequence, the pixels of
    # an image to reconstruct (none: the examples carry no loss terms to count; all kept).
    per_example = math.prod(targets.shape[1:])
    enough = examples if per_example == 0 else math.ceil(min_targets / per_example)
    kept = min(examples, max(kept_examples(examples, fraction), enough))
    if kept == examples:
        return ModelBatch(arguments, targets, False)
    cut = tuple(
        value[:kept] if isinstance(value, Tensor) and value.dim() > 0 else value
        for value in arguments
    )
    return ModelBatch(cut, targets[:kept], True)


def _holds_tensor(value: Any) -> bool:
    """Whether a list, tuple or dict holds a tensor at any depth."""
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, Tensor) or _holds_tensor(item) for item in value)
    return False


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
