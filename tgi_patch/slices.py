"""Stand-ins for safetensors' ``safe_open`` handle and ``PySafeSlice``, backed by the core.

TGI's quantised loaders and several model files call ``weights._get_slice(name)`` and
index the result (``[a:b]``, ``[:, a:b]``, ``[-n:]``, ``[:, -n:]``), so the slice must index
exactly as safetensors does while reading only the rows or columns asked for.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from types import EllipsisType
from typing import Any

import torch

from tgi_patch.files import CheckpointFiles

#: Called with the tensor name after every read (FastWeights counts served tensors with it).
OnRead = Callable[[str], None]


class FastSlice:
    """``get_shape()``, ``get_dtype()`` and indexing of one tensor, like safetensors' slice object."""

    def __init__(self, files: CheckpointFiles, filename: str, name: str, on_read: OnRead | None = None) -> None:
        self._files = files
        self._filename = filename
        self._name = name
        self._info = files.info(filename, name)
        self._on_read = on_read

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The safetensors dtype string ("BF16", "F8_E4M3", "I32", ...), as safetensors returns it."""
        return self._info.dtype

    def __getitem__(self, key: Any) -> torch.Tensor:
        items = _normalize(key, self._info.shape)
        # Lists, None, tensors (rare): read everything and let torch index it.
        tensor = self._files.read(self._filename, self._name)[key] if items is None else self._read(items)
        if self._on_read is not None:
            self._on_read(self._name)
        return tensor

    def _read(self, items: list[slice | int]) -> torch.Tensor:
        """Read the one dimension that narrows first; index any others in memory."""
        shape = self._info.shape
        for dim, item in enumerate(items):
            start, stop, local = _extent(item, shape[dim])
            if local == slice(None):
                continue
            tensor = self._files.read(self._filename, self._name, dim, start, stop - start)
            rest = (*items[:dim], local, *items[dim + 1:])
            return tensor[rest].contiguous()
        return self._files.read(self._filename, self._name)


class FastHandle:
    """What ``Weights._get_handle`` returns: ``keys``, ``metadata``, ``get_slice``, ``get_tensor`` of one file."""

    def __init__(self, files: CheckpointFiles, filename: str, on_read: OnRead | None = None) -> None:
        self._files = files
        self._filename = filename
        self._on_read = on_read
        self._sf = files.file(filename)

    def keys(self) -> list[str]:
        return sorted(self._sf.tensors)

    def metadata(self) -> dict[str, str] | None:
        return dict(self._sf.metadata) or None

    def get_slice(self, name: str) -> FastSlice:
        return FastSlice(self._files, self._filename, name, self._on_read)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._files.read(self._filename, name)
        if self._on_read is not None:
            self._on_read(name)
        return tensor

    def __enter__(self) -> FastHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _normalize(key: Any, shape: tuple[int, ...]) -> list[slice | int] | None:
    """One slice or int per dimension, with safetensors' errors; None for index kinds we hand to torch
    (lists, None, tensors, several ellipses), which indexes them as safetensors does."""
    items = list(key) if isinstance(key, tuple) else [key]
    if not all(isinstance(i, slice | EllipsisType) or _is_index(i) for i in items):
        return None
    ellipses = sum(1 for i in items if i is Ellipsis)
    if ellipses > 1:
        return None  # safetensors and torch both accept several, with the same (odd) meaning
    explicit = len(items) - ellipses
    if explicit > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    if ellipses:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - explicit)
    items += [slice(None)] * (len(shape) - len(items))
    out: list[slice | int] = []
    for dim, item in enumerate(items):
        if isinstance(item, slice):
            if item.step is not None and operator.index(item.step) <= 0:
                raise ValueError("step must be greater than zero")
            out.append(item)
            continue
        index = operator.index(item)
        size = shape[dim]
        if not -size <= index < size:
            raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")
        out.append(index + size if index < 0 else index)
    return out


def _is_index(value: Any) -> bool:
    if isinstance(value, bool | torch.Tensor):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _extent(item: slice | int, size: int) -> tuple[int, int, slice | int]:
    """The contiguous ``[start, stop)`` an index touches, and the index relative to ``start``."""
    if isinstance(item, int):
        return item, item + 1, 0
    start, stop, step = item.indices(size)
    if (start, stop, step) == (0, size, 1):
        return 0, size, slice(None)
    count = len(range(start, stop, step))
    if count == 0:
        return start, start, slice(0, 0)
    last = start + (count - 1) * step
    return start, last + 1, slice(0, last + 1 - start, step)
