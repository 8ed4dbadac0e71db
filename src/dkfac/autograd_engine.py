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

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import Node


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


class ReturnedGradientsWarning(UserWarning):
    """A ``torch.autograd.grad`` call computed a K-FAC layer's parameters' gradients.

    Its output gradients are counted in ``G`` as a ``backward()`` call's are. A loop that
    writes the returned gradients into ``.grad`` itself is counted once and may silence it
    (``warnings.filterwarnings("ignore", category=dkfac.ReturnedGradientsWarning)``).
    """


class SeparateBackwardCallsWarning(UserWarning):
    """Two backward calls that both compute a K-FAC layer's gradient reached one forward pass.

    ``G`` adds each call's output-gradient products (``g₁g₁ᵀ + g₂g₂ᵀ``), where the losses'
    sum has ``(g₁ + g₂)(g₁ + g₂)ᵀ``: backpropagate the sum once instead.
    """


#: Shown once when two computing backward calls reach one layer call (:meth:`LayerUsage.g_taken`).
SEPARATE_BACKWARD_CALLS = (
    "K-FAC layer {name!r}: two backward calls that both compute its gradient reached one "
    "forward pass (two losses of one forward, each backpropagated with retain_graph=True, or "
    "one loss backpropagated twice). G adds each call's output-gradient products "
    "(g1 g1^T + g2 g2^T), which is not the summed loss's G ((g1 + g2)(g1 + g2)^T; twice it "
    "for one loss backpropagated twice): backpropagate the sum of the losses once "
    "((loss1 + loss2).backward()). (Shown once.)"
)
#: Shown once when a ``torch.autograd.grad`` call computes a layer's parameters' gradients.
RETURNED_GRADIENTS = (
    "torch.autograd.grad computed the gradient of a K-FAC layer's parameters, to return it "
    "rather than accumulate it into .grad: dkfac counts that call's output gradients in G as "
    "it counts a backward() call's. If the same loss is also backpropagated by backward() (a "
    "gradient norm computed for a log, for example), G counts it twice (2x): compute such "
    "values from .grad after backward() instead. A loop that writes the returned gradients "
    "into .grad itself, with no backward(), is counted once (silence it by its category, "
    "dkfac.ReturnedGradientsWarning). (Shown once.)"
)
#: Backward calls whose answers are kept at once (threads running their own calls).
KEPT_CALLS = 8
#: Graph nodes looked at below a layer's output for its parameters' accumulators.
SEARCHED_NODES = 16


def accumulators_below(
    output: Tensor, parameters: Sequence[Tensor], stop: Node | None = None
) -> list[Node] | None:
    """The gradient accumulators of ``parameters`` (those needing one) below ``output``.

    Searched within :data:`SEARCHED_NODES` nodes of ``output``'s graph (the operator's inputs:
    one or two nodes down for a convolution or a linear map); None when not all are found
    there. Read from the graph the call just made, nothing is held beyond it; parameters
    substituted for the call (``torch.func.functional_call``) or not leaves are not found:
    dkfac then cannot tell, and keeps the call's statistics. ``stop``: the node that made the
    layer's input, not searched (its graph would spend the budget).
    """
    wanted = [tensor for tensor in parameters if tensor.requires_grad]
    found: list[Node] = []
    queue = [output.grad_fn]
    looked = 0
    while queue and looked < SEARCHED_NODES and len(found) < len(wanted):
        node = queue.pop(0)
        looked += 1
        if node is None:
            continue
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)  # an AccumulateGrad's parameter
            if variable is None:
                if child is not stop:
                    queue.append(child)
            elif any(variable is tensor for tensor in wanted) and child not in found:
                found.append(child)
    return found if len(found) == len(wanted) and found else None


@dataclass
class PassAccumulators:
    """The accumulators found in one forward pass's layer calls, each once.

    ``known`` is False when some call's were not found: the pass then computes, as far as
    dkfac can tell. Empty and known: only frozen layers ran in it.
    """

    nodes: dict[int, Node] = field(default_factory=dict)  # by id: each node once
    known: bool = True


