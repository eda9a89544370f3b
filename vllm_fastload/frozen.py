"""A read-only mapping for the package's frozen records.

A frozen dataclass that holds a ``dict`` can still be changed under whoever holds it (a report's
phases, a header's tensors), and ``types.MappingProxyType``, the standard read-only view, neither
pickles (records cross process boundaries: vLLM's workers, ``verify``'s ranks) nor hashes (a frozen
dataclass hashes its fields). ``FrozenMap`` copies what it is given and does both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """A mapping that cannot change: a copy of ``items`` (a mapping or ``(key, value)`` pairs)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._items: dict[K, V] = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return FrozenMap, (self._items,)


def frozen_map(items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> FrozenMap[K, V]:
    """``items`` as a ``FrozenMap`` (itself where it already is one)."""
    return items if isinstance(items, FrozenMap) else FrozenMap(items)
