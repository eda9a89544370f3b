"""``Source``: one checkpoint file's bytes, wherever they live.

The format parser, the plan and the readers need only this much of a file: a name for
messages, a size, a way to fill buffers from offsets, and a check that the bytes did not
change. Local files also expose their descriptor (``fd``) because the host reader issues
``preadv`` on it directly; object stores have none (``fd is None``) and are read through
``submit_ranges_into``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol, runtime_checkable


class RangeInto(NamedTuple):
    """A file's bytes from ``offset`` into ``view`` (as many as the view holds).

    A named tuple, not a dataclass: a slice read from an object is one per row, made on the
    loading thread.
    """

    offset: int
    view: memoryview


@runtime_checkable
class Source(Protocol):
    """What fastload needs of one file or object."""

    @property
    def uri(self) -> str:
        """The path or URI every message names."""

    @property
    def size(self) -> int:
        """Bytes in the file or object when it was opened."""

    @property
    def fd(self) -> int | None:
        """An OS descriptor for ``preadv`` (local files), or None (object stores)."""

    def read_into(self, offset: int, view: memoryview, *, tensor: str | None = None) -> None:
        """Fill ``view`` with the bytes from ``offset``, or raise a ``CheckpointError``."""

    def submit_ranges_into(self, ranges: Sequence[RangeInto], *, tensor: str | None = None) -> Future[None]:
        """Start filling each range; the future completes once all finished (or raises)."""

    def check_unchanged(self) -> None:
        """Raise ``FileChangedError`` if the bytes are no longer those opened."""

    def close(self) -> None:
        """Release what the source holds (a descriptor); idempotent."""