class LayerGradients:
    """Whether the running backward call computes a gradient of a layer's parameters.

    The call computes one if it runs the gradient accumulator of a parameter (``.backward()``,
    ``backward(inputs=...)`` naming it) or returns the parameter's gradient
    (``torch.autograd.grad(loss, parameters)``, for which the engine refuses the query: a
    refusal counts as yes). The accumulators asked about are those of the layer's call
    (:func:`accumulators_below`); where none were found (a parameter that is not a leaf,
    substituted parameters, ``torch.func``'s transforms) the answer is yes: the layer keeps
    every call's statistics, as before. A layer whose parameters all need no gradient when it
    runs (a GAN's critic frozen for the generator's step) is no training call at all (the
    capture's forward hook).

    Answers are kept per backward call, by the call's id: each layer (and pass) is asked once
    per call however many hooks ask, and calls on other threads keep their own. A pass's
    accumulators, of every layer call in it on every worker alike, are gathered until the pass
    ends and then handed to the hooks on its outputs (:meth:`take`): nothing outlives the
    pass's graph.
    """

    def __init__(self) -> None:
        # The engine's "will this node run in the current backward call" (None: not built in).
        self._will_run: Callable[[Node], bool] | None = getattr(
            torch._C, "_will_engine_execute_node", None
        )
        # By backward call: each layer's answer (by name), and each pass's (by number).
        self._answers: dict[int, dict[str | int, bool]] = {}
        self._passes: dict[int, PassAccumulators] = {}
        self._returned_warned = False  # RETURNED_GRADIENTS shown (once per preconditioner)

    def found(self, pass_id: int, accumulators: list[Node] | None) -> None:
        """A layer's call in pass ``pass_id`` has ``accumulators``.

        None: not known; ``[]``: the layer ran frozen.
        """
        gathered = self._passes.setdefault(pass_id, PassAccumulators())
        if accumulators is None:
            gathered.known = False
        else:
            for node in accumulators:
                gathered.nodes.setdefault(id(node), node)

    def take(self, pass_id: int) -> PassAccumulators | None:
        """Pass ``pass_id``'s accumulators, no longer kept here (None: no layer call found)."""
        return self._passes.pop(pass_id, None)

    def computed(self, name: str, accumulators: list[Node] | None) -> bool:
        """Whether the running backward call computes a gradient of layer ``name``'s call.

        ``accumulators``: those found for the call (None: not known, so yes).
        """
        answers = self._call_answers()
        if answers is None or not accumulators:
            return True
        if name not in answers:
            answers[name] = self._runs_any(accumulators)
        return answers[name]

    def any_computed(self, pass_id: int, accumulators: PassAccumulators | None) -> bool:
        """Whether the running backward call computes a gradient of any layer of a pass.

        ``accumulators``: pass ``pass_id``'s, taken (None: not known, so yes).
        """
        answers = self._call_answers()
        if answers is None or accumulators is None or not accumulators.known:
            return True
        if pass_id not in answers:
            answers[pass_id] = self._runs_any(accumulators.nodes.values())
        return answers[pass_id]

    def forget(self) -> None:
        """Let go of the passes' accumulators, and of the answers (a factor window ended)."""
        self._answers.clear()
        self._passes.clear()

    def _call_answers(self) -> dict[str | int, bool] | None:
        """The running backward call's answers so far (None: no call, or no engine query)."""
        call = current_backward_id()
        if call is None or self._will_run is None:
            return None
        answers = self._answers.get(call)
        if answers is None:
            if len(self._answers) >= KEPT_CALLS:
                self._answers.clear()
            answers = self._answers[call] = {}
        return answers

    def _runs_any(self, accumulators: Iterable[Node]) -> bool:
        will_run = self._will_run
        assert will_run is not None  # _call_answers gave answers
        for node in accumulators:  # the first that runs answers for all
            answer = _runs(will_run, node)
            if answer is None and not self._returned_warned:
                self._returned_warned = True
                # From a backward hook: no frame of the caller's to point at.
                warnings.warn(RETURNED_GRADIENTS, ReturnedGradientsWarning, stacklevel=1)
            if answer is None or answer:
                return True
        return False


def _runs(will_run: Callable[[Node], bool], node: Node) -> bool | None:
    """Whether the running backward call runs the gradient accumulator ``node``.

    None: a ``torch.autograd.grad`` call computes its parameter's gradient, to return it
    (not to accumulate it into ``.grad``).
    """
    try:
        return bool(will_run(node))
    # Refused for a leaf whose gradient torch.autograd.grad returns (the engine's message
    # names it), or with no graph task of the engine's (compiled autograd runs hooks in its
    # own graph): not known, so the statistics are kept.
    except RuntimeError as error:
        return None if "autograd.grad" in str(error) else True
