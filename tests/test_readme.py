"""The README's quickstart runs as printed and trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

pytest.importorskip("sklearn")


def test_quickstart_runs_and_learns() -> None:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    lines = code.group(1).strip().splitlines()
    assert len(lines) <= 12, "the quickstart must stay short"
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)
    pre, model, x, y = (namespace[k] for k in ("pre", "model", "x", "y"))
    assert pre.steps == 28
    accuracy = (model(x).argmax(-1) == y).float().mean().item()
    assert accuracy > 0.8, accuracy  # one pass over the digits, K-FAC preconditioned
