"""The devices tests run on: the CPU always, a CUDA GPU when torch sees one.

Tests marked ``cuda`` (``pytest -m cuda`` runs only them) skip with the reason where no GPU
is present, so ``make test`` passes on a CPU machine and runs them on a GPU machine.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

#: Where the ``cuda`` tests run: the GPU; ``DKFAC_CUDA_TESTS_DEVICE=cpu`` rehearses them on
#: the CPU (what needs CUDA itself, such as its synchronisation detector, still skips).
CUDA_TEST_DEVICE = torch.device(os.environ.get("DKFAC_CUDA_TESTS_DEVICE", "cuda"))
HAS_CUDA = torch.cuda.is_available()

#: Marks a test that needs a GPU: selected by ``-m cuda``, skipped without one.
needs_cuda = pytest.mark.skipif(
    CUDA_TEST_DEVICE.type == "cuda" and not HAS_CUDA,
    reason=f"needs a CUDA GPU: torch {torch.__version__} sees none here",
)


def on_cuda(*values: Any) -> Any:
    """A ``pytest.param`` of ``values`` that runs on a GPU only (marked ``cuda``)."""
    return pytest.param(*values, marks=[pytest.mark.cuda, needs_cuda])
