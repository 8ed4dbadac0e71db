"""Items cut into consecutive chunks of a bounded total size: how batched work bounds memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")


def cut_by_size(
    items: Sequence[Item],
    size: Callable[[Item], int],
    limit: int,
    joins: Callable[[Item, Item], bool] | None = None,
) -> list[list[Item]]:
    """``items`` in order, cut where a chunk's sizes would pass ``limit``.

    An item larger than ``limit`` is a chunk of its own. ``joins(first, item)``: whether
    ``item`` may join the chunk that ``first`` began (``None``: any may).
    """
    chunks: list[list[Item]] = []
    total = 0
    for item in items:
        amount = size(item)
        fits = chunks and total + amount <= limit
        if fits and (joins is None or joins(chunks[-1][0], item)):
            chunks[-1].append(item)
            total += amount
        else:
            chunks.append([item])
            total = amount
    return chunks
