"""``"auto"`` update intervals: chosen from measured times, and the schedule they imply.

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
from dkfac.update_intervals import IntervalBudget, UpdateIntervals, multiple_of

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
    factor_update_steps: Any = 1,
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
        pre._intervals.clock = clock
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
    budget = IntervalBudget(share=share, most=most)
    assert budget.interval(decomposition_s, step_s) == expected
    if step_s > 0 and expected not in (1, most):  # the independent statement of "at most"
        assert decomposition_s / expected <= share * step_s < decomposition_s / (expected - 1)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"share": 0.0}, r"IntervalBudget.share=0.0 is not allowed: expected a number in"),
        ({"share": 1.5}, r"IntervalBudget.share=1.5 is not allowed"),
        ({"share": math.nan}, r"IntervalBudget.share=nan is not allowed"),
        ({"share": True}, r"IntervalBudget.share=True is not allowed"),
        ({"measured_decompositions": 0}, r"measured_decompositions=0 is not allowed"),
        ({"most": 0}, r"IntervalBudget.most=0 is not allowed: expected an integer >= 1"),
    ],
)
def test_a_bad_budget_is_refused(keywords: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IntervalBudget(**keywords)


def test_auto_is_the_default_budget_and_other_text_is_refused() -> None:
    config = dkfac.KFACConfig(factor_update_steps="auto", inv_update_steps="auto")
    assert config.factor_budget == config.inv_budget == IntervalBudget()
    assert dkfac.KFACConfig(inv_update_steps=4).inv_budget is None
    for name in ("factor_update_steps", "inv_update_steps"):
        keywords = {"inv_update_steps": "auto", name: "Auto"}
        with pytest.raises(ValueError, match=rf"{name}='Auto' is not allowed: expected an"):
            dkfac.KFACConfig(**keywords)
    with pytest.raises(
        ValueError,
        match=r"factor_update_steps=IntervalBudget\(.*\) is not allowed "
        r"with inv_update_steps=4: a chosen factor interval needs",
    ):
        dkfac.KFACConfig(factor_update_steps="auto", inv_update_steps=4)


# -- the schedule ----------------------------------------------------------------------------
def test_the_chosen_interval_decomposes_like_the_schedule_it_implies() -> None:
    # Step 0: decomposition 0 -> 0.5 (not used: one-off costs), step ends at 1.0.
    # Steps 1, 2: decompositions 0.3 and 0.2, steps 0.9 without them. With share 0.05:
    # ceil(min(0.3, 0.2) / (0.05 * 0.9)) = ceil(4.44) = 5, chosen at the end of step 2.
    times = [0.0, 0.5, 1.0, 1.8, 2.1, 2.2, 3.0, 3.2, 3.3]
    budget = IntervalBudget(share=0.05)
    model, pre, decomposed = train(budget, 16, clock=scripted_clock(times))
    assert pre.chosen_intervals == (None, 5)
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
    for share, chosen, expected in ((0.3, 4, [0, 4, 8, 12, 16, 20]), (0.15, 8, [0, 4, 8, 16])):
        budget = IntervalBudget(share=share)
        _, pre, decomposed = train(budget, 24, clock=ticking_clock(), factor_update_steps=4)
        assert pre.chosen_intervals == (None, chosen)
        assert decomposed == expected
    _, _, oracle = train(lambda k: 4 if k < 9 else 8, 24, factor_update_steps=4)
    assert oracle == decomposed


@pytest.mark.parametrize(
    ("factor_share", "chosen", "decomposed"),
    [(0.125, (6, 18), [0, 2, 4, 18, 36]), (1.0, (1, 16), [0, 2, 4, 16, 32])],
)
def test_a_chosen_factor_interval_updates_like_the_schedule_it_implies(
    factor_share: float, chosen: tuple[int, int], decomposed: list[int]
) -> None:
    # Factors every 2 steps while measuring; decompositions at each factor update (0, 2, 4).
    # Step 0: decomposition 0 -> 0.5, ends at 1. Step 1 (no update): 1 s. Steps 2 and 4:
    # decompositions of 0.25 s, steps of 1.75 and 2 s without them. So a plain step 1 s, a
    # factor update 0.75 s, a decomposition 0.25 s (all exact in binary): factors every
    # ceil(0.75 / 0.125) = 6 steps (or 1 at share 1), decompositions every
    # ceil(0.25 / (1/64)) = 16, rounded up to a multiple of the factor interval (18 for 6, as
    # pre.chosen_intervals says: the intervals that run). Factors at
    # every step from step 5 on: the capture for step 5, decided before the choice, changes.
    times = [0.0, 0.5, 1.0, 2.0, 3.5, 3.75, 4.0, 5.0, 6.75, 7.0, 7.25]
    factor, inverse = IntervalBudget(share=factor_share), IntervalBudget(share=1 / 64)
    model, pre, steps = train(inverse, 40, clock=scripted_clock(times), factor_update_steps=factor)
    assert pre.chosen_intervals == chosen
    assert steps == decomposed
    every, later = chosen[0], decomposed[3]
    oracle, _, oracle_steps = train(
        lambda k: 2 if k < 5 else later, 40, factor_update_steps=lambda k: 2 if k < 5 else every
    )
    assert oracle_steps == decomposed
    assert_same_parameters(model, oracle)
    # The factor steps matter to the comparison: factors every 2 steps throughout differ.
    other, _, _ = train(lambda k: 2 if k < 5 else 18, 40, factor_update_steps=2)
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)


def test_a_saved_choice_is_kept_and_a_state_without_one_measures_again() -> None:
    times = [0.0, 0.5, 1.0, 1.8, 2.1, 2.2, 3.0, 3.2, 3.3]
    budget = IntervalBudget(share=0.05)
    _, pre, _ = train(budget, 4, clock=scripted_clock(times))
    state = pre.state_dict()
    assert state["intervals"] == {"chosen": [None, 5]}
    # Restored (with its decompositions) at step 4: no clock read (the scripted clock is
    # exhausted), decompositions at the multiples of 5.
    _, restored, decomposed = train(budget, 11, clock=scripted_clock([]), state=state)
    assert restored.chosen_intervals == (None, 5)
    assert decomposed == [5, 10]
    # A state without a choice, loaded into a preconditioner that has one: it measures again
    # (decompositions 0.25 s after the first, steps 1.25 s without them: ceil(4) = 4).
    model, pre_opt = pre._model, torch.optim.SGD(pre._model.parameters(), lr=0.1)
    pre.load_state_dict({key: value for key, value in state.items() if key != "intervals"})
    assert pre.chosen_intervals is None
    pre._intervals.clock = scripted_clock([0.0, 0.5, 1.0, 1.5, 1.75, 2.5, 3.0, 3.25, 4.0])
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        pre_opt.zero_grad()
        x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
        F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
        pre.step()
        pre_opt.step()
    assert pre.chosen_intervals == (None, 4)
    # A refused state changes nothing.
    before = pre.state_dict()
    for chosen, message in (
        ([None, 0], r"saved decomposition interval=0 is not allowed"),
        ([3, 6], r"saved factor interval=3 is not allowed: .* factor_update_steps is fixed"),
        (5, r"saved intervals=5 are not allowed: expected \[factor, decomposition\]"),
    ):
        with pytest.raises(ValueError, match=message):
            pre.load_state_dict({**state, "intervals": {"chosen": chosen}})
        assert_same_state(pre.state_dict(), before)
    with pytest.raises(ValueError, match=r"saved factor interval=None is not allowed: .*'auto'"):
        train(budget, 0, factor_update_steps="auto", state=state)


def assert_same_state(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def test_multiple_of_rounds_up_within_the_longest_interval() -> None:
    assert [multiple_of(i, 3, 100) for i in (1, 3, 4, 7)] == [3, 3, 6, 9]
    assert multiple_of(70, 60, 100) == 60  # up would be 120 > 100: down
    assert multiple_of(5, 120, 100) == 120  # the factor interval itself passes most


def test_skipped_and_profiling_steps_are_not_measured() -> None:
    settings = dkfac.KFACConfig(inv_update_steps="auto").interval_settings()
    intervals = UpdateIntervals(settings, torch.device("cpu"))
    # Every step decomposes before the choice; each is timed 0 -> d, then the step ends.
    reads = [0.0, 0.1, 1.0]  # step 0: the first decomposition (not used)
    reads += [1.125, 1.25, 1.5]  # step 1, not counted: decomposition 0.125 s, step 0.375 s
    # Steps 2-3, counted: decompositions of 0.5 s, steps of 1 s and 0.5 s without them.
    reads += [2.0, 2.5, 3.0, 3.0, 3.5, 4.0]
    intervals.clock = scripted_clock(reads)
    agree = lambda values, device: list(values)  # noqa: E731 (one worker)
    for step in range(5):
        with intervals.timed_decomposition():
            pass
        chosen = intervals.step_finished(True, agree, record=step != 1)
        assert chosen == (step == 3)  # two counted decompositions after the first: steps 2, 3
        if chosen:
            break
    assert intervals.times.decompositions == [0.5, 0.5]
    assert intervals.times.factor_steps == [1.0, 0.5]
    # ceil(0.5 / (0.1 * 0.5)); counting step 1 would choose ceil(0.125 / 0.0375) = 4 at step 2.
    assert intervals.chosen == (None, 10)


# -- every worker the same interval ----------------------------------------------------------
def choose_on_each_rank(rank: int, world_size: int) -> dict[str, Any]:
    # Rank 0's decompositions take 1/16 s, rank 1's 1/4 s, and their steps 1 s without them
    # (times exact in binary): rank 0 wants ceil(0.625) = 1, rank 1 ceil(2.5) = 3.
    d = 0.0625 if rank == 0 else 0.25
    times = [0.0, d, 1.0, 1.5, 1.5 + d, 2.0 + d, 2.5 + d, 2.5 + 2 * d, 3.0 + 2 * d]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = dkfac.KFACPreconditioner(model, strategy="dkfac", inv_update_steps="auto")
    pre._intervals.clock = scripted_clock(times)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 6, generator=generator)
        F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        pre.step()
    own = IntervalBudget().interval(d, 1.0)
    result = {"own": own, "chosen": pre.chosen_intervals, "comm": pre.comm_stats()}
    pre.remove()
    dist.barrier()
    return result


def test_every_worker_takes_the_largest_interval() -> None:
    results = run_workers(choose_on_each_rank, 2)
    assert [r["own"] for r in results] == [1, 3]
    assert [r["chosen"] for r in results] == [(None, 3), (None, 3)]
    assert all(r["comm"]["intervals/allreduce"]["calls"] == 1 for r in results), results[0]
