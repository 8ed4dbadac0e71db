"""DeAR: data-parallel gradient averaging with the all-reduce decoupled.

Reduce-scatter under backward, all-gather under the next forward (docs/dear.md).
"""

from dkfac.dear.averaging import DeAR

__all__ = ["DeAR"]
