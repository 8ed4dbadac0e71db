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
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.curvature.factors import conv2d_patch_gram
from dkfac.curvature.gram import HIGHEST, GramPrecision, gram_with_ones, pixel_gram
from dkfac.curvature.shifted_gram_plan import ShiftedGramPlans


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
    """

    kind: str = "?"
    precision: GramPrecision = HIGHEST
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

    @abstractmethod
    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over the rows of the output gradient ``dy`` (in ``dtype``)."""

    def examples(self, x: Tensor) -> int:
        """Examples in one call's input: its dim 0 when batched, else one."""
        return int(x.shape[0]) if x.dim() >= self.batched_dims else 1

    def parameters(self) -> list[Tensor]:
        """The preconditioned parameters (weight, then bias)."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def has_grad(self) -> bool:
        """Whether every preconditioned parameter has a gradient."""
        return self.weight.grad is not None and (self.bias is None or self.bias.grad is not None)

    def grad_matrix(self) -> Tensor:
        """The weight gradient as a ``(d_G, d_A)`` matrix, bias gradient as the last column."""
        grad = self.weight.grad
        assert grad is not None
        matrix = grad.reshape(self.g_dim, -1)
        if self.bias is not None:
            assert self.bias.grad is not None
            matrix = torch.cat([matrix, self.bias.grad.reshape(-1, 1)], dim=1)
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

    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over all rows of ``dy``."""
        rows = self.precision.operands(dy.reshape(-1, dy.shape[-1]), dtype)
        examples = int(dy.shape[0]) if dy.dim() > 1 else 1
        return FactorStatistic(self.precision.mm(rows.t(), rows), rows.shape[0], examples)


def set_gradients(
    blocks: Sequence[KroneckerBlock], matrices: Sequence[Tensor], scale: Tensor | None = None
) -> None:
    """Each block's :meth:`~KroneckerBlock.set_grad` of its matrix times ``scale``, together.

    The copies into every ``.grad``, then the scaling of all of them, share their launches
    (a GPU otherwise takes two small kernels per layer). Each entry is rounded as
    ``set_grad(matrix * scale)`` rounds it: a ``.grad`` of another dtype than its matrix (a
    bf16 weight beside a float32 bias) takes the product, scaled before the cast.
    """
    grads, parts = [], []
    for block, matrix in zip(blocks, matrices, strict=True):
        for parameter, part in zip(block.parameters(), block.split_matrix(matrix), strict=True):
            assert parameter.grad is not None
            if scale is not None and parameter.grad.dtype != part.dtype:
                parameter.grad.copy_(part * scale)
            else:
                grads.append(parameter.grad)
                parts.append(part)
    if len({id(grad) for grad in grads}) != len(grads):  # discovery skips tied parameters
        raise ValueError("set_gradients: a parameter's gradient belongs to two blocks")
    torch._foreach_copy_(grads, parts)
    if scale is not None:
        torch._foreach_mul_(grads, scale)


