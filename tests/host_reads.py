"""Count what waits for the GPU in dkfac's code: host reads of tensors and blocking copies.

On a GPU, reading a tensor's value on the host (``item``, ``tolist``, ``bool``, a copy to the
CPU) or building a device tensor from host data waits for every kernel queued before it.
:class:`HostReadSpy` records each such call that a ``dkfac`` module makes, on the CPU too,
so the reads per K-FAC step are checked on machines without a GPU;
:func:`dkfac.bench.cuda_syncs.cuda_syncs` checks the same on a GPU with CUDA's own detector,
which also sees the waits inside torch's operators (such as a decomposition's error check).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

#: Tensor methods that copy device data to the host (a synchronisation on CUDA).
HOST_READ_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "cpu",
    "numpy",
)
#: torch functions that read device data back.
HOST_READ_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "masked_select")


class HostReadSpy:
    """Records host reads made directly by dkfac code, whatever the device.

    A call counts when the frame that makes it belongs to a ``dkfac`` module. Also counted:
    ``torch.tensor(data, device=...)`` (on CUDA a blocking copy of host data) and indexing a
    tensor with a Python list (on CUDA it copies the list to the device first). A host tensor
    built without a device (``torch.tensor(data)``) is not a read.

    Args:
        monkeypatch: where the spies are installed (``pytest``'s fixture, or a
            ``pytest.MonkeyPatch()`` undone by the caller, e.g. in a spawned worker).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        for name in HOST_READ_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in HOST_READ_FUNCTIONS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        monkeypatch.setattr(torch, "tensor", self._wrap_tensor(torch.tensor))
        for name in ("__getitem__", "__setitem__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap_index(original, name))

    def _record(self, what: str) -> None:
        module = sys._getframe(2).f_globals.get("__name__", "")
        if module.startswith("dkfac"):
            self.calls.append((what, module))

    def _wrap(self, original: Any, what: str) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self._record(what)
            return original(*args, **kwargs)

        return spy

    def _wrap_tensor(self, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                self._record("torch.tensor on a device")
            return original(*args, **kwargs)

        return spy

    def _wrap_index(self, original: Any, what: str) -> Any:
        def spy(tensor: torch.Tensor, index: Any, *rest: Any) -> Any:
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(part, list) for part in parts):
                self._record(f"{what} with a list")
            return original(tensor, index, *rest)

        return spy

    def take(self) -> list[tuple[str, str]]:
        """The calls recorded since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls
