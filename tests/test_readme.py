"""The README's quickstart runs as printed and trains; its strategy table is the registry's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

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
    torch.manual_seed(0)  # the README's code draws its initial weights unseeded
    exec(compile(code.group(1), str(README), "exec"), namespace)
    pre, model, x, y = (namespace[k] for k in ("pre", "model", "x", "y"))
    assert pre.steps == 28
    accuracy = (model(x).argmax(-1) == y).float().mean().item()
    assert accuracy > 0.8, accuracy  # one pass over the digits, K-FAC preconditioned


def test_the_strategy_table_lists_every_registered_strategy_with_its_reference() -> None:
    from dkfac.bench.configs import STRATEGIES as BENCHED
    from dkfac.cli.config import STRATEGIES as COMMAND_LINE
    from dkfac.strategies import STRATEGIES
    from dkfac.strategies.accounting import ACCOUNTED_STRATEGIES

    rows = [line for line in README.read_text().splitlines() if line.startswith('| `"')]
    names = [row.split('`"')[1].split('"`')[0] for row in rows]
    assert names == list(STRATEGIES)
    for row, spec in zip(rows, STRATEGIES.values(), strict=True):
        assert row.rstrip().endswith(f"| {spec.reference} |"), row
    distributed = [name for name, spec in STRATEGIES.items() if spec.distributed]
    assert list(COMMAND_LINE) == ["none", *STRATEGIES, "auto"]  # auto: dkfac.AutoOptions
    assert list(BENCHED) == list(ACCOUNTED_STRATEGIES) == distributed


def test_the_adaptive_example_runs_after_the_quickstart_and_learns() -> None:
    text = README.read_text()
    blocks = [text[text.index(title) :] for title in ("## Quickstart", "### Adaptive K-FAC")]
    codes = [re.search(r"```python\n(.*?)```", block, re.S) for block in blocks]
    assert all(code is not None for code in codes)
    namespace: dict[str, object] = {}
    # The README's code draws its initial weights unseeded; seeded here so that the check is
    # one run. Its bits still depend on the torch build: seed 0 ends at 92.2% with torch 2.13
    # here and 89.0% with torch 2.11 on the GPU machine; over seeds 0-19 (2026-11-28) the
    # second pass ends at 83.8-98.1%, so the bound is 80% (a diverged or untrained model
    # sits near 10%).
    torch.manual_seed(0)
    for index, code in enumerate(codes):
        assert code is not None
        exec(compile(code.group(1), str(README), "exec"), namespace)
        if index == 0:  # the quickstart's preconditioner leaves the model first
            namespace.pop("pre").remove()  # type: ignore[attr-defined]
    pre, model, x, y = (namespace[k] for k in ("pre", "model", "x", "y"))
    assert pre.steps == 28 and pre.adaptive_report is not None
    assert all(p.grad is None for p in model.parameters())  # every layer moved by K-FAC
    accuracy = (model(x).argmax(-1) == y).float().mean().item()
    assert accuracy > 0.8, accuracy  # a second pass, adaptive
