"""The tensors inside a model's arguments or outputs: dicts, lists, tuples and dataclasses.

A model's batch size is read from the first tensor among its arguments
(:func:`dkfac.broadcast_check.batch_rows`, depth first: "first" as written), and the tensors
of its output are watched for the backward call that reaches them
(:mod:`dkfac.window_passes`, breadth first: a loss or logits before what is nested). Both
search the containers DDP searches, and both stop after :data:`SEARCHED_ITEMS` items: an
argument that refers to itself, or a list of a hundred thousand numbers, ends the search.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from typing import Any

from torch import Tensor

#: Items looked at in one search, containers included.
SEARCHED_ITEMS = 256


def nested_tensors(root: Any, *, depth_first: bool) -> list[Tensor]:
    """The tensors in ``root`` (itself, or inside its containers), in search order.

    A list, not a generator: the search runs inside a compiled model's pre-hook, where
    TorchDynamo cannot trace a generator. A tensor reached twice (a container held twice, a
    cycle) is listed each time.

    Args:
        root: a tensor, or a dict, list, tuple or dataclass instance holding others.
        depth_first: each container's items before the next sibling's (as written);
            otherwise every item of one level before the next level's.
    """
    found: list[Tensor] = []
    pending: deque[Any] = deque([root])
    searched = 0
    # No set of ids seen: traced in a compiled model's pre-hook, id() of an argument would be
    # guarded on and recompile for every new input. The bound ends a cycle.
    while pending and searched < SEARCHED_ITEMS:
        item = pending.popleft()
        searched += 1
        if isinstance(item, Tensor):
            found.append(item)
            continue
        bounded = _items(item, SEARCHED_ITEMS - searched)
        if bounded is None:
            continue
        if depth_first:
            pending.extendleft(reversed(bounded))
        else:
            pending.extend(bounded)
    return found


def _items(item: Any, limit: int) -> list[Any] | None:
    """A container's first ``limit`` items (None: not a container searched)."""
    if isinstance(item, Mapping):
        values = item.values()
        return [value for value, _ in zip(values, range(limit), strict=False)]
    if isinstance(item, list | tuple):
        return list(item[:limit])
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return [getattr(item, field.name) for field in dataclasses.fields(item)][:limit]
    return None
