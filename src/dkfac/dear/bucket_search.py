"""Online choice of a fusion bucket size from measured iteration times.

Pure bookkeeping (no ``torch.distributed``): the caller times its iterations, feeds them in,
switches to :attr:`BucketSizeSearch.current` when asked, and makes the final medians agree
across ranks before :meth:`BucketSizeSearch.choose`.

Why a grid and not Bayesian optimisation (DeAR's paper tunes 1-256 MB with a Gaussian process):
what the size changes is the bucket layout, and a model has few distinct layouts on a
power-of-two grid (sizes that cut the parameters at the same places are one candidate). With
at most ~7 candidates of a few iterations each, measuring every one costs tens of iterations
once, is exact on its grid, and has no surrogate-model hyperparameters to get wrong; a GP pays
off when evaluations are many or continuous, which they are not here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

#: MiB searched by ``DeAR(bucket_cap_mb="auto")`` unless told otherwise: 64 KiB to 64 MiB.
DEFAULT_AUTO_RANGE_MB: tuple[float, float] = (1 / 16, 64.0)


def power_of_two_sizes(low_mb: float, high_mb: float) -> list[float]:
    """``low, 2·low, 4·low, ...`` up to ``high`` (``high`` itself included when off the grid).

    Raises:
        ValueError: ``low_mb`` not positive or greater than ``high_mb``.
    """
    if not (math.isfinite(low_mb) and math.isfinite(high_mb)) or not 0 < low_mb <= high_mb:
        raise ValueError(
            f"auto_range_mb=({low_mb!r}, {high_mb!r}) is not allowed: expected "
            "0 < low <= high (MiB)"
        )
    sizes = []
    size = low_mb
    while size < high_mb * (1 + 1e-9):
        sizes.append(size)
        size *= 2
    if not math.isclose(sizes[-1], high_mb):
        sizes.append(high_mb)
    return sizes


def distinct_candidates(sizes: Sequence[float], layout: Callable[[float], Hashable]) -> list[float]:
    """The smallest size of each distinct ``layout(size)``, in the order given."""
    seen: set[Hashable] = set()
    kept = []
    for size in sizes:
        key = layout(size)
        if key not in seen:
            seen.add(key)
            kept.append(size)
    return kept


@dataclass
class BucketSizeSearch:
    """Measure each candidate for ``warmup_steps + trial_steps`` iterations; keep the fastest.

    Attributes:
        candidates: bucket sizes in MiB, measured in this order.
        trial_steps: timed iterations per candidate (their median is the candidate's time).
        warmup_steps: iterations discarded after each switch (they pay the re-bucketing).
    """

    candidates: list[float]
    trial_steps: int = 5
    warmup_steps: int = 1
    medians: list[float] = field(default_factory=list)
    _times: list[float] = field(default_factory=list)
    _seen: int = 0

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates must not be empty")
        if self.trial_steps < 1:
            raise ValueError(f"trial_steps={self.trial_steps!r} is not allowed: expected >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} is not allowed: expected >= 0")

    @property
    def current(self) -> float:
        """The size being measured (the last one once every candidate is measured)."""
        return self.candidates[min(len(self.medians), len(self.candidates) - 1)]

    @property
    def measured_all(self) -> bool:
        """Whether every candidate has its median."""
        return len(self.medians) == len(self.candidates)

    def record(self, seconds: float) -> bool:
        """Add one iteration time of :attr:`current`; True when it just got its median.

        The caller then switches to the new :attr:`current` (or, once :attr:`measured_all`,
        agrees on :attr:`medians` and calls :meth:`choose`).
        """
        if self.measured_all:
            return False
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return False
        self._times.append(seconds)
        if len(self._times) < self.trial_steps:
            return False
        self.medians.append(statistics.median(self._times))
        self._times, self._seen = [], 0
        return True

    def choose(self, medians: Sequence[float]) -> float:
        """The candidate with the smallest (agreed) median; ties go to the smaller size."""
        if len(medians) != len(self.candidates):
            raise ValueError(f"got {len(medians)} medians for {len(self.candidates)} candidates")
        best = min(range(len(medians)), key=lambda i: (medians[i], self.candidates[i]))
        return self.candidates[best]
