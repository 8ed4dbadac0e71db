"""Factor arithmetic: Gram matrices of layer statistics and the running average.

These are the hot loops of K-FAC (an im2col Gram costs several forward passes of the layer),
so they avoid copies and exploit symmetry where PyTorch lets them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gram_with_ones(rows: Tensor, with_ones: bool) -> Tensor:
    """``Σ_r [x_r, 1][x_r, 1]ᵀ`` for the rows ``x_r`` of a 2-D tensor.

    The appended constant is never materialised: its row of the Gram is the column sum and its
    corner the row count, so no ``(R, d+1)`` copy of the input is made.
    """
    core = rows.t() @ rows
    if not with_ones:
        return core
    d = rows.shape[1]
    out = rows.new_empty(d + 1, d + 1)
    out[:d, :d] = core
    column_sums = rows.sum(dim=0)
    out[d, :d] = column_sums
    out[:d, d] = column_sums
    out[d, d] = rows.shape[0]
    return out


def conv2d_patch_gram(x: Tensor, *, kernel: tuple[int, int], dilation: tuple[int, int],
                      stride: tuple[int, int], pad: tuple[int, int, int, int],
                      with_ones: bool) -> tuple[Tensor, int]:
    """``Σ a aᵀ`` over the im2col patches ``a`` of a 2-D convolution, and the number of patches.

    Args:
        x: input ``(N, C, H, W)``.
        kernel: ``(kh, kw)``.
        dilation: ``(dh, dw)``.
        stride: ``(sh, sw)``.
        pad: zero padding ``(left, right, top, bottom)`` as for ``F.pad``.
        with_ones: append a constant 1 to every patch (the bias input).

    Returns:
        The ``(C·kh·kw [+1])`` square Gram in PyTorch's ``(c, i, j)`` patch order, and the
        number of patches ``N·H_out·W_out``.
    """
    if any(pad):
        x = F.pad(x, pad)
    patches = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (N, C·kh·kw, L)
    flat = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return gram_with_ones(flat, with_ones), flat.shape[0]


def running_average(running: Tensor | None, batch: Tensor, decay: float) -> Tensor:
    """``ε·running + (1−ε)·batch``; the first estimate is the batch itself.

    A batch estimate with a NaN or Inf is not folded in (the running average keeps its value),
    and a running average that is not finite yet counts as "no estimate": this is decided on the
    device, with no host synchronisation.
    """
    batch_ok = torch.isfinite(batch).all()
    if running is None:
        return torch.where(batch_ok, batch, torch.full_like(batch, float("nan")))
    updated = running * decay + batch * (1.0 - decay)
    running_ok = torch.isfinite(running).all()
    return torch.where(batch_ok, torch.where(running_ok, updated, batch), running)
