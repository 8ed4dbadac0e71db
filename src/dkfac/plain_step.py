"""A step's gradients preconditioned, KL-clipped and written back: eagerly or as a CUDA graph.

On a GPU a small model's step waits for the host, and a plain step's K-FAC work is dozens of
small launches (docs/benchmarks.md, "Host time of small steps"). With ``plain_step_graphs``
that arithmetic is captured once as a CUDA graph and replayed: the host then copies the
parameters' gradients into the graph's inputs, replays it, and copies its outputs (in the
gradients' layouts) into the ``.grad`` tensors: one fused launch each where the gradients
share a dtype. The graph makes the layers' gradient matrices itself
(:meth:`~dkfac.curvature.blocks.KroneckerBlock.matrix_of`), so its memory pool holds a copy
of the gradients, their matrices where those are copies (a bias column, a transposed weight),
the directions, and a copy of the parts of them not laid out as their gradients.

A graph replays fixed kernels on fixed memory, so it is only replayed while everything its
capture read stays the same: the layers with a gradient, their inverses (a decomposition or a
loaded state makes new ones; stacking equal shapes replaces them by views), the gradients'
dtypes and layouts, whether the KL clip is on and, for eigendecompositions, the damping. Any
change runs that step eagerly and the next step captures again. The learning rate and ``κ``
are read from device scalars the host fills when they change (a schedule then costs no
capture). A step whose preconditioning sends something (a strategy's gradient shares) or is
timed for a plan (a strategy still profiling) is never captured; nor is adaptive K-FAC's
step (its own passes), which does not come here.

Both ways compute the same operations on the same values, so the gradients are equal bit for
bit where the kernels are deterministic (the CPU; on a GPU a library may pick other kernels
inside a capture, to round-off): the eager way scales each direction while writing it, the
captured one first (one rounding either way).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from dkfac.curvature.blocks import KroneckerBlock, refuse_shared_parameters, set_gradients
from dkfac.curvature.kl_clip import kl_clip_scale, kl_inner_product, kl_scale
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.base import Strategy

logger = logging.getLogger(__name__)

Compute = Callable[[], list[Tensor]]

_GRAD = operator.attrgetter("grad")


class GraphCapture(Protocol):
    """What captures a plain step (:class:`CudaGraphs`; tests replay eagerly)."""

    def capture(
        self, compute: Compute, device: torch.device
    ) -> tuple[list[Tensor], Callable[[], None]]:
        """Record ``compute`` (its work on ``device``) once; its outputs, and its replay.

        Raises:
            RuntimeError: the capture failed (the caller then runs the step eagerly).
        """
        ...

    def release(self) -> None:
        """Let the last capture's graph and memory go (none is replayed any more)."""
        ...


