"""Layer hooks only in factor windows (``dkfac.layer_hooks``).

Oracle: the factors of a window after the hooks were removed and attached again, against
the dense float64 formulas from the layer's own input and the gradient of its own output
(autograd on an explicit function of the weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dkfac
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


def hooked(model: nn.Module) -> list[bool]:
    """Whether each Linear layer of ``model`` has a forward hook."""
    return [bool(m._forward_hooks) for m in model.modules() if isinstance(m, nn.Linear)]


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def one_step(model: nn.Module, pre: dkfac.KFACPreconditioner, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(5, 3, dtype=DT, generator=generator)
    batch_loss(model(x), torch.randint(0, 2, (5,), generator=generator)).backward()
    pre.step()
    sgd_(model)


def test_a_compiled_model_keeps_its_layer_hooks_outside_factor_windows() -> None:
    """Adding or removing a hook would recompile the model's graph; the steps equal eager's."""
    model, eager = two_layers(), two_layers()
    compiled = torch.compile(model, backend="aot_eager")
    options = {"factor_update_steps": 2, "inv_update_steps": 2}
    pres = [make_pre(net, **options) for net in (compiled, eager)]
    for step in range(4):
        assert hooked(model) == [True, True]
        assert hooked(eager) == [step % 2 == 0] * 2
        for net, pre in zip((compiled, eager), pres, strict=True):
            one_step(net, pre, step)
    for mine, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    for pre in pres:
        pre.remove()
    assert hooked(model) == [False, False]


def test_a_loaded_state_attaches_the_hooks_as_its_step_needs_them() -> None:
    """The run that loads another's state at step 3, then at step 4, continues as that one
    does (its oracle: the same single-process run), hooks only in its factor windows."""
    options = {"factor_update_steps": 2, "inv_update_steps": 2}
    model = two_layers()
    pre = make_pre(model, **options)
    for step in range(3):
        one_step(model, pre, step)
    for restored_step in (3, 4):
        twin = two_layers()
        twin.load_state_dict(model.state_dict())
        twin_pre = make_pre(twin, **options)
        assert hooked(twin) == [True, True]  # its own step 0 is a factor step
        twin_pre.load_state_dict(pre.state_dict())
        assert hooked(twin) == [restored_step % 2 == 0] * 2
        one_step(twin, twin_pre, restored_step)
        one_step(model, pre, restored_step)
        assert hooked(twin) == hooked(model) == [restored_step % 2 == 1] * 2
        for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        twin_pre.remove()
    pre.remove()
