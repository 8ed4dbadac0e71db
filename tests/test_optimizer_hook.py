"""``KFACPreconditioner(model, optimizer=opt)``: K-FAC runs inside ``opt.step()``.

The oracle is the manual loop (``pre.step()`` then ``opt.step()``) on the same data, which the
rest of the suite checks against float64 formulas: attached, the parameters must be the same
bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac

DT = torch.float64


def model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(6, 5, generator=gen, dtype=DT), torch.randint(0, 3, (6,), generator=gen))
        for _ in range(count)
    ]


def train(attached: bool, schedule: bool = False, **kw: Any) -> list[torch.Tensor]:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    if attached:
        pre = dkfac.KFACPreconditioner(net, optimizer=opt, kl_clip=0.01, **kw)
    else:
        lr = lambda _: float(opt.param_groups[0]["lr"])  # noqa: E731
        pre = dkfac.KFACPreconditioner(net, lr=lr, kl_clip=0.01, **kw)
    for x, y in batches(5):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if not attached:
            pre.step()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    assert pre.steps == 5
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("schedule", [False, True])
def test_an_attached_preconditioner_equals_the_manual_loop(schedule: bool) -> None:
    """KL clipping reads the optimizer's current rate, which the scheduler halves."""
    attached, manual = train(True, schedule), train(False, schedule)
    assert all(torch.equal(a, m) for a, m in zip(attached, manual, strict=True))
    # The clipping is active here (else the rate would not matter): a fixed lr differs.
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    pre = dkfac.KFACPreconditioner(net, optimizer=opt, lr=5.0, kl_clip=0.01)
    for x, y in batches(5):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    assert pre.steps == 5
    assert not all(torch.equal(a, p) for a, p in zip(attached, net.parameters(), strict=True))


def test_an_attached_preconditioner_follows_the_accumulation_between_optimizer_steps() -> None:
    """No ``accumulation_steps`` given and 3, 1, then 2 micro-batches per ``opt.step()`` (each
    loss divided by their number, as a Trainer does). Oracle: the manual loop given one batch of
    all of a step's examples (a mean loss: the pooled statistics and the averaged gradient are
    that batch's), which the rest of the suite checks against float64 formulas."""
    counts = [3, 1, 2]
    micro = batches(sum(counts))
    net, oracle = model(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.2, momentum=0.9)
    exact: dict[str, Any] = {"kl_clip": 0.01, "factor_dtype": DT, "inv_dtype": DT}
    pre = dkfac.KFACPreconditioner(net, optimizer=opt, **exact)
    oracle_pre = dkfac.KFACPreconditioner(oracle, lr=0.2, **exact)
    start = 0
    for count in counts:
        step = micro[start : start + count]
        start += count
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "accumulation" warning: nothing was promised
            for x, y in step:
                (F.cross_entropy(net(x), y) / count).backward()
            opt.step()
        oracle_opt.zero_grad()
        x, y = (torch.cat(parts) for parts in zip(*step, strict=True))
        F.cross_entropy(oracle(x), y).backward()
        oracle_pre.step()
        oracle_opt.step()
    assert pre.steps == 3
    for mine, theirs in zip(net.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    # A number given is a promise, checked as in the manual loop.
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    dkfac.KFACPreconditioner(net, optimizer=opt, accumulation_steps=1)
    for x, y in micro[:2]:
        (F.cross_entropy(net(x), y) / 2).backward()
    with pytest.warns(RuntimeWarning, match=r"saw 2 backward pass\(es\) .* accumulation_steps=1"):
        opt.step()


def test_gradient_scaler_step_runs_kfac_after_unscaling() -> None:
    def run(attached: bool) -> list[torch.Tensor]:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        options: dict[str, Any] = {"grad_scaler": scaler, "kl_clip": None}
        pre = dkfac.KFACPreconditioner(net, optimizer=opt if attached else None, **options)
        for x, y in batches(3):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(net(x), y)).backward()
            scaler.unscale_(opt)
            if not attached:
                pre.step()
            scaler.step(opt)
            scaler.update()
        assert pre.steps == 3
        return [p.detach().clone() for p in net.parameters()]

    assert all(torch.equal(a, m) for a, m in zip(run(True), run(False), strict=True))


def test_a_manual_step_is_refused_and_remove_detaches() -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = dkfac.KFACPreconditioner(net, optimizer=opt)
    x, y = batches(1)[0]
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(RuntimeError, match="attached to an optimizer"):
        pre.step()
    pre.remove()
    grads = [p.grad.clone() for p in net.parameters()]
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()  # plain SGD now: the raw gradients
    for p, g, b in zip(net.parameters(), grads, before, strict=True):
        assert torch.equal(p.detach(), b.add(g, alpha=-0.1))
    assert pre.steps == 0


@pytest.mark.parametrize("keyword", [False, True])
def test_a_step_given_a_closure_runs_kfac_after_the_closure(keyword: bool) -> None:
    """``opt.step(closure)`` (Lightning's automatic optimization): the gradients exist only
    once the closure has run inside the step; K-FAC must precondition them, as the manual
    loop does."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    pre = dkfac.KFACPreconditioner(net, optimizer=opt, kl_clip=0.01)
    for x, y in batches(5):

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        returned = opt.step(closure=closure) if keyword else opt.step(closure)
        assert returned is not None and returned.dim() == 0  # the closure's loss comes back
    assert pre.steps == 5
    manual = train(False)
    assert all(torch.equal(a, m) for a, m in zip(net.parameters(), manual, strict=True))


def test_what_cannot_be_attached_is_refused() -> None:
    net = model()
    with pytest.raises(ValueError, match=r"expected a torch\.optim\.Optimizer"):
        dkfac.KFACPreconditioner(net, optimizer="sgd")  # type: ignore[arg-type]
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds none of the preconditioned layers' parameters"):
        dkfac.KFACPreconditioner(net, optimizer=other)
    with pytest.raises(ValueError, match="LBFGS is not allowed: it evaluates its closure"):
        dkfac.KFACPreconditioner(net, optimizer=torch.optim.LBFGS(net.parameters()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer is not allowed with adaptive"):
        dkfac.KFACPreconditioner(
            net, optimizer=opt, adaptive=dkfac.AdaptiveOptions(loss_fn=F.cross_entropy)
        )
