"""What a launched collective hands back: wait for it, then its results are in the tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dkfac.comm.flight import Flight

#: One launched collective: its work, what ``wait()`` does after it, its in-flight record.
Pending = tuple[Any, Callable[[], None], Flight | None]


class CollectiveHandle:
    """Pending collectives; :meth:`wait` blocks and writes the results into the tensors."""

    def __init__(self, pending: list[Pending]) -> None:
        self._pending = pending

    @classmethod
    def joined(cls, handles: Sequence[CollectiveHandle]) -> CollectiveHandle:
        """One handle that waits for all of ``handles``, in order."""
        pending: list[Pending] = []
        for handle in handles:
            pending += handle._pending
            handle._pending = []
        return cls(pending)

    def wait(self) -> None:
        """Wait for every collective, record its flight and unpack its results (idempotent)."""
        pending, self._pending = self._pending, []
        for work, finish, flight in pending:
            if work is not None:
                work.wait()
            if flight is not None:
                flight.land()
            finish()
