"""Interval arithmetic for overlap accounting: unions, their lengths, and their intersection.

Pure functions on ``(start, end)`` pairs of seconds; the recorder feeds them the in-flight
spans of collectives and the training thread's own phase spans.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as disjoint intervals, ascending.

    Empty or reversed intervals (``end <= start``) cover nothing and are dropped; intervals
    that touch (one ends where the next starts) become one.
    """
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals`` (time covered at least once)."""
    return sum(end - start for start, end in merge(intervals))


def covered_by_both(first: Iterable[Interval], second: Iterable[Interval]) -> float:
    """Length of the intersection of the union of ``first`` with the union of ``second``."""
    a, b = merge(first), merge(second)
    total, i, j = 0.0, 0, 0
    # Both lists are disjoint and sorted: one sweep visits each pair that can overlap.
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposure(flights: Iterable[Interval], waits: Iterable[Interval]) -> dict[str, float]:
    """How much of the time ``flights`` were in flight the thread spent in ``waits``.

    Returns:
        ``"in_flight_s"``: length of the union of ``flights``; ``"exposed_s"``: the part of
        it inside the union of ``waits``; ``"hidden_s"``: the rest (their difference).
    """
    flights = list(flights)
    in_flight = covered(flights)
    # Summed separately, the intersection can exceed the union by a rounding error.
    exposed = min(covered_by_both(flights, waits), in_flight)
    return {"in_flight_s": in_flight, "exposed_s": exposed, "hidden_s": in_flight - exposed}
