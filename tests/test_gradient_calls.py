"""Backward calls that compute no gradient of a layer add nothing to its ``G`` (docs/math.md).

A gradient penalty (WGAN-GP, R1, a physics-informed loss) differentiates the model with
respect to its input with ``torch.autograd.grad`` before the loss's own backward call. That
call runs through the layers, and their output-gradient hooks fire with its vector-Jacobian
products, which are no loss gradients. Checked against a float64 oracle written here (one
example at a time, each example's whole objective, penalty included, differentiated with
autograd with respect to the layers' outputs), for a penalty made by ``torch.autograd.grad``
and by ``backward(inputs=...)``, with the loss's gradients accumulated by ``.backward()`` or
returned by ``torch.autograd.grad(loss, parameters)``, formed in the hooks or held. And the
engine query itself: what it answers for each kind of call, a replaced accumulator, frozen
parameters and a weight that is not a leaf, each layer asked once per call, nothing held after
``remove()``. A penalty through a checkpointed segment; adversarial training (under
accumulation, and changing its input in place with held statistics); a GAN's critic frozen for
the generator's step; and parameters substituted by ``torch.func`` (statistics kept).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dkfac
from dkfac.autograd_engine import RETURNED_GRADIENTS, LayerGradients, accumulators_below
from test_oracle_numerics import assert_close
from test_sat_out_passes import assert_factors_equal, factors_of, rows
from test_shared_layers import F64

DT = torch.float64
#: The penalty's weight: large, so that its share of each output gradient is not small.
PENALTY = 0.7


class Critic(nn.Module):
    """Two layers with a nonlinearity between: the input gradient depends on both weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def input_gradient(output: torch.Tensor, x: torch.Tensor, how: str) -> torch.Tensor:
    """``∂(Σ output)/∂x``, kept differentiable, made as a user's penalty makes it."""
    if how == "grad":
        (gradient,) = torch.autograd.grad(output.sum(), x, create_graph=True)
        return gradient
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_graph with backward(): a reference cycle
        output.sum().backward(inputs=[x], create_graph=True)
    assert x.grad is not None
    gradient, x.grad = x.grad, None
    return gradient


def objective(model: Critic, x: torch.Tensor, y: torch.Tensor, penalty_by: str) -> torch.Tensor:
    """The mean over examples of each example's cross-entropy plus its penalised gradient."""
    x = x.detach().requires_grad_(True)
    output = model(x)
    gradient = input_gradient(output, x, penalty_by)
    return F.cross_entropy(output, y) + PENALTY * gradient.pow(2).sum(1).mean()


def oracle(
    model: Critic, x: torch.Tensor, y: torch.Tensor, penalty: float = PENALTY
) -> dict[str, torch.Tensor]:
    """A and G of both layers, one example at a time: ``G = Σ g gᵀ / N``, ``g`` the gradient
    of the example's own objective with respect to the layer's output (every path)."""
    a_rows: dict[str, list[torch.Tensor]] = {"body": [], "head": []}
    g_rows: dict[str, list[torch.Tensor]] = {"body": [], "head": []}
    for n in range(x.shape[0]):
        xn = x[n : n + 1].detach().requires_grad_(True)
        body_out = model.body(xn)
        head_in = torch.tanh(body_out)
        head_out = model.head(head_in)
        (gradient,) = torch.autograd.grad(head_out.sum(), xn, create_graph=True)
        loss = F.cross_entropy(head_out, y[n : n + 1]) + penalty * gradient.pow(2).sum()
        g_body, g_head = torch.autograd.grad(loss, (body_out, head_out))
        a_rows["body"].append(rows(xn.detach()))
        a_rows["head"].append(rows(head_in.detach()))
        g_rows["body"].append(g_body)
        g_rows["head"].append(g_head)
    want = {}
    for name in a_rows:
        a, g = torch.cat(a_rows[name]), torch.cat(g_rows[name])
        want[f"{name}/a"], want[f"{name}/g"] = a.t() @ a / a.shape[0], g.t() @ g / g.shape[0]
    return want


