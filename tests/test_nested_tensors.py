"""The search for tensors in a model's arguments and outputs (dkfac.nested_tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dkfac.broadcast_check import batch_rows
from dkfac.nested_tensors import SEARCHED_ITEMS, nested_tensors


@dataclass
class Output:
    loss: torch.Tensor
    extra: Any = None


def test_depth_first_follows_the_written_order_and_breadth_first_the_levels() -> None:
    a, b, c, d = (torch.full((n,), float(n)) for n in (1, 2, 3, 4))
    root = [[a, [b]], {"c": c}, Output(d)]
    assert [t.numel() for t in nested_tensors(root, depth_first=True)] == [1, 2, 3, 4]
    assert [t.numel() for t in nested_tensors(root, depth_first=False)] == [1, 3, 4, 2]


def test_a_dataclass_argument_gives_the_batch_and_a_cycle_ends_the_search() -> None:
    looped = Output(torch.zeros(5, 2))
    looped.extra = [looped, list(range(100_000))]
    assert batch_rows((looped,), {}) == 5
    assert batch_rows((), {"x": [7, torch.tensor(1.0), torch.zeros(3)]}) == 3  # 0-dim skipped
    endless = Output(torch.zeros(()))
    endless.extra = [endless] * (2 * SEARCHED_ITEMS)
    found = list(nested_tensors(endless, depth_first=True))  # it returns
    assert 0 < len(found) < SEARCHED_ITEMS and all(t is endless.loss for t in found)
