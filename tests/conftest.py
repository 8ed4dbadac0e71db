"""Settings every test shares."""

from __future__ import annotations

import os

import torch


def pytest_configure() -> None:
    """Under ``pytest -n N`` (``make test``), one intra-op thread per test process.

    The N processes share the cores already; with the default (one thread per core) each
    test's kernels would compete with the others' threads.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