@pytest.mark.parametrize("penalty_by", ["grad", "backward_inputs"])
@pytest.mark.parametrize("loss_by", ["backward", "grad"])
@pytest.mark.parametrize("batched", [False, True])  # statistics formed in the hooks or held
def test_a_gradient_penalty_adds_nothing_to_g_and_the_loss_everything(
    penalty_by: str, loss_by: str, batched: bool
) -> None:
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, batched_statistics=batched, **F64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (6,), generator=g)
    loss = objective(model, x, y, penalty_by)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if loss_by == "backward":
            loss.backward()
        else:  # gradients returned, then given to the optimizer as a user's own loop does
            parameters = list(model.parameters())
            for parameter, gradient in zip(
                parameters, torch.autograd.grad(loss, parameters), strict=True
            ):
                parameter.grad = gradient
    # Only a call that returns the layers' gradients is named (the penalty's returns x's).
    returned = [w for w in caught if str(w.message) == RETURNED_GRADIENTS]
    assert len(returned) == (1 if loss_by == "grad" else 0)
    pre.step()
    assert_factors_equal(factors_of(pre), oracle(model, x, y))
    pre.remove()


def test_a_gradient_norm_logged_by_autograd_grad_is_counted_in_g_with_a_warning() -> None:
    """``torch.autograd.grad(loss, parameters)`` for a log, then ``loss.backward()``: both
    calls compute the layers' gradients, and dkfac cannot tell this from two losses of one
    forward pass; it counts both, ``G`` twice the one loss's (oracle: float64, one example at
    a time), and says so once per preconditioner."""
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, **F64)
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):  # the second for the warning's once
            x = torch.randn(6, 5, generator=g, dtype=DT)
            y = torch.randint(0, 3, (6,), generator=g)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            logged = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            loss.backward()
            assert all(
                torch.equal(a, p.grad) for a, p in zip(logged, model.parameters(), strict=True)
            )
            pre.step()
            if step > 0:  # a running average from here on
                continue
            want = oracle(model, x, y, penalty=0.0)
            got = factors_of(pre)
            for key in ("body/a", "head/a"):
                assert_close(got[key], want[key])
            for key in ("body/g", "head/g"):
                assert_close(got[key], 2 * want[key])
    assert sum(str(w.message) == RETURNED_GRADIENTS for w in caught) == 1
    assert all(
        w.category is dkfac.ReturnedGradientsWarning
        for w in caught
        if str(w.message) == RETURNED_GRADIENTS
    )
    pre.remove()


def test_the_penalty_changes_g_so_the_oracle_can_tell_a_bogus_one() -> None:
    """The penalty's own output gradients, added as the hooks used to, change ``G``."""
    model = Critic().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=DT, requires_grad=True)
    want = oracle(model, x, torch.randint(0, 3, (6,), generator=g))
    body_out = model.body(x)
    (vjp,) = torch.autograd.grad(model.head(torch.tanh(body_out)).sum(), body_out)
    bogus = want["body/g"] + vjp.t() @ vjp / x.shape[0]
    assert (bogus - want["body/g"]).abs().max() > 0.1 * want["body/g"].abs().max()