class CudaGraphs:
    """:class:`GraphCapture` with ``torch.cuda.CUDAGraph``; a capture reuses the last one's pool.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"plain_step_graphs=True is not allowed with the model on {device}: CUDA "
                "graphs need a CUDA device (move the model first, or pass False)"
            )
        self._pool: Any = None  # a pool handle, made at a capture when no graph is alive
        # The last graph captured, kept until the next capture has been made into its pool:
        # the allocator drops a pool for good once no graph captured into it is alive, and a
        # later capture into that pool then fails an internal assert (seen on an H200, torch
        # 2.11). The caller never replays it again once it asks for another capture.
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(
        self, compute: Compute, device: torch.device
    ) -> tuple[list[Tensor], Callable[[], None]]:
        """Warm ``compute`` up on a side stream of ``device``, then capture it there.

        Capturing runs nothing: the caller replays to compute. ``torch.cuda.graph`` is not
        used: it empties the allocator's caches at every capture (one after each
        decomposition). A capture goes into the last graph's pool, which that graph keeps
        alive until then (it is never replayed again), so it reuses the memory the last
        step's outputs freed; it refuses only the capturing thread's unsafe calls
        (``"thread_local"``: a communication watchdog's queries elsewhere do not break it).
        """
        with torch.cuda.device(device):
            if self._graph is None:  # no live graph holds the last pool: a new one
                self._pool = torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                compute()  # lazy initialisations (cuBLAS workspaces) outside the capture
                torch.cuda.synchronize(device)  # once per capture: the warm-up has finished
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outputs = compute()
                finally:
                    graph.capture_end()
            current.wait_stream(side)
        self._graph = graph  # the previous one goes: its pool lives on in this one
        return outputs, graph.replay

    def release(self) -> None:
        """Drop the last graph: its pool goes with it, and the next capture makes another."""
        self._graph = None


@dataclass(frozen=True)
class _Captured:
    """A captured plain step: its input copies, its outputs and its replay.

    ``held``: everything else the graph reads (the inverses, the device scalars, the plan),
    kept alive while it may be replayed: a graph holds addresses, not tensors, and the key
    compares these objects by ``id``.
    """

    inputs: list[Tensor]
    outputs: list[Tensor]
    replay: Callable[[], None]
    held: tuple[object, ...]


def _apart(grad: Tensor, part: Tensor) -> bool:
    """Whether ``part`` is laid out otherwise than ``grad`` (strides or dtype)."""
    return part.stride() != grad.stride() or part.dtype != grad.dtype


class PlainStep:
    """Writes the K-FAC directions of a step's layers into their gradients.

    Args:
        strategy: preconditions the layers (each rank those it holds, the rest shared).
        shared_launches: the KL clip's products in shared launches (batched preconditioning).
        graphs: captures replayable steps (:class:`CudaGraphs`); ``None``: all eager.
        damping_matters: whether the preconditioning reads the damping (eigendecompositions;
            a Cholesky inverse fixed it when it was made).
    """

    def __init__(
        self,
        strategy: Strategy,
        shared_launches: bool,
        graphs: GraphCapture | None = None,
        damping_matters: bool = True,
    ) -> None:
        self._strategy = strategy
        self._shared = shared_launches
        self._graphs = graphs
        self._damping_matters = damping_matters
        self._key: Hashable | None = None  # what the last step's arithmetic depended on
        self._captured: _Captured | None = None
        self._refused: Hashable | None = None  # a key whose capture failed
        self._scalars: Tensor | None = None  # η² and κ on the device, for the graph
        self._scalar_values: tuple[float, float] | None = None
        # The layers' ids of the last step and their parameters (None: not capturable).
        self._parameters: tuple[tuple[int, ...], list[Tensor] | None] | None = None
        self.captures = self.replays = 0  # counted for tests and benchmarks

    def apply(
        self,
        layers: Sequence[LayerCurvature],
        damping: float,
        clip: tuple[float, float] | None,
    ) -> None:
        """Precondition the layers' gradients, clip, and write the directions into ``.grad``.

        ``clip``: the step's learning rate and ``κ`` (``None``: no KL clip).
        """
        blocks = [layer.block for layer in layers]
        clipped = clip is not None
        if self._graphs is not None:
            grads = self._gradients(layers, blocks)
            key = None if grads is None else self._key_of(layers, grads, damping, clipped)
            if key is not None:
                assert grads is not None
                if clip is not None:
                    self._fill_scalars(grads[0].device, clip[0] * clip[0], clip[1])
                outputs = self._replayed(key, layers, grads, damping, clipped)
                torch._foreach_copy_(grads, outputs)
                return
            # Not captured, nor replayed: nothing holds the last graph's memory any more.
            self._graphs.release()
        self._key = self._captured = None
        matrices = [block.grad_matrix() for block in blocks]
        directions = self._strategy.precondition(layers, matrices, damping)
        scale = None
        if clip is not None:
            scale = kl_clip_scale(directions, matrices, clip[0], clip[1], self._shared)
        set_gradients(blocks, directions, scale, matrices)

    def release(self) -> None:
        """Drop the captured graph, its memory and what it holds (``remove()``)."""
        self._key = self._captured = None
        if self._graphs is not None:
            self._graphs.release()

    def _gradients(
        self, layers: Sequence[LayerCurvature], blocks: Sequence[KroneckerBlock]
    ) -> list[Tensor] | None:
        """The ``.grad`` of every layer's parameters, in order; ``None``: not capturable.

        A graph reads the parameters' gradients, not their matrices: the matrices (a copy
        for a layer with a bias) and the directions' split are made inside it. A block whose
        :meth:`~KroneckerBlock.grad_matrix` is its own (not :meth:`~KroneckerBlock.matrix_of`
        of its gradients) runs eagerly.
        """
        ids = tuple(map(id, layers))
        if self._parameters is None or self._parameters[0] != ids:
            own = any(type(block).grad_matrix is not KroneckerBlock.grad_matrix for block in blocks)
            parameters = None if own else [p for block in blocks for p in block.parameters()]
            if parameters is not None:
                refuse_shared_parameters(parameters, "a plain step")  # as set_gradients does
            self._parameters = (ids, parameters)
        parameters = self._parameters[1]
        return None if parameters is None else list(map(_GRAD, parameters))

    def _key_of(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
        clipped: bool,
    ) -> Hashable | None:
        """What a captured step depends on; ``None``: this step is not to be captured.

        ``grads``: the layers' parameters' gradients (:meth:`_gradients`).
        """
        strategy = self._strategy
        if strategy.profiling or not strategy.precondition_is_local(layers):
            return None
        layouts = tuple((grad.dtype, grad.stride(), grad.device) for grad in grads)
        if len({device for _, _, device in layouts}) != 1:
            return None  # a model over several devices: one graph captures one device
        matmul = torch.backends.cuda.matmul
        return (
            id(strategy.placement),
            tuple(map(id, layers)),
            tuple(id(layer.inverse) for layer in layers),
            layouts,  # the same kernels for the same dtypes, layouts and device
            damping if self._damping_matters else None,
            clipped,
            # Fixed in the captured kernels: the products' precision settings.
            torch.get_float32_matmul_precision(),
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
        )

    def _fill_scalars(self, device: torch.device, lr_squared: float, kl_clip: float) -> None:
        """η² and κ into the device scalars the graph reads (one fill each, when changed)."""
        if self._scalars is None or self._scalars.device != device:
            self._scalars = torch.zeros(2, dtype=torch.float64, device=device)
            self._scalar_values = None
        previous = self._scalar_values
        for index, value in enumerate((lr_squared, kl_clip)):
            if previous is None or previous[index] != value:
                self._scalars[index].fill_(value)  # a launch, not a host-to-device copy
        self._scalar_values = (lr_squared, kl_clip)

    def _compute(
        self,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
        clipped: bool,
    ) -> list[Tensor]:
        """The scaled directions, shaped as ``grads``: what a graph captures (new tensors only).

        ``grads``: the layers' parameters' gradients, in order (:meth:`_gradients`).
        """
        blocks = [layer.block for layer in layers]
        matrices, start = [], 0
        for block in blocks:
            count = len(block.parameters())
            matrices.append(block.matrix_of(grads[start : start + count]))
            start += count
        directions = self._strategy.precondition(layers, matrices, damping)
        if clipped:
            assert self._scalars is not None, "filled before"
            inner = kl_inner_product(directions, matrices, self._shared)
            nu = kl_scale(inner, self._scalars[0], self._scalars[1], matrices[0].dtype)
            directions = list(torch._foreach_mul(directions, nu))
        parts = [
            part
            for block, direction in zip(blocks, directions, strict=True)
            for part in block.split_matrix(direction)
        ]
        # Each in its gradient's layout and dtype (a part that is not, a bias column or a
        # transposed weight, copied inside the graph): the host's copy into the .grad tensors
        # is then fused on CUDA, where one such part would take a launch per tensor.
        outputs = list(parts)
        moved = [i for i, (g, p) in enumerate(zip(grads, parts, strict=True)) if _apart(g, p)]
        if moved:
            laid_out = [torch.empty_like(grads[i]) for i in moved]
            torch._foreach_copy_(laid_out, [parts[i] for i in moved])
            for index, tensor in zip(moved, laid_out, strict=True):
                outputs[index] = tensor
        return outputs

    def _replayed(
        self,
        key: Hashable,
        layers: Sequence[LayerCurvature],
        grads: Sequence[Tensor],
        damping: float,
        clipped: bool,
    ) -> list[Tensor]:
        """The step's outputs: replayed if ``key`` repeats the last step's, else eager."""
        if key != self._key:
            # Eager; the key is taken after: a first step may stack the new inverses (views).
            self._captured = None
            outputs = self._compute(layers, grads, damping, clipped)
            self._key = self._key_of(layers, grads, damping, clipped)
            return outputs
        captured = self._captured
        if captured is None:
            if key == self._refused:
                return self._compute(layers, grads, damping, clipped)
            inputs = [torch.empty_like(g) for g in grads]  # a dense gradient's layout
            torch._foreach_copy_(inputs, list(grads))
            assert self._graphs is not None, "only a step with a key is captured"
            try:
                outputs, replay = self._graphs.capture(
                    lambda: self._compute(layers, inputs, damping, clipped), grads[0].device
                )
            except RuntimeError as error:  # an operation a graph cannot hold: eager instead
                logger.warning("plain step not captured, run eagerly: %s", error)
                self._refused = key  # until something it depends on changes
                return self._compute(layers, grads, damping, clipped)
            if self._key_of(layers, grads, damping, clipped) != key:
                # The capture changed what it read (it would replay stale memory): eager.
                logger.debug("plain step not captured: its inputs changed while captured")
                self._key = None
                return self._compute(layers, grads, damping, clipped)
            held = (self._strategy.placement, self._scalars, *[layer.inverse for layer in layers])
            captured = self._captured = _Captured(inputs, outputs, replay, held)
            self.captures += 1
            with self._strategy.recorder.phase("precondition"):
                captured.replay()
        else:
            with self._strategy.recorder.phase("precondition"):  # timed as an eager step is
                torch._foreach_copy_(captured.inputs, list(grads))
                captured.replay()
        self.replays += 1
        return captured.outputs
