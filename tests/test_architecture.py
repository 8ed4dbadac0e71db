"""The layers of docs/architecture.md hold: each imports only the layers below it.

Read from the source (no import side effects): every ``dkfac`` import of every module, and
every module's length (one idea per module, at most 400 lines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "dkfac"

#: Per lower layer, the dkfac packages it may import (itself included).
ALLOWED = {
    "curvature": {"curvature"},
    # Adaptive K-FAC: model-level math (torch.func); the average over workers is passed in.
    "adaptive": {"adaptive", "curvature", "validation"},
    "comm": {"comm", "curvature"},
    "strategies": {"strategies", "comm", "curvature"},
    # The simulator sits above the strategies: their own planners and runner, DeAR's bucket
    # planner; profiling runs the preconditioner, and takes the benchmark's models and link
    # shapes.
    "sim": {"sim", "strategies", "dear", "comm", "curvature", "preconditioner", "bench"},
}
MAX_LINES = 400


def modules(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def dkfac_imports(path: Path) -> set[str]:
    """The dkfac sub-packages (or top-level modules) ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dkfac":
                found.add(parts[1] if len(parts) > 1 else "dkfac")
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    wrong = {
        str(path.relative_to(PACKAGE)): sorted(dkfac_imports(path) - ALLOWED[layer])
        for path in modules(layer)
        if dkfac_imports(path) - ALLOWED[layer]
    }
    assert wrong == {}


def test_curvature_never_talks_to_other_processes() -> None:
    talking = [
        str(path.relative_to(PACKAGE))
        for path in modules("curvature")
        if "torch.distributed" in path.read_text()
    ]
    assert talking == []


def test_no_module_is_longer_than_one_idea() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in modules()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
    assert len(modules()) > 50  # the package was found