class Probe:
    """Asks :class:`LayerGradients` from inside a hook on a layer's output."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.gradients = LayerGradients()
        self.answers: list[bool] = []

    def output(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        found = accumulators_below(out, list(self.layer.parameters()))
        out.register_hook(  # type: ignore[no-untyped-call]
            lambda grad: self.answers.append(self.gradients.computed("layer", found))
        )
        return out


def test_the_engine_query_tells_each_kind_of_backward_call_apart() -> None:
    lin = nn.Linear(4, 3)
    probe = Probe(lin)
    x = torch.randn(5, 4, requires_grad=True)
    probe.output(x).pow(2).sum().backward()
    torch.autograd.grad(probe.output(x).pow(2).sum(), x)
    torch.autograd.grad(probe.output(x).pow(2).sum(), list(lin.parameters()))
    torch.autograd.grad(probe.output(x).pow(2).sum(), [lin.bias])  # the layer's bias only
    probe.output(x).pow(2).sum().backward(inputs=[x])
    probe.output(x).pow(2).sum().backward(inputs=[lin.weight])
    assert probe.answers == [True, False, True, True, False, True]


def test_the_accumulators_are_found_below_a_layers_output_or_said_unknown() -> None:
    conv, lin = nn.Conv2d(2, 3, 3), nn.Linear(4, 3)
    lin.bias.requires_grad_(False)
    for layer, x in ((conv, torch.randn(2, 2, 5, 5)), (lin, torch.randn(2, 7, 4))):
        found = accumulators_below(layer(x), list(layer.parameters()))
        wanted = [p for p in layer.parameters() if p.requires_grad]
        assert found is not None and [node.variable for node in found] == wanted
    lin.requires_grad_(True)
    copies = {k: v.detach().clone().requires_grad_(True) for k, v in lin.named_parameters()}
    substituted = torch.func.functional_call(lin, copies, (torch.randn(2, 4),))
    assert accumulators_below(substituted, list(lin.parameters())) is None  # not known
    base = torch.randn(3, 4, requires_grad=True)
    weight = base * 2.0  # a weight made from another tensor: no accumulator of its own
    assert accumulators_below(torch.randn(2, 4) @ weight.t(), [weight]) is None
    frozen = nn.Linear(4, 3).requires_grad_(False)
    assert (
        accumulators_below(frozen(torch.randn(2, 4, requires_grad=True)), [frozen.weight]) is None
    )
    # The input's own graph is not searched: a wide one would spend the budget (under
    # autocast a bfloat16 input joined from many parts, the weight two casts away).
    parts = [torch.randn(2, 4, requires_grad=True).to(torch.bfloat16) * 1.0 for _ in range(12)]
    joined = torch.cat(parts, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(joined)
    found = accumulators_below(out, list(lin.parameters()), joined.grad_fn)
    assert found is not None and [node.variable for node in found] == [lin.bias, lin.weight]


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(3, 5)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(z))


@pytest.mark.parametrize("generator_first", [True, False])
def test_a_critic_frozen_for_the_generators_step_gets_g_from_its_own_loss_alone(
    generator_first: bool,
) -> None:
    """A GAN step: the generator's loss backpropagates through the frozen critic (no critic
    gradient); the critic's factors come from its own loss on real and generated examples."""
    critic, generator = Critic().double(), Generator().double()
    pre = dkfac.KFACPreconditioner(critic, **F64)
    g = torch.Generator().manual_seed(4)
    real = torch.randn(3, 5, generator=g, dtype=DT)
    z = torch.randn(3, 3, generator=g, dtype=DT)
    labels = torch.tensor([0, 0, 0, 1, 1, 1])  # class 0: real, class 1: generated

    def generator_step() -> None:
        critic.requires_grad_(False)
        F.cross_entropy(critic(generator(z)), labels[:3]).backward()  # to look real
        critic.requires_grad_(True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one micro-batch: the critic's
        if generator_first:
            generator_step()
        examples = torch.cat([real, generator(z).detach()])
        F.cross_entropy(critic(examples), labels).backward()
        if not generator_first:
            generator_step()
        pre.step()
    # A too: a frozen critic's forward is no training call of its layers (no gradient).
    assert_factors_equal(factors_of(pre), oracle(critic, examples, labels, penalty=0.0))
    pre.remove()


@pytest.mark.parametrize("how", ["functional_call", "torch_func_grad"])
def test_gradients_of_substituted_parameters_keep_their_statistics(how: str) -> None:
    """``torch.func``: the call runs on parameters other than the module's own (or under a
    transform where no accumulator can be found); dkfac cannot ask, and keeps every call's
    statistics, as before."""
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, **F64)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(6, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}

    def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    if how == "functional_call":
        returned = torch.autograd.grad(loss_of(params), list(params.values()))
        grads = dict(zip(params, returned, strict=True))
    else:
        grads = torch.func.grad(loss_of)(params)
    for name, parameter in model.named_parameters():
        parameter.grad = grads[name]
    pre.step()
    assert_factors_equal(factors_of(pre), oracle(model, x, y, penalty=0.0))
    pre.remove()


