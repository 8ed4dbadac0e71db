"""Fixed-width text tables, as the benchmarks print them."""

from __future__ import annotations

from collections.abc import Sequence


def fixed_width_table(
    header: Sequence[str], widths: Sequence[int], body: Sequence[Sequence[str]], *, left: int = 2
) -> str:
    """Columns of the given widths under a rule; the first ``left`` left-aligned (names)."""

    def line(cells: Sequence[str]) -> str:
        return " ".join(
            f"{cell:<{width}}" if index < left else f"{cell:>{width}}"
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    top = line(header)
    return "\n".join([top, "-" * len(top), *(line(cells) for cells in body)])
