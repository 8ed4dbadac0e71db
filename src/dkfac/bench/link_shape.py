"""The link of an emulated cluster's worker: a rate and an optional one-way delay.

``dkfac bench --network RATE[,DELAY]`` takes it as text, in ``tc``'s units: ``300mbit``,
``1gbit,50us``, ``10gbit,1ms``. Rates are in bits per second (``bit``, ``kbit``, ``mbit``,
``gbit``, decimal prefixes, as ``tc`` reads them); ``tc``'s byte units (``mbps``) are refused
because they are easily taken for bits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
#: Delays divide by their unit's count per second (50us is 50 / 1e6 s, exactly as 50e-6 reads).
_DELAY_UNITS = {"us": 1e6, "ms": 1e3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE)

#: Slowest and fastest rates accepted: below, one ResNet step takes minutes; above, a veth
#: pair on one core cannot carry the rate, so the link would not be the bottleneck.
MIN_RATE_BIT_S = 1e6
MAX_RATE_BIT_S = 40e9


def _quantity(text: str, units: dict[str, float], what: str, *, divide: bool = False) -> float:
    match = _QUANTITY.match(text)
    if match is None or match.group(2).lower() not in units:
        raise ValueError(
            f"{what} {text.strip()!r}: expected a number and one of {', '.join(units)} "
            f"(e.g. 300mbit, 50us)"
        )
    value, unit = float(match.group(1)), units[match.group(2).lower()]
    return value / unit if divide else value * unit


@dataclass(frozen=True)
class LinkShape:
    """Each worker's full-duplex link: ``rate_bit_s`` in each direction, plus ``delay_s``.

    Attributes:
        rate_bit_s: bits per second the link carries in each direction.
        delay_s: one-way delay added to every packet in each direction (0: none); needs the
            kernel's ``netem`` queueing discipline.
    """

    rate_bit_s: float
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not MIN_RATE_BIT_S <= self.rate_bit_s <= MAX_RATE_BIT_S:
            raise ValueError(
                f"link rate {self.rate_bit_s:g} bit/s is outside "
                f"[{MIN_RATE_BIT_S:g}, {MAX_RATE_BIT_S:g}] bit/s"
            )
        if not 0.0 <= self.delay_s <= 1.0:
            raise ValueError(f"link delay {self.delay_s:g} s is outside [0, 1] s")

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """``RATE[,DELAY]`` as ``tc`` writes them, e.g. ``300mbit`` or ``10gbit,50us``.

        Raises:
            ValueError: not a rate with a bit unit, a bad delay, or out of range.
        """
        parts = text.split(",")
        if len(parts) > 2 or not parts[0].strip():
            raise ValueError(f"{text!r}: expected RATE or RATE,DELAY (e.g. 300mbit,1ms)")
        rate = _quantity(parts[0], _RATE_UNITS, "rate")
        delay = _quantity(parts[1], _DELAY_UNITS, "delay", divide=True) if len(parts) == 2 else 0.0
        return cls(rate, delay)

    @property
    def bytes_per_second(self) -> float:
        """Payload bytes per second in one direction at the nominal rate."""
        return self.rate_bit_s / 8.0

    def tc_rate(self) -> str:
        """The rate in ``tc``'s syntax (whole kbit/s)."""
        return f"{round(self.rate_bit_s / 1e3)}kbit"

    def tc_delay(self) -> str:
        """The delay in ``tc``'s syntax (whole microseconds)."""
        return f"{round(self.delay_s * 1e6)}us"

    def label(self) -> str:
        """Short text for tables: ``300 Mbit/s``, ``10 Gbit/s + 50 us``."""
        if self.rate_bit_s >= 1e9:
            rate = f"{self.rate_bit_s / 1e9:g} Gbit/s"
        else:
            rate = f"{self.rate_bit_s / 1e6:g} Mbit/s"
        if self.delay_s == 0.0:
            return rate
        delay = (
            f"{self.delay_s * 1e3:g} ms" if self.delay_s >= 1e-3 else f"{self.delay_s * 1e6:g} us"
        )
        return f"{rate} + {delay}"

    def as_dict(self) -> dict[str, float]:
        """Plain numbers for reports."""
        return {"rate_bit_s": self.rate_bit_s, "delay_s": self.delay_s}