def test_an_adversarial_examples_input_gradient_is_no_micro_batch_and_adds_no_g() -> None:
    """Adversarial training: an input-gradient call on a clean pass crafts each micro-batch's
    examples; only the adversarial passes' loss gradients reach ``G``, and the window has
    ``accumulation_steps`` micro-batches (no warning). The clean passes are training-mode
    forward passes no loss reaches: their inputs are in ``A``, as documented."""
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=2, **F64)
    g = torch.Generator().manual_seed(3)
    crafted, inputs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            x = torch.randn(3, 5, generator=g, dtype=DT, requires_grad=True)
            y = torch.randint(0, 3, (3,), generator=g)
            (toward,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)
            adversarial = (x + 0.3 * toward.sign()).detach()
            (F.cross_entropy(model(adversarial), y) / 2).backward()
            crafted.append((adversarial, y))
            inputs += [x.detach(), adversarial]
        pre.step()
    got = factors_of(pre)
    for name in ("body", "head"):
        g_rows = []
        for adversarial, y in crafted:
            for n in range(adversarial.shape[0]):
                body_out = model.body(adversarial[n : n + 1])
                head_out = model.head(torch.tanh(body_out))
                loss = F.cross_entropy(head_out, y[n : n + 1])
                (out,) = torch.autograd.grad(loss, body_out if name == "body" else head_out)
                g_rows.append(out)
        rows_g = torch.cat(g_rows)
        assert_close(got[f"{name}/g"], rows_g.t() @ rows_g / rows_g.shape[0], what=name)
        layer_in = [i if name == "body" else torch.tanh(model.body(i)).detach() for i in inputs]
        rows_a = rows(torch.cat(layer_in))
        assert_close(got[f"{name}/a"], rows_a.t() @ rows_a / rows_a.shape[0], what=name)
    pre.remove()


def test_an_input_changed_in_place_after_its_input_gradient_call_keeps_its_statistics() -> None:
    """The fast gradient sign method in place: the held inputs of the clean pass are formed
    when the input-gradient call begins, before the attack changes them (batched)."""
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, batched_statistics=True, **F64)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=g, dtype=DT, requires_grad=True)
    y = torch.randint(0, 3, (6,), generator=g)
    clean = x.detach().clone()
    (toward,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)
    with torch.no_grad():
        x.add_(0.3 * toward.sign())
    F.cross_entropy(model(x), y).backward()
    pre.step()  # no HeldTensorChangedError
    got, want = factors_of(pre), oracle(model, x.detach(), y, penalty=0.0)
    a_rows = rows(torch.cat([clean, x.detach()]))
    assert_close(got["body/a"], a_rows.t() @ a_rows / a_rows.shape[0], what="body/a")
    assert_close(got["body/g"], want["body/g"], what="body/g")
    pre.remove()


def test_each_layer_is_asked_once_per_backward_call() -> None:
    lin = nn.Linear(4, 3)
    probe = Probe(lin)
    will_run = probe.gradients._will_run
    assert will_run is not None
    asked: list[object] = []

    def counted(node: object) -> bool:
        asked.append(node)
        return will_run(node)

    probe.gradients._will_run = counted
    x = torch.randn(5, 4, requires_grad=True)
    (probe.output(x) + probe.output(x) + probe.output(x)).sum().backward()  # three hooks
    assert probe.answers == [True] * 3 and len(asked) == 1  # the weight's accumulator, once
    torch.autograd.grad(probe.output(x).sum() + probe.output(x).sum(), x)
    # Not run: the first hook asks about the weight's and the bias's accumulators, then kept.
    assert probe.answers[3:] == [False, False] and len(asked) == 3


def test_a_parameter_frozen_after_its_pass_can_be_swapped_within_the_window() -> None:
    """Nothing holds an accumulator beyond its pass's graph: ``swap_tensors`` refuses a
    parameter that needs no gradient while an accumulator of it is alive elsewhere."""
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=2, **F64)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    (F.cross_entropy(model(x), y) / 2).backward()  # the window stays open
    weight = model.body.weight.requires_grad_(False)
    torch.utils.swap_tensors(weight, nn.Parameter(weight.detach().clone(), requires_grad=False))
    pre.remove()


@pytest.mark.parametrize("captures_generator", [True, False])
def test_a_pass_answers_alike_on_every_worker_whatever_it_captures(
    captures_generator: bool,
) -> None:
    """A generator's step through a frozen critic computes the generator's gradient: the
    pass's outputs say so on a worker that captures the generator's layer or not (DP-KFAC)."""
    model = nn.Sequential(Generator(), Critic()).double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=1, **F64)
    if not captures_generator:
        captures = pre._strategy.captures
        pre._strategy.captures = lambda layer: layer.name != "0.net" and captures(layer)  # type: ignore[method-assign]
    model[1].requires_grad_(False)
    model(torch.randn(3, 3, dtype=DT)).sum().backward()
    assert pre._usage._passes._computing  # one computing call, seen through the outputs
    pre.remove()


