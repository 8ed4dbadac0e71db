"""Convolution blocks: ``nn.Conv2d`` and ``nn.Conv1d`` with the KFC approximation.

A row is one output position of one example and ``a`` the input patch it sees (im2col), in
PyTorch's weight order ``(c_in, kh, kw)``; see :mod:`dkfac.curvature.blocks` for the
conventions and :mod:`dkfac.curvature.factors` for the patch Grams.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.curvature.blocks import FactorStatistic, KroneckerBlock, UnsupportedLayerError
from dkfac.curvature.factors import conv2d_patch_gram, conv2d_patch_grams, im2col_asked
from dkfac.curvature.gram import pixel_gram, pixel_grams
from dkfac.curvature.shifted_gram_plan import ShiftedGramPlans


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
            im2col=im2col_asked(self.patches),
        )
        return FactorStatistic(total, rows, int(x.shape[0]))

    def a_batch_key(self, x: Tensor) -> Hashable | None:
        """Stride-1, zero-padded inputs of one shape share their Grams' launches.

        Strided ones are formed alone in the hook, as their shapes are (a network's strided
        layers differ): held, they would only take their part of the byte budget.
        """
        if x.dim() != 4 or self.stride != (1, 1) or self.conv.padding_mode != "zeros":
            return None
        if not self._a_statistic_of(Conv2dBlock):  # Conv1d's, a user's subclass
            return None
        # A 1x1 convolution's pixel Grams are formed per layout (strides): part of the key.
        layout = x.stride() if self.kernel == (1, 1) and not any(self.pad) else None
        settings = (
            self.kernel,
            self.dilation,
            self.pad,
            self.has_bias,
            self.precision,
            self.patches,
        )
        return ("conv2d", settings, layout, tuple(x.shape), x.dtype, x.device)

    def a_statistics(self, xs: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`a_statistic` of each input, in the launches of one (conv2d_patch_grams)."""
        totals, rows = conv2d_patch_grams(
            xs,
            kernel=self.kernel,
            dilation=self.dilation,
            stride=self.stride,
            pad=self.pad,
            with_ones=self.has_bias,
            plans=self.gram_plans,
            precision=self.precision,
            dtype=dtype,
            im2col=im2col_asked(self.patches),
        )
        examples = int(xs[0].shape[0])
        return [FactorStatistic(total, rows, examples) for total in totals]

    def g_statistic(self, dy: Tensor, dtype: torch.dtype) -> FactorStatistic:
        """``Σ dy dyᵀ`` over every output position of every example."""
        if dy.dim() == 3:
            dy = dy.unsqueeze(0)
        total, rows = pixel_gram(dy, dtype, with_ones=False, precision=self.precision)
        return FactorStatistic(total, rows, int(dy.shape[0]))

    def g_batch_key(self, dy: Tensor) -> Hashable | None:
        """Batched output gradients of one shape and layout share one product (pixel Grams)."""
        if dy.dim() != 4 or not self._g_statistic_of(Conv2dBlock):  # Conv1d's, a user's
            return None
        return ("conv2d", self.precision, dy.stride(), tuple(dy.shape), dy.dtype, dy.device)

    def g_statistics(self, dys: Sequence[Tensor], dtype: torch.dtype) -> list[FactorStatistic]:
        """:meth:`g_statistic` of each output gradient, in one product (:func:`pixel_grams`)."""
        totals, rows = pixel_grams(dys, dtype, with_ones=False, precision=self.precision)
        examples = int(dys[0].shape[0])
        return [FactorStatistic(total, rows, examples) for total in totals]


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
