"""``inv_update_steps="auto"``: the interval chosen from measured times, and its schedule.

The clock is scripted, so the choice is known in advance; the oracle for the schedule is the
same run with a callable ``inv_update_steps`` that decomposes at the steps the choice implies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers
from dkfac.decomposition_interval import DecompositionBudget

F64 = {"factor_dtype": torch.float64, "inv_dtype": torch.float64}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def scripted_clock(times: Sequence[float]) -> Callable[[], float]:
    """A clock returning ``times`` in order; one call too many fails the test."""
    stamps: Iterator[float] = iter(times)

    def clock() -> float:
        stamp = next(stamps, None)
        assert stamp is not None, "the clock was read after the interval was chosen"
        return stamp

    return clock


def ticking_clock() -> Callable[[], float]:
    """A clock one second later at every read."""
    ticks = iter(range(10**6))
    return lambda: float(next(ticks))


def train(
    inv_update_steps: Any,
    steps: int,
    *,
    clock: Callable[[], float] | None = None,
    factor_update_steps: int = 1,
    state: dict[str, Any] | None = None,
) -> tuple[nn.Module, dkfac.KFACPreconditioner, list[int]]:
    """Train the MLP ``steps`` steps; also return the steps that decomposed."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = dkfac.KFACPreconditioner(
        model,
        inv_update_steps=inv_update_steps,
        factor_update_steps=factor_update_steps,
        damping=0.01,
        **F64,
    )
    if clock is not None:
        assert pre._interval is not None
        pre._interval.clock = clock
    if state is not None:
        pre.load_state_dict(state)
    decomposed = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=generator)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = pre._decomposition_steps
        pre.step()
        if pre._decomposition_steps > before:
            decomposed.append(pre.steps - 1)
        opt.step()
    return model, pre, decomposed


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


# -- the rule --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decomposition_s", "step_s", "share", "most", "expected"),
    [
        (0.006, 0.080, 0.1, 100, 1),  # the digits CNN: every step
        (0.128, 0.170, 0.1, 100, 8),  # the autoencoder: 7.5 rounds up
        (0.128, 0.170, 0.05, 100, 16),
        (0.020, 0.200, 0.1, 100, 1),  # exactly the share: every step
        (5.0, 0.010, 0.1, 100, 100),  # capped
        (0.0, 0.010, 0.1, 100, 1),
        (0.010, 0.0, 0.1, 7, 7),  # no step time measured: the longest allowed
    ],
)
def test_the_interval_is_the_decompositions_time_over_the_steps_share(
    decomposition_s: float, step_s: float, share: float, most: int, expected: int
) -> None:
    budget = DecompositionBudget(share=share, most=most)
    assert budget.interval(decomposition_s, step_s) == expected
    if step_s > 0 and expected not in (1, most):  # the independent statement of "at most"
        assert decomposition_s / expected <= share * step_s < decomposition_s / (expected - 1)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"share": 0.0}, r"DecompositionBudget.share=0.0 is not allowed: expected a number in"),
        ({"share": 1.5}, r"DecompositionBudget.share=1.5 is not allowed"),
        ({"share": math.nan}, r"DecompositionBudget.share=nan is not allowed"),
        ({"share": True}, r"DecompositionBudget.share=True is not allowed"),
        ({"measured_decompositions": 0}, r"measured_decompositions=0 is not allowed"),
        ({"most": 0}, r"DecompositionBudget.most=0 is not allowed: expected an integer >= 1"),
    ],
)
def test_a_bad_budget_is_refused(keywords: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecompositionBudget(**keywords)


def test_auto_is_the_default_budget_and_other_text_is_refused() -> None:
    config = dkfac.KFACConfig(inv_update_steps="auto")
    assert config.decomposition_budget == DecompositionBudget()
    assert dkfac.KFACConfig(inv_update_steps=4).decomposition_budget is None
    with pytest.raises(ValueError, match=r"inv_update_steps='Auto' is not allowed: expected an"):
        dkfac.KFACConfig(inv_update_steps="Auto")


# -- the schedule ----------------------------------------------------------------------------
def test_the_chosen_interval_decomposes_like_the_schedule_it_implies() -> None:
    # Step 0: decomposition 0 -> 0.5 (not used: one-off costs), step ends at 1.0.
    # Steps 1, 2: decompositions 0.3 and 0.2, steps 0.9 without them. With share 0.05:
    # ceil(min(0.3, 0.2) / (0.05 * 0.9)) = ceil(4.44) = 5, chosen at the end of step 2.
    times = [0.0, 0.5, 1.0, 1.8, 2.1, 2.2, 3.0, 3.2, 3.3]
    budget = DecompositionBudget(share=0.05)
    model, pre, decomposed = train(budget, 16, clock=scripted_clock(times))
    assert pre.decomposition_interval == 5
    assert decomposed == [0, 1, 2, 5, 10, 15]
    oracle, _, oracle_decomposed = train(lambda k: 1 if k < 3 else 5, 16)
    assert oracle_decomposed == decomposed
    assert_same_parameters(model, oracle)
    # The comparison can fail: one interval more and the parameters differ.
    other, _, _ = train(lambda k: 1 if k < 3 else 6, 16)
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)