class CheckpointedCritic(Critic):
    """``Critic`` with its body recomputed in the backward call (not reentrant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(lambda t: torch.tanh(self.body(t)), x, use_reentrant=False)
        return self.head(hidden)  # type: ignore[no-any-return]


def test_a_penalty_through_a_checkpointed_segment_under_accumulation() -> None:
    """The penalty's call recomputes the segment too; each micro-batch is one loss's call."""
    model = CheckpointedCritic().double()
    pre = dkfac.KFACPreconditioner(model, accumulation_steps=2, **F64)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (6,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # two micro-batches, as configured
        for half in (slice(0, 3), slice(3, 6)):
            (objective(model, x[half], y[half], "grad") / 2).backward()
        pre.step()
    assert_factors_equal(factors_of(pre), oracle(model, x, y))
    pre.remove()


def two_loss_factors(how: str) -> tuple[dict[str, torch.Tensor], list[warnings.WarningMessage]]:
    """Factors after one window of two losses of one forward pass, and the warnings raised.

    ``how``: ``"summed"`` (one backward call of their sum), ``"separate"`` (each backpropagated,
    the first with ``retain_graph=True``), ``"first"``/``"second"`` (one loss alone), or
    ``"two_passes"`` (each loss from a forward pass of its own: two micro-batches).
    """
    model = Critic().double()
    pre = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **F64)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (6,), generator=g)

    def losses(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.cross_entropy(output, y), output.pow(3).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = losses(model(x))
        if how == "summed":
            (first + second).backward()
        elif how == "separate":
            first.backward(retain_graph=True)
            second.backward()
        elif how in ("first", "second"):
            (first if how == "first" else second).backward()
        else:
            first.backward()
            losses(model(x))[1].backward()
        pre.step()
    pre.remove()
    return factors_of(pre), list(caught)


def test_two_losses_backpropagated_separately_over_one_pass_are_warned_about() -> None:
    """``G`` adds each call's products, not their sum's: said once, naming a layer.

    Independent runs show the arithmetic the warning describes: the separate calls' ``G`` is
    the two single-loss runs' ``G`` summed, which differs from the summed loss's by the cross
    terms (the summed loss's ``G`` is checked against per-example oracles above).
    """
    separate, warned = two_loss_factors("separate")
    ours = [w for w in warned if w.category is dkfac.SeparateBackwardCallsWarning]
    assert len(ours) == 1
    assert "two backward calls that both compute its gradient" in str(ours[0].message)
    assert "'head'" in str(ours[0].message) or "'body'" in str(ours[0].message)
    summed, quiet = two_loss_factors("summed")
    assert not [w for w in quiet if w.category is dkfac.SeparateBackwardCallsWarning]
    alone = [two_loss_factors(how)[0] for how in ("first", "second")]
    for key in ("body/g", "head/g"):
        assert_close(separate[key], alone[0][key] + alone[1][key])
        assert not torch.allclose(separate[key], summed[key], rtol=1e-3, atol=0)
    for key in ("body/a", "head/a"):
        assert torch.equal(separate[key], summed[key])  # one forward pass either way


def test_a_loss_per_forward_pass_is_no_separate_call() -> None:
    """Two forward passes, each backpropagated once (micro-batches): nothing to warn about."""
    _, warned = two_loss_factors("two_passes")
    assert not [w for w in warned if w.category is dkfac.SeparateBackwardCallsWarning]


def test_a_layer_in_checkpointed_segments_backpropagated_apart_is_no_separate_call() -> None:
    """A cell called in a loop of reentrant checkpoints: each segment's backward call is an
    engine call of its own, but each reaches a call of the layer of its own (no warning)."""
    torch.manual_seed(2)
    cell, head = nn.Linear(4, 4).double(), nn.Linear(4, 2).double()
    model = nn.ModuleDict({"cell": cell, "head": head})
    pre = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **F64)
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hidden = x
        for _ in range(3):
            hidden = checkpoint(lambda h: torch.tanh(cell(h)), hidden, use_reentrant=True)
        head(hidden).square().mean().backward()
        pre.step()
    assert not [w for w in caught if w.category is dkfac.SeparateBackwardCallsWarning]
    assert pre.factors()["cell"][1].abs().sum() > 0  # the segments' G was taken
    pre.remove()
