"""How a Kronecker factor of side ``d`` is held: a ``d × d`` matrix, or only its diagonal.

Most factors are dense symmetric matrices. Some are diagonal by construction: an embedding's
``A`` is the Gram of one-hot rows, ``diag(counts)`` (:mod:`dkfac.curvature.embedding`), and a
vocabulary of 50,000 tokens would make it a 10 GB matrix holding 50,000 numbers. Such a factor
is held as its diagonal, a ``d``-vector: it is averaged and sent as the vector, and its
decomposition is elementwise (the eigenvectors of a diagonal matrix are the identity).

A block says so through its side: :class:`DiagonalSide` is an ``int`` (the side ``d``,
wherever a side is asked for) that marks the factor diagonal. Everything that sizes or costs
a factor asks the functions below instead of computing ``d²`` itself, so that planners, byte
accounting and the simulator count a diagonal factor as what it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

#: The two Kronecker factors of a layer: ``"a"`` (input side) and ``"g"`` (output gradient side).
FACTOR_SIDES: tuple[str, str] = ("a", "g")


class DiagonalSide(int):
    """The side ``d`` of a Kronecker factor held as its diagonal (a ``d``-vector).

    An ``int`` equal to ``d``; arithmetic on it gives plain ints (a side computed from it is
    a dense factor's unless marked again).
    """

    def __repr__(self) -> str:
        return f"DiagonalSide({int(self)})"

    def __str__(self) -> str:  # as a number in messages and tables (int's str is its repr)
        return str(int(self))


def is_diagonal(dim: int) -> bool:
    """Whether a factor of side ``dim`` is held as its diagonal."""
    return isinstance(dim, DiagonalSide)


def factor_shape(dim: int) -> tuple[int, ...]:
    """The factor's tensor shape: ``(d,)`` (diagonal) or ``(d, d)``."""
    return (int(dim),) if is_diagonal(dim) else (int(dim), int(dim))


def factor_values(dim: int) -> int:
    """Values a factor holds: ``d`` (diagonal) or ``d²``."""
    return int(dim) if is_diagonal(dim) else int(dim) * int(dim)


def packed_factor_values(dim: int) -> int:
    """Values a factor sends: ``d`` (diagonal) or its upper triangle, ``d(d+1)/2``."""
    d = int(dim)
    return d if is_diagonal(dim) else d * (d + 1) // 2


def decomposition_work(dim: int) -> float:
    """Relative cost of decomposing the factor: ``d`` (elementwise) or ``d³``."""
    d = float(dim)
    return d if is_diagonal(dim) else d**3


def preconditioning_work(a_dim: int, g_dim: int) -> int:
    """Relative cost of preconditioning a ``(d_G, d_A)`` gradient: ``d_G·d_A·(d_G + d_A)``.

    A product with each dense factor's basis costs ``d_G·d_A`` times its side; a diagonal
    factor scales the gradient elementwise (counted as one side of 1).
    """
    sides = sum(int(side) if not is_diagonal(side) else 1 for side in (a_dim, g_dim))
    return int(g_dim) * int(a_dim) * sides


def largest_dense_side(sides: Iterable[int]) -> int:
    """The largest side of the dense factors among ``sides`` (1 when there are none).

    What calibrating decompositions must reach: a diagonal factor's side, however large,
    costs no matrix decomposition.
    """
    return max((int(side) for side in sides if not is_diagonal(side)), default=1)


def diagonal_flags(dims: tuple[int, int]) -> dict[str, bool]:
    """``{"a_diagonal": ..., "g_diagonal": ...}`` of a layer's ``(d_A, d_G)`` (for JSON)."""
    return {"a_diagonal": is_diagonal(dims[0]), "g_diagonal": is_diagonal(dims[1])}


def marked(dim: int, diagonal: bool) -> int:
    """``dim`` as :class:`DiagonalSide` if ``diagonal`` (read back from JSON), else an int."""
    return DiagonalSide(dim) if diagonal else int(dim)


def sent_symmetric(factors: Sequence[Tensor]) -> list[bool]:
    """Per factor (or factor sum), whether it travels as its upper triangle.

    A matrix does (it is symmetric); a diagonal factor, a vector, travels whole.
    """
    return [factor.dim() == 2 for factor in factors]
