"""Kronecker-factored curvature blocks: what K-FAC needs to know about one layer type.

A block turns a module's input ``x`` and output gradient ``dy`` into the sufficient statistics
of its two Kronecker factors, and reads/writes the module's weight gradient as one matrix
``∇`` of shape ``(d_G, d_A)`` whose last column is the bias gradient when there is a bias.

Conventions (see ``docs/math.md``):

* ``A = (1/R) Σ_rows a aᵀ`` where a row is one input vector (Linear: every leading index of
  ``(..., in)``; Conv2d: every output position of every example; ``a`` is the im2col patch in
  PyTorch's ``(c_in, kh, kw)`` order) with a trailing 1 when the layer has a bias.
* ``G = (1/N) Σ_rows g̃ g̃ᵀ`` where ``N`` is the number of examples (dim 0 of the input) and
  ``g̃`` is the per-example output gradient (autograd's gradient of a mean-reduced loss times
  ``N``). Rows of one example share the example (spatial positions, sequence positions).
* With this scaling, for a single example through a Linear layer, ``A ⊗ G`` equals
  ``vec(∇) vec(∇)ᵀ`` with column-major ``vec`` (``vec(∇)[i + j·d_G] = ∇[i, j]``).

The blocks only return raw sums (``Σ a aᵀ`` and ``Σ dy dyᵀ``) and counts; normalisation is
done once per update in :mod:`dkfac.curvature.layer` so that accumulation over micro-batches
is exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dkfac.curvature.gram import (
    HIGHEST,
    GramPrecision,
    fill_border,
    gram,
    gram_with_ones,
)


class UnsupportedLayerError(ValueError):
    """A module that K-FAC cannot precondition as configured (e.g. a grouped convolution)."""


class FactorStatistic(NamedTuple):
    """Raw sum of outer products and how many rows/examples it covers."""

    total: Tensor
    rows: int
    examples: int


class KroneckerBlock(ABC):
    """Curvature of one module as a Kronecker product ``A ⊗ G``.

    Attributes:
        module: the module whose weight (and bias) is preconditioned.
        a_dim: side of ``A`` (input features, plus one for the bias).
        g_dim: side of ``G`` (output features).
        precision: how the statistics' products are formed (``statistics_precision``, set
            by the preconditioner): a block forms its operands with ``precision.operands``
            (or casts to ``precision.operand_dtype`` in a copy it makes anyway) and its
            products with ``precision.mm`` or the Gram helpers of :mod:`dkfac.curvature.gram`.
        patches: how a convolution forms its patch Grams (``conv_patches``, set by the
            preconditioner; one of :data:`~dkfac.curvature.factors.CONV_PATCHES`); blocks
            of other layers ignore it.
    """

    kind: str = "?"
    precision: GramPrecision = HIGHEST
    patches: str = "auto"
    #: Dims of one batched input (``examples`` counts dim 0 of such an input, else one).
    batched_dims: int = 2
    #: Whether ``A`` may be estimated from part of a call (``statistics_fraction``).
    a_from_part: bool = True
    #: The factors are exact only when the input holds one row per example along dim 0 (an
    #: embedding's ids): a call whose input was made once and broadcast over the batch is
    #: detected and passed through (:class:`~dkfac.layer_usage.LayerUsage`).
    needs_examples_in_dim0: bool = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        weight = module.weight
        if not isinstance(weight, Tensor):
            raise UnsupportedLayerError(f"{type(module).__name__} has no weight tensor")
        self.weight: Tensor = weight
        bias = getattr(module, "bias", None)
        self.bias: Tensor | None = bias if isinstance(bias, Tensor) else None
        self.g_dim = int(weight.shape[0])
        self.a_dim = int(weight[0].numel()) + (1 if self.bias is not None else 0)
        self.weight_shape = tuple(weight.shape)

    @property
    def has_bias(self) -> bool:
        """Whether the bias gradient is the last column of the gradient matrix."""
        return self.bias is not None

    @abstractmethod
    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ a aᵀ`` over the rows of the input ``x`` (in ``dtype``)."""

    def a_batch_key(self, x: Tensor) -> Hashable | None:
        """What another call must share for :meth:`a_statistics` to take both (``None``: alone).

        Equal keys mean equal statistics formulas (the block's settings) and equal inputs'
        shapes, dtypes and devices, whichever layer's block computes them.
        """
        return None

    def _a_statistic_of(self, owner: type[KroneckerBlock]) -> bool:
        """Whether this block's :meth:`a_statistic` is ``owner``'s own.

        ``owner``'s batched :meth:`a_statistics` forms its formula: a subclass with a
        statistic of its own (an embedding's, a user's) is not batched by it.
        """
        return type(self).a_statistic is owner.a_statistic

    def a_statistics(self, xs: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`a_statistic` of each of ``xs`` (of equal :meth:`a_batch_key`), in one go.

        A block that can form them in fewer launches than one at a time overrides this: on a
        GPU a small model's factor step waits for the host, which prepares every launch.
        """
        return [self.a_statistic(x, dtype) for x in xs]

    @abstractmethod
    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over the rows of the output gradient ``dy`` (in ``dtype``)."""

    def g_batch_key(self, dy: Tensor) -> Hashable | None:
        """As :meth:`a_batch_key`, for :meth:`g_statistics` of output gradients."""
        return None

    def _g_statistic_of(self, owner: type[KroneckerBlock]) -> bool:
        """Whether this block's :meth:`g_statistic` is ``owner``'s own (as ``A``'s)."""
        return type(self).g_statistic is owner.g_statistic

    def g_statistics(self, dys: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`g_statistic` of each of ``dys`` (of equal :meth:`g_batch_key`), in one go."""
        return [self.g_statistic(dy, dtype) for dy in dys]

    def examples(self, x: Tensor) -> int:
        """Examples in one call's input: its dim 0 when batched, else one."""
        return int(x.shape[0]) if x.dim() >= self.batched_dims else 1

    def parameters(self) -> list[Tensor]:
        """The preconditioned parameters (weight, then bias)."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def requires_grad(self) -> bool:
        """Whether some preconditioned parameter needs a gradient (not frozen)."""
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    def has_grad(self) -> bool:
        """Whether every preconditioned parameter has a gradient."""
        return self.weight.grad is not None and (self.bias is None or self.bias.grad is not None)

    def grad_matrix(self) -> Tensor:
        """The weight gradient as a ``(d_G, d_A)`` matrix, bias gradient as the last column."""
        weight = self.weight.grad
        assert weight is not None
        if self.bias is None:
            return self.matrix_of((weight,))
        assert self.bias.grad is not None
        return self.matrix_of((weight, self.bias.grad))

    def matrix_of(self, parts: Sequence[Tensor]) -> Tensor:
        """Tensors shaped like :meth:`parameters` as one ``(d_G, d_A)`` matrix.

        The inverse of :meth:`split_matrix`; of the parameters' gradients, :meth:`grad_matrix`.
        """
        matrix = parts[0].reshape(self.g_dim, -1)
        if self.bias is not None:
            matrix = torch.cat([matrix, parts[1].reshape(-1, 1)], dim=1)
        return matrix

    def split_matrix(self, matrix: Tensor) -> list[Tensor]:
        """A ``(d_G, d_A)`` matrix as tensors shaped like :meth:`parameters` (views)."""
        if self.bias is None:  # the whole matrix: one view (a plain step asks once per layer)
            return [matrix.reshape(self.weight_shape)]
        columns = self.a_dim - 1
        return [matrix[:, :columns].reshape(self.weight_shape), matrix[:, columns]]

    def set_grad(self, matrix: Tensor) -> None:
        """Write a ``(d_G, d_A)`` matrix back into the parameters' ``.grad`` (in place)."""
        set_gradients([self], [matrix])

    def describe(self) -> str:
        """A short description of the layer for tables."""
        return type(self.module).__name__


class LinearBlock(KroneckerBlock):
    """``nn.Linear`` on inputs of any shape ``(..., in)``: every leading index is a row."""

    kind = "Linear"

    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ a aᵀ`` with ``a = [x_row, 1]`` over all rows of ``x``."""
        rows = self.precision.operands(x.reshape(-1, x.shape[-1]), dtype)
        examples = int(x.shape[0]) if x.dim() > 1 else 1
        total = gram_with_ones(rows, self.has_bias, self.precision)
        return FactorStatistic(total, rows.shape[0], examples)

    def a_batch_key(self, x: Tensor) -> Hashable | None:
        """Linear inputs of one shape stack into one batched product."""
        if x.dim() < 2 or not self._a_statistic_of(LinearBlock):
            return None
        return ("linear", self.has_bias, self.precision, tuple(x.shape), x.dtype, x.device)

    def a_statistics(self, xs: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`a_statistic` of each input: one stacked copy and one batched product."""
        inputs = torch.stack(list(xs))
        rows = self.precision.operands(inputs.reshape(len(xs), -1, inputs.shape[-1]), dtype)
        core = gram(rows, self.precision)
        totals = core
        if self.has_bias:
            d = core.shape[-1]
            totals = core.new_empty(len(xs), d + 1, d + 1)
            totals[:, :d, :d] = core
            fill_border(totals, self.precision.sum_rows(rows, (1,)), rows.shape[1])
        examples = int(xs[0].shape[0])
        return [FactorStatistic(total, rows.shape[1], examples) for total in totals.unbind(0)]

    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over all rows of ``dy``."""
        rows = self.precision.operands(dy.reshape(-1, dy.shape[-1]), dtype)
        examples = int(dy.shape[0]) if dy.dim() > 1 else 1
        return FactorStatistic(gram(rows, self.precision), rows.shape[0], examples)

    def g_batch_key(self, dy: Tensor) -> Hashable | None:
        """Output gradients of one shape stack into one batched product."""
        if dy.dim() < 2 or not self._g_statistic_of(LinearBlock):
            return None
        return ("linear", self.precision, tuple(dy.shape), dy.dtype, dy.device)

    def g_statistics(self, dys: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`g_statistic` of each output gradient: one stacked copy, one batched product."""
        stacked = torch.stack(list(dys))
        rows = self.precision.operands(stacked.reshape(len(dys), -1, stacked.shape[-1]), dtype)
        totals = gram(rows, self.precision)
        examples = int(dys[0].shape[0])
        return [FactorStatistic(total, rows.shape[1], examples) for total in totals.unbind(0)]


def refuse_shared_parameters(parameters: Sequence[Tensor], caller: str) -> None:
    """Refuse gradients to be written for a parameter twice (two blocks holding it).

    Layer discovery skips tied parameters, so this only guards blocks made otherwise.

    Raises:
        ValueError: a parameter appears twice in ``parameters``.
    """
    if len({id(p) for p in parameters}) != len(parameters):
        raise ValueError(f"{caller}: a parameter's gradient belongs to two blocks")


def set_gradients(
    blocks: Sequence[KroneckerBlock],
    matrices: Sequence[Tensor],
    scale: Tensor | None = None,
    grad_matrices: Sequence[Tensor] | None = None,
) -> None:
    """Each block's :meth:`~KroneckerBlock.set_grad` of its matrix times ``scale``, together.

    The copies into every ``.grad``, then the scaling of all of them, share their launches
    (a GPU otherwise takes two small kernels per layer). Each entry is rounded as
    ``set_grad(matrix * scale)`` rounds it: a ``.grad`` of another dtype than its matrix (a
    bf16 weight beside a float32 bias) takes the product, scaled before the cast.

    Args:
        blocks: the layers' blocks.
        matrices: their new ``(d_G, d_A)`` gradient matrices.
        scale: a device scalar all of them are multiplied by, or ``None``.
        grad_matrices: the blocks' :meth:`~KroneckerBlock.grad_matrix` of this step, if at
            hand: where one is the whole weight gradient seen through a view (no bias, a
            contiguous gradient) and the block splits matrices as dkfac's own blocks do
            (its :meth:`~KroneckerBlock.split_matrix` the inverse of that view), its matrix is
            copied into that view, with no reshape.
    """
    # CUDA's fused copy takes a list only if every pair in it is laid out alike and each list
    # has one dtype (ATen's foreach fast route): one pair that is not (a bias column, a
    # transposed weight) would send every pair to a launch of its own. The pairs laid out
    # alike go together, one call per dtypes and device; the rest in one more call.
    aligned: dict[tuple[torch.dtype, torch.dtype, torch.device], tuple[list[Tensor], ...]] = {}
    others: tuple[list[Tensor], list[Tensor]] = ([], [])
    parameters = []

    def add(grad: Tensor, part: Tensor) -> None:
        if grad.stride() == part.stride():
            pairs = aligned.setdefault((grad.dtype, part.dtype, grad.device), ([], []))
        else:
            pairs = others
        pairs[0].append(grad)
        pairs[1].append(part)

    for index, (block, matrix) in enumerate(zip(blocks, matrices, strict=True)):
        weight_grad = block.weight.grad
        view = None if grad_matrices is None else grad_matrices[index]
        if (
            view is not None
            and weight_grad is not None
            and block.bias is None
            and type(block).split_matrix is KroneckerBlock.split_matrix
            and view.data_ptr() == weight_grad.data_ptr()  # a copy would be elsewhere
            and view.numel() == weight_grad.numel()
            and (scale is None or weight_grad.dtype == matrix.dtype)
        ):
            add(view, matrix)
            parameters.append(block.weight)
            continue
        for parameter, part in zip(block.parameters(), block.split_matrix(matrix), strict=True):
            grad = parameter.grad
            assert grad is not None
            if scale is not None and grad.dtype != part.dtype:
                grad.copy_(part * scale)
            else:
                add(grad, part)
            parameters.append(parameter)
    refuse_shared_parameters(parameters, "set_gradients")
    written = []
    for grads, parts in [*aligned.values(), others]:
        if grads:
            torch._foreach_copy_(grads, parts)
            written += grads
    if scale is not None and written:
        torch._foreach_mul_(written, scale)


class TransposedLinearBlock(LinearBlock):
    """A linear layer whose weight is stored ``(in, out)``: ``y = x W + b``.

    Hugging Face ``transformers``' ``Conv1D`` (GPT-2's attention and MLP projections) is such a
    layer; it is recognised by its class name and ``nf`` attribute, without importing
    transformers. The factors are a Linear layer's; the gradient matrix is ``Wᵀ``'s.
    """

    kind = "Linear (weight stored transposed)"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.g_dim = int(self.weight.shape[1])
        self.a_dim = int(self.weight.shape[0]) + (1 if self.bias is not None else 0)

    def matrix_of(self, parts: Sequence[Tensor]) -> Tensor:
        """``Wᵀ``-shaped ``parts[0]`` with ``parts[1]`` (the bias) as the last column."""
        matrix = parts[0].t()
        if self.bias is not None:
            return torch.cat([matrix, parts[1].reshape(-1, 1)], dim=1)
        return matrix.contiguous()

    def split_matrix(self, matrix: Tensor) -> list[Tensor]:
        """A ``(d_G, d_A)`` matrix as tensors shaped like :meth:`parameters` (views)."""
        columns = self.a_dim - (1 if self.bias is not None else 0)
        parts = [matrix[:, :columns].t()]
        if self.bias is not None:
            parts.append(matrix[:, columns])
        return parts

    def describe(self) -> str:
        """The layer's class, and that its weight is transposed."""
        return f"{type(self.module).__name__} (transposed weight)"


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``y = x W + b``, ``W`` of ``(in, nf)``)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and int(weight.shape[1]) == module.nf
    )
