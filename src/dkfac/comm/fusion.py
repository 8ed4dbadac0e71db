"""Fusion plans: which consecutive tensors of a ready-ordered list travel in one collective.

Pure functions (no ``torch.distributed``): every rank computes the same plan from the same
inputs. Items are given in the order they become ready; a plan is a list of buckets, each a
list of consecutive item positions. ``boundaries`` are positions where a new bucket must start
(e.g. where PAD-KFAC's owner changes: one reduce goes to one owner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dkfac.comm.cost_model import AlphaBeta


def _check(nbytes: Sequence[int], cap_bytes: int, boundaries: Sequence[int]) -> set[int]:
    if cap_bytes < 0:
        raise ValueError(f"cap_bytes={cap_bytes!r} is not allowed: expected >= 0")
    if any(size < 0 for size in nbytes):
        raise ValueError("item sizes must be >= 0 bytes")
    bad = [b for b in boundaries if not 0 <= b <= len(nbytes)]
    if bad:
        raise ValueError(f"boundaries={bad!r} are not positions of the list (0..{len(nbytes)})")
    return set(boundaries)


def plan_buckets_by_size(
    nbytes: Sequence[int],
    cap_bytes: int,
    boundaries: Sequence[int] = (),
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Greedy buckets in list order: a bucket closes before the item that would exceed the cap.

    An item larger than the cap travels alone; ``cap_bytes=0`` puts every item alone.
    ``first_cap_bytes`` caps the first bucket lower (as DDP's 1 MiB first bucket: the last
    collective of a backward pass, or the first one a forward pass waits for, stays short).
    """
    starts = _check(nbytes, cap_bytes, boundaries)
    buckets: list[list[int]] = []
    size = 0
    for position, item_bytes in enumerate(nbytes):
        limit = cap_bytes
        if len(buckets) == 1 and first_cap_bytes is not None:
            limit = min(cap_bytes, first_cap_bytes)
        if not buckets or position in starts or size + item_bytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(position)
        size += item_bytes
    return buckets


def plan_buckets_alpha_beta(
    ready: Sequence[float],
    nbytes: Sequence[int],
    model: AlphaBeta,
    cap_bytes: int,
    boundaries: Sequence[int] = (),
) -> list[list[int]]:
    """SPD-KFAC's merge rule on measured ready times (docs/strategies.md).

    Walking the items in order, the open bucket (ready when its last member is) would start at
    ``max(bucket ready, link free)``. Item ``l+1`` joins it when that start is not before
    ``l+1`` is ready anyway (the link is busy), or when waiting for ``l+1`` costs less than a
    collective's start-up ``alpha``; it never joins past the cap or across a boundary. The
    link is modelled as one serial channel: a bucket ends ``alpha + beta·bytes`` after it starts.
    """
    if len(ready) != len(nbytes):
        raise ValueError(f"got {len(ready)} ready times for {len(nbytes)} items")
    starts = _check(nbytes, cap_bytes, boundaries)
    buckets: list[list[int]] = []
    link_free = float("-inf")
    bucket_ready = bucket_bytes = 0.0
    for position, (ready_at, item_bytes) in enumerate(zip(ready, nbytes, strict=True)):
        if buckets:
            start = max(bucket_ready, link_free)
            joins = (
                position not in starts
                and bucket_bytes + item_bytes <= cap_bytes
                and (ready_at <= start or ready_at - start < model.alpha)
            )
            if joins:
                buckets[-1].append(position)
                bucket_ready = max(bucket_ready, ready_at)
                bucket_bytes += item_bytes
                continue
            link_free = start + model.seconds(bucket_bytes)
        buckets.append([position])
        bucket_ready, bucket_bytes = ready_at, float(item_bytes)
    return buckets


@dataclass(frozen=True)
class BucketTiming:
    """Predicted start and end (seconds, same clock as the ready times) of one collective."""

    start: float
    end: float


def predict_timeline(
    ready: Sequence[float],
    nbytes: Sequence[int],
    buckets: Sequence[Sequence[int]],
    model: AlphaBeta,
) -> list[BucketTiming]:
    """Start/end of each bucket's collective on one serial link (as the merge rule assumes)."""
    timings = []
    link_free = float("-inf")
    for bucket in buckets:
        start = max(max(ready[i] for i in bucket), link_free)
        link_free = start + model.seconds(sum(nbytes[i] for i in bucket))
        timings.append(BucketTiming(start, link_free))
    return timings
