"""Import a script of benchmarks/ as a module (they are files, not package modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` imported under a private name (removed after the test)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
