"""When a collective is really in flight: from its launch to the completion of its work.

The communicator stamps each collective's launch and asks its work's future to stamp the
completion. The future's callback runs on a backend thread, so it writes only into the
:class:`Flight` that belongs to its own collective; the training thread reads that slot when
it waits for the collective (:meth:`Flight.land`) and only then hands the span to the
:class:`~dkfac.comm.recorder.StepRecorder`, whose lists no other thread touches.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import Tensor

from dkfac.comm.recorder import StepRecorder

logger = logging.getLogger(__name__)


class Flight:
    """One collective of ``phase``: its launch and (once its future ran) completion time.

    Times are on the recorder's clock (:meth:`StepRecorder.now`, ``time.perf_counter``).

    Args:
        recorder: where :meth:`land` adds the in-flight span.
        phase: the phase the collective is counted in.
        launched: when it was launched.
        future: the work's future (``work.get_future()``); its callback stamps the completion.
    """

    __slots__ = ("_recorder", "_stamped", "completed", "launched", "phase")

    def __init__(self, recorder: StepRecorder, phase: str, launched: float, future: Any) -> None:
        self._recorder = recorder
        self.phase = phase
        self.launched = launched
        self.completed: float | None = None
        # Completes once the callback has written ``completed`` (at once if the work is done).
        self._stamped: Any = future.then(self._stamp)

    def _stamp(self, future: Any) -> None:
        """The future's callback, on a backend thread: note the time, in this slot only."""
        self.completed = time.perf_counter()

    def land(self) -> None:
        """After the collective's ``wait()``: add its in-flight span to the recorder.

        The work can report completion to its waiters before its future runs the callback,
        so this waits for the callback's own future first (microseconds: the work is done).
        """
        if self._stamped is not None:
            self._stamped.wait()
            self._stamped = None
        if self.completed is not None:
            self._recorder.in_flight(self.phase, self.launched, self.completed)


def follow(
    work: Any, buffer: Tensor, recorder: StepRecorder, phase: str, launched: float
) -> Flight | None:
    """A :class:`Flight` stamped when ``work`` completes, or ``None`` when that cannot be known.

    Only host buffers are followed: a collective on device memory (NCCL) completes its
    future as soon as it is enqueued on a stream, so the callback's time would be the launch
    time, not the end of the transfer. Work without a future (``None``, or a backend that has
    none) is not followed either: nothing is recorded rather than a guessed end.
    """
    if work is None or buffer.device.type != "cpu":
        return None
    try:
        future = work.get_future()
    except (AttributeError, NotImplementedError, RuntimeError) as error:
        logger.debug("collective of %s has no future (%s): not traced in flight", phase, error)
        return None
    return Flight(recorder, phase, launched, future)