def test_the_choice_is_rounded_up_to_a_multiple_of_the_factor_interval() -> None:
    # One second per clock read, factors every 4 steps: decompositions (1 s each) at steps 0,
    # 4, 8; steps 1-8 take 1 s without them (2 s with the decomposition's two reads), the
    # fastest 1 s. ceil(1 / (0.3 * 1)) = 4 -> 4; share 0.15: ceil(6.67) = 7 -> 8.
    for share, chosen, expected in ((0.3, 4, [0, 4, 8, 12, 16, 20]), (0.15, 7, [0, 4, 8, 16])):
        budget = DecompositionBudget(share=share)
        _, pre, decomposed = train(budget, 24, clock=ticking_clock(), factor_update_steps=4)
        assert pre.decomposition_interval == chosen
        assert decomposed == expected
    _, _, oracle = train(lambda k: 4 if k < 9 else 8, 24, factor_update_steps=4)
    assert oracle == decomposed


def test_a_saved_choice_is_kept_and_a_state_without_one_measures_again() -> None:
    times = [0.0, 0.5, 1.0, 1.8, 2.1, 2.2, 3.0, 3.2, 3.3]
    budget = DecompositionBudget(share=0.05)
    _, pre, _ = train(budget, 4, clock=scripted_clock(times))
    state = pre.state_dict()
    assert state["decomposition_interval"] == {"chosen": 5}
    # Restored (with its decompositions) at step 4: no clock read (the scripted clock is
    # exhausted), decompositions at the multiples of 5.
    _, restored, decomposed = train(budget, 11, clock=scripted_clock([]), state=state)
    assert restored.decomposition_interval == 5
    assert decomposed == [5, 10]
    del state["decomposition_interval"]
    _, again, _ = train(budget, 1, clock=ticking_clock(), state=state)
    assert again.decomposition_interval is None
    bad = {**pre.state_dict(), "decomposition_interval": {"chosen": 0}}
    with pytest.raises(ValueError, match=r"saved decomposition interval=0 is not allowed"):
        train(budget, 0, state=bad)


# -- every worker the same interval ----------------------------------------------------------
def choose_on_each_rank(rank: int, world_size: int) -> dict[str, Any]:
    # Rank 0's decompositions take 1/16 s, rank 1's 1/4 s, and their steps 1 s without them
    # (times exact in binary): rank 0 wants ceil(0.625) = 1, rank 1 ceil(2.5) = 3.
    d = 0.0625 if rank == 0 else 0.25
    times = [0.0, d, 1.0, 1.5, 1.5 + d, 2.0 + d, 2.5 + d, 2.5 + 2 * d, 3.0 + 2 * d]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = dkfac.KFACPreconditioner(model, strategy="dkfac", inv_update_steps="auto")
    assert pre._interval is not None
    pre._interval.clock = scripted_clock(times)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 6, generator=generator)
        F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        pre.step()
    own = DecompositionBudget().interval(d, 1.0)
    result = {"own": own, "chosen": pre.decomposition_interval, "comm": pre.comm_stats()}
    pre.remove()
    dist.barrier()
    return result


def test_every_worker_takes_the_largest_interval() -> None:
    results = run_workers(choose_on_each_rank, 2)
    assert [r["own"] for r in results] == [1, 3]
    assert [r["chosen"] for r in results] == [3, 3]
    assert all(r["comm"]["decomposition_interval/allreduce"]["calls"] == 1 for r in results), (
        results[0]["comm"]
    )
