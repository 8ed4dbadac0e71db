"""Layer hooks only in factor windows (``dkfac.layer_hooks``).

Oracle: the factors of a window after the hooks were removed and attached again, against
the dense float64 formulas from the layer's own input and the gradient of its own output
(autograd on an explicit function of the weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from test_oracle_numerics import DT, batch_loss, make_pre, sgd_


def test_layer_hooks_are_attached_in_factor_windows_only_and_first_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    pre = make_pre(model, factor_update_steps=2, inv_update_steps=2, factor_decay=0.0)
    # Registered after dkfac's: it replaces the layer's output, and dkfac's hook must still
    # run first, so G is the gradient of the layer's own output, once attached again too.
    users = model[0].register_forward_hook(lambda module, inputs, output: 3 * output)
    for step in range(3):
        factor_window = step % 2 == 0
        assert bool(model[2]._forward_hooks) == factor_window
        assert len(model[0]._forward_hooks) == (2 if factor_window else 1)
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(5, 3, dtype=DT, generator=generator)
        t = torch.randint(0, 2, (5,), generator=generator)
        w0, b0, w2, b2 = (
            model[i].get_parameter(n).detach().clone() for i in (0, 2) for n in ("weight", "bias")
        )
        batch_loss(model(x), t).backward()
        pre.step()
        sgd_(model)
    # The last window came after the hooks were removed and attached again.
    own = F.linear(x, w0, b0).requires_grad_(True)
    loss = batch_loss(F.linear(torch.tanh(3 * own), w2, b2), t)
    (dy,) = torch.autograd.grad(loss, own)
    rows = torch.cat([x, torch.ones(5, 1, dtype=DT)], dim=1)
    a, g = pre.factors()["0"]
    torch.testing.assert_close(a, rows.t() @ rows / 5, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, 5 * dy.t() @ dy, rtol=1e-12, atol=1e-14)
    users.remove()
    pre.remove()
    assert all(not module._forward_hooks for module in model.modules())
