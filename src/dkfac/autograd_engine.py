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


#: Backward calls whose answers are kept at once (threads running their own calls).
KEPT_CALLS = 8


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
    one), so each layer's are found once per factor window and let go at its end
    (:meth:`forget`): an accumulator holds its parameter, and ``torch.utils.swap_tensors``
    (``module.to()`` in swap mode, loading a state into wrapper-subclass parameters) refuses a
    parameter held so once it needs no gradient. One replaced within a window (``module.to()``
    of another dtype or device) is found again when the held one says the call does not run
    it. Answers are kept per backward call, by the call's id: each layer is asked once per
    call however many hooks ask, and calls running on other threads keep their own.

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
        # By backward call: each layer's answer (None: not known), and "any layer's" under "".
        self._answers: dict[int, dict[str, bool | None]] = {}
        self._closed = False

    def computed(self, name: str) -> bool:
        """Whether the backward call running now computes a gradient of layer ``name``."""
        answers = self._call_answers()
        if answers is None:
            return True
        if name not in answers:
            answers[name] = self._ask(name)
        return answers[name] is not False

    def any_computed(self) -> bool:
        """Whether the backward call running now computes a gradient of any layer."""
        answers = self._call_answers()
        if answers is None:
            return True
        if "" not in answers:
            # Only with every layer's answer a known "no" does the call compute none.
            answers[""] = not self._parameters or any(
                self.computed(name) for name in self._parameters
            )
        return bool(answers[""])

    def forget(self) -> None:
        """Let go of the accumulators held, and of the answers (a factor window ended)."""
        self._accumulators.clear()
        self._answers.clear()

    def close(self) -> None:
        """Forget, and answer yes from now on, asking nothing (the preconditioner is removed).

        Hooks on tensors made before may still run: they hold nothing again.
        """
        self.forget()
        self._closed = True

    def _call_answers(self) -> dict[str, bool | None] | None:
        """The running backward call's answers so far (None: no call or nothing to ask)."""
        call = current_backward_id()
        if call is None or self._will_run is None or self._closed:
            return None
        answers = self._answers.get(call)
        if answers is None:
            if len(self._answers) >= KEPT_CALLS:
                self._answers.clear()
            answers = self._answers[call] = {}
        return answers

    def _ask(self, name: str) -> bool | None:
        """Ask the engine about the held accumulators, else about those found again."""
        will_run = self._will_run
        assert will_run is not None  # _call_answers returned answers
        held = self._accumulators.get(name, [])
        if any(_runs(will_run, node) for node in held):
            return True
        found = self._find(name)
        if found is None:
            return None
        self._accumulators[name] = found  # [] when frozen: nothing held for it
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
