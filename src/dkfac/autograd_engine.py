"""What the autograd engine's running backward call is, and what it computes.

PyTorch answers neither publicly, so these read the engine's own queries: the graph-task id,
which ``torch.utils.checkpoint`` uses (:func:`current_backward_id`), and whether a node of the
graph will run, which ``torch.autograd.graph.register_multi_grad_hook`` uses
(:class:`LayerGradients`). The second tells a loss's backward call from a
``torch.autograd.grad`` call through a layer that computes no gradient of its parameters (a
gradient penalty, a physics-informed loss): that call's output gradients are no loss gradients
and must not reach ``G`` (docs/math.md, "Backward calls that compute no layer gradient").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge


def current_backward_id() -> int | None:
    """An id of the backward pass the autograd engine is running on this thread, else None.

    Without the engine's query (an older build) nothing is recomputed as far as dkfac can
    tell, and each recomputed call counts as a pass of its own.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        return None
    current = int(task_id())
    return None if current == -1 else current


class LayerGradients:
    """Whether the running backward call computes a gradient of a layer's parameters.

    The call computes one if it runs the gradient accumulator of a parameter (``.backward()``,
    ``backward(inputs=...)`` naming it) or returns the parameter's gradient
    (``torch.autograd.grad(loss, parameters)``, for which the engine refuses the query: a
    refusal counts as yes). A layer whose parameters all need no gradient (frozen, as a GAN's
    critic in the generator's step) computes none. Where dkfac cannot tell (a parameter that is
    not a leaf, no accumulator to find under ``torch.func``), the answer is yes: the layer
    keeps every call's statistics, as before.

    Finding an accumulator costs a view of its parameter (microseconds; the query a tenth of
    one), so each layer's are found once and held until :meth:`forget` (the preconditioner is
    removed); one replaced meanwhile (``module.to()`` of another dtype or
    device makes a new one; the old one holds the old parameter's storage until then) is found
    again when the held one says the call does not run it. Answers are kept for the backward
    call they were asked in: each layer is asked once per call, however many hooks ask.

    Args:
        parameters: each layer's parameters, by the layer's name.
    """

    def __init__(self, parameters: Mapping[str, Sequence[Tensor]]) -> None:
        self._parameters = {name: list(tensors) for name, tensors in parameters.items()}
        self._accumulators: dict[str, list[Node]] = {}
        # The engine's "will this node run in the current backward call" (None: not built in).
        self._will_run: Callable[[Node], bool] | None = getattr(
            torch._C, "_will_engine_execute_node", None
        )
        # The backward call asked in, its answers by layer (None: cannot tell), and whether it
        # computes some layer's gradient (None: not asked yet).
        self._call: int | None = None
        self._answers: dict[str, bool | None] = {}
        self._any: bool | None = None

    def computed(self, name: str) -> bool:
        """Whether the backward call running now computes a gradient of layer ``name``'s."""
        return self._answer(name) is not False

    def any_computed(self) -> bool:
        """Whether the backward call running now computes a gradient of any layer's."""
        self._in_current_call()
        if self._any is None:
            # Only with every layer's answer a known "no" does the call compute none.
            self._any = not self._parameters or any(
                self._answer(name) is not False for name in self._parameters
            )
        return self._any

    def forget(self) -> None:
        """Let go of the accumulators held, and of the answers."""
        self._accumulators.clear()
        self._call, self._answers, self._any = None, {}, None

    def _in_current_call(self) -> None:
        """Forget the answers of an earlier backward call."""
        call = current_backward_id()
        if call != self._call:
            self._call, self._answers, self._any = call, {}, None

    def _answer(self, name: str) -> bool | None:
        """Whether the running call computes a gradient of layer ``name``'s; None: not known."""
        self._in_current_call()
        if name not in self._answers:
            self._answers[name] = self._ask(name)
        return self._answers[name]

    def _ask(self, name: str) -> bool | None:
        """Ask the engine about the held accumulators, else about those found again."""
        will_run = self._will_run
        if will_run is None or self._call is None:
            return None
        held = self._accumulators.get(name, [])
        if any(_runs(will_run, node) for node in held):
            return True
        found = self._find(name)
        if found is None:
            return None
        if found:
            self._accumulators[name] = found
        return any(_runs(will_run, node) for node in found if node not in held)

    def _find(self, name: str) -> list[Node] | None:
        """The accumulators of the layer's parameters that need a gradient (None: not known)."""
        nodes = []
        for tensor in self._parameters[name]:
            if not tensor.requires_grad:
                continue
            if tensor.grad_fn is not None:  # not a leaf: no accumulator of its own
                return None
            try:
                nodes.append(get_gradient_edge(tensor).node)
            except (RuntimeError, AttributeError):  # e.g. under torch.func's transforms
                return None
        return nodes


def _runs(will_run: Callable[[Node], bool], node: Node) -> bool:
    try:
        return bool(will_run(node))
    # Refused for a leaf torch.autograd.grad returns the gradient of (computed), or with no
    # graph task of the engine's (compiled autograd runs hooks in its own graph): not known,
    # so the statistics are kept.
    except RuntimeError:
        return True
