"""Rounding and stride arithmetic that every layer needs, written once."""

from __future__ import annotations

import math


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, in integers."""
    return -(-n // d)


def round_up(n: int, granule: int) -> int:
    """The smallest multiple of ``granule`` that is at least ``n``.

    Example:
        >>> round_up(5000, 4096)
        8192
    """
    return ceil_div(n, granule) * granule


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a row-major (contiguous) tensor of ``shape``.

    Example:
        >>> contiguous_strides((2, 3, 4))
        (12, 4, 1)
    """
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