def _same_padding(kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    """F.pad widths ``(left, right, top, bottom)`` that PyTorch uses for ``padding='same'``."""
    pads: list[int] = []
    for k, d in zip(reversed(kernel), reversed(dilation), strict=True):
        total = d * (k - 1)
        pads += [total // 2, total - total // 2]
    return pads[0], pads[1], pads[2], pads[3]


def refuse_grouped(module: nn.Conv1d | nn.Conv2d) -> None:
    """Refuse a grouped convolution (its weight is not one Kronecker-factored block).

    Raises:
        UnsupportedLayerError: ``groups != 1``.
    """
    if module.groups != 1:
        raise UnsupportedLayerError(
            f"grouped convolution (groups={module.groups}) is not supported; add its name "
            "to skip_layers to train it with the plain gradient"
        )


class Conv2dBlock(KroneckerBlock):
    """``nn.Conv2d`` with the KFC approximation (Grosse & Martens 2016).

    Rows are output positions of every example; ``a`` is the input patch seen by one output
    position, in PyTorch's weight order ``(c_in, kh, kw)``. Supports stride, dilation, integer,
    ``'same'``/``'valid'`` padding and every ``padding_mode``; grouped convolutions are refused.
    """

    kind = "Conv2d"
    batched_dims = 4

    def __init__(self, module: nn.Conv2d) -> None:
        refuse_grouped(module)
        super().__init__(module)
        self.conv = module
        kernel = (int(module.kernel_size[0]), int(module.kernel_size[1]))
        dilation = (int(module.dilation[0]), int(module.dilation[1]))
        if isinstance(module.padding, str):
            self.pad = _same_padding(kernel, dilation) if module.padding == "same" else (0, 0, 0, 0)
        else:
            ph, pw = int(module.padding[0]), int(module.padding[1])
            self.pad = (pw, pw, ph, ph)
        self.kernel = kernel
        self.dilation = dilation
        self.stride = (int(module.stride[0]), int(module.stride[1]))
        # Stride-1 index plans per input size: computed once, so the forward hook of a
        # factor-update step reads nothing back from the device.
        self.gram_plans = ShiftedGramPlans()

    def padded_input(self, x: Tensor) -> Tensor:
        """The input as the convolution sees it after padding (``padding_mode`` respected)."""
        if not any(self.pad):
            return x
        mode = self.conv.padding_mode
        return F.pad(x, self.pad, mode="constant" if mode == "zeros" else mode)

    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ a aᵀ`` over every output position's patch (plus the bias 1)."""
        if x.dim() == 3:  # unbatched (C, H, W)
            x = x.unsqueeze(0)
        zero_padded = self.conv.padding_mode == "zeros"
        total, rows = conv2d_patch_gram(
            x if zero_padded else self.padded_input(x),
            kernel=self.kernel,
            dilation=self.dilation,
            stride=self.stride,
            pad=self.pad if zero_padded else (0, 0, 0, 0),
            with_ones=self.has_bias,
            plans=self.gram_plans,
            precision=self.precision,
            dtype=dtype,
        )
        return FactorStatistic(total, rows, int(x.shape[0]))

    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over every output position of every example."""
        if dy.dim() == 3:
            dy = dy.unsqueeze(0)
        total, rows = pixel_gram(dy, dtype, with_ones=False, precision=self.precision)
        return FactorStatistic(total, rows, int(dy.shape[0]))


class Conv1dBlock(Conv2dBlock):
    """``nn.Conv1d`` as a Conv2d of height 1: the same patches, rows and factors.

    An input ``(N, C, L)`` is ``(N, C, 1, L)`` to a ``(1, k)`` kernel; the weight
    ``(out, in, k)`` flattens to the same ``(c_in, k)`` patch order.
    """

    kind = "Conv1d"
    batched_dims = 3

    def __init__(self, module: nn.Conv1d) -> None:
        refuse_grouped(module)
        KroneckerBlock.__init__(self, module)
        self.conv = module  # type: ignore[assignment]  # padding_mode is all it is read for
        kernel, dilation = (1, int(module.kernel_size[0])), (1, int(module.dilation[0]))
        if isinstance(module.padding, str):
            self.pad = _same_padding(kernel, dilation) if module.padding == "same" else (0, 0, 0, 0)
        else:
            self.pad = (int(module.padding[0]), int(module.padding[0]), 0, 0)
        self.kernel, self.dilation = kernel, dilation
        self.stride = (1, int(module.stride[0]))
        self.gram_plans = ShiftedGramPlans()

    def a_statistic(self, x: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ a aᵀ`` over every output position's patch (plus the bias 1)."""
        x = x.unsqueeze(0) if x.dim() == 2 else x  # unbatched (C, L)
        return super().a_statistic(x.unsqueeze(2), dtype)

    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over every output position of every example."""
        dy = dy.unsqueeze(0) if dy.dim() == 2 else dy
        return super().g_statistic(dy.unsqueeze(2), dtype)


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

    def grad_matrix(self) -> Tensor:
        """``∇Wᵀ`` with the bias gradient as the last column, ``(d_G, d_A)``."""
        grad = self.weight.grad
        assert grad is not None
        matrix = grad.t()
        if self.bias is not None:
            assert self.bias.grad is not None
            return torch.cat([matrix, self.bias.grad.reshape(-1, 1)], dim=1)
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
