"""What TorchDynamo could not compile, from its counters (clear them before the run)."""

from __future__ import annotations

from typing import Any

from torch._dynamo.utils import counters


def dynamo_trouble() -> dict[str, Any]:
    """Graph breaks, unsupported constructs and frames that fell back to eager, since ``clear``.

    A graph break that TorchDynamo cannot resume from (inside a module's hook) runs the whole
    frame eagerly and is counted under ``unimplemented`` and as a frame not ``ok``, not under
    ``graph_break``: all three are read.
    """
    trouble: dict[str, Any] = {}
    for kind in ("graph_break", "unimplemented"):
        if counters[kind]:
            trouble[kind] = {str(key)[:300]: count for key, count in counters[kind].items()}
    frames = counters["frames"]
    if frames["total"] != frames["ok"]:
        trouble["frames"] = dict(frames)
    return trouble
