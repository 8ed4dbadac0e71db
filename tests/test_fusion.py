"""Fusion planners (pure functions): size-first buckets and SPD-KFAC's alpha-beta merge rule."""

from __future__ import annotations

import random

import pytest

from dkfac.comm.cost_model import AlphaBeta
from dkfac.comm.fusion import (
    plan_buckets_alpha_beta,
    plan_buckets_by_size,
    predict_timeline,
)


def test_size_plan_fills_buckets_up_to_the_cap_in_order() -> None:
    assert plan_buckets_by_size([4, 4, 4, 9, 1], cap_bytes=8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets_by_size([4, 4, 4], cap_bytes=0) == [[0], [1], [2]]  # every one alone
    # A lower cap for the first bucket only (DeAR, like DDP, keeps its first bucket short).
    assert plan_buckets_by_size([2, 2, 2, 2, 2, 2], 8, first_cap_bytes=4) == [[0, 1], [2, 3, 4, 5]]
    assert plan_buckets_by_size([2, 2, 2], 3, first_cap_bytes=8) == [[0], [1], [2]]
    assert plan_buckets_by_size([4, 4, 4, 4], cap_bytes=100, boundaries=[2]) == [[0, 1], [2, 3]]
    assert plan_buckets_by_size([], cap_bytes=8) == []


def test_merge_rule_on_a_hand_worked_timeline() -> None:
    # alpha 1 ms, 1000-byte items take 1 + 10 ms. Item 0 goes alone at t=0 (item 1 is 5 ms
    # away, more than alpha) and holds the link until 11 ms; items 1 and 2 (ready at 5 and
    # 6 ms) could not start before then anyway, so they travel together from 11 to 32 ms;
    # item 3 (20 ms) waits for the link but the open bucket {1, 2} starts at 11 ms, before
    # it is ready, and 9 ms of waiting costs more than alpha: alone. Item 4 likewise.
    model = AlphaBeta(alpha=1e-3, beta=1e-5)
    ready = [0.0, 0.005, 0.006, 0.020, 0.050]
    sizes = [1000] * 5
    buckets = plan_buckets_alpha_beta(ready, sizes, model, cap_bytes=10**9)
    assert buckets == [[0], [1, 2], [3], [4]]
    timeline = predict_timeline(ready, sizes, buckets, model)
    starts_ends = [(round(t.start, 6), round(t.end, 6)) for t in timeline]
    assert starts_ends == [(0.0, 0.011), (0.011, 0.032), (0.032, 0.043), (0.05, 0.061)]


def test_merge_rule_extremes_and_limits() -> None:
    ready = [0.0, 0.001, 0.002, 0.003]
    sizes = [100] * 4
    # A start-up cost larger than every gap: one bucket; unless the cap or a boundary says no.
    slow_start = AlphaBeta(alpha=1.0, beta=0.0)
    assert plan_buckets_alpha_beta(ready, sizes, slow_start, 10**6) == [[0, 1, 2, 3]]
    assert plan_buckets_alpha_beta(ready, sizes, slow_start, 250) == [[0, 1], [2, 3]]
    assert plan_buckets_alpha_beta(ready, sizes, slow_start, 10**6, [1, 3]) == [[0], [1, 2], [3]]
    assert plan_buckets_alpha_beta(ready, sizes, slow_start, 0) == [[0], [1], [2], [3]]
    # Free start-ups and an idle link: nothing is worth waiting for.
    free = AlphaBeta(alpha=0.0, beta=1e-9)
    assert plan_buckets_alpha_beta(ready, sizes, free, 10**6) == [[0], [1], [2], [3]]
    # Everything ready at once: one collective beats four start-ups.
    assert plan_buckets_alpha_beta([0.0] * 4, sizes, free, 10**6) == [[0, 1, 2, 3]]


def test_merge_rule_never_predicts_a_later_finish_than_all_alone_when_ready_together() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 12)
        ready = sorted(rng.uniform(0, 0.01) for _ in range(n))
        sizes = [rng.randint(1, 10**5) for _ in range(n)]
        model = AlphaBeta(alpha=rng.uniform(0, 2e-3), beta=rng.uniform(0, 1e-8))
        buckets = plan_buckets_alpha_beta(ready, sizes, model, cap_bytes=10**9)
        assert [i for bucket in buckets for i in bucket] == list(range(n))
        merged = predict_timeline(ready, sizes, buckets, model)[-1].end
        alone = predict_timeline(ready, sizes, [[i] for i in range(n)], model)[-1].end
        assert merged <= alone + 1e-12


def test_planners_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="cap_bytes=-1"):
        plan_buckets_by_size([1], cap_bytes=-1)
    with pytest.raises(ValueError, match="boundaries"):
        plan_buckets_by_size([1, 2], cap_bytes=4, boundaries=[5])
    with pytest.raises(ValueError, match="2 ready times for 3 items"):
        plan_buckets_alpha_beta([0.0, 1.0], [1, 2, 3], AlphaBeta(0, 0), 10)
