"""The safetensors format, parsed strictly (checkpoint discovery is in ``checkpoint``).

We parse headers ourselves (instead of asking ``safe_open``) because the plan needs exact
byte offsets before any data is read, and because every failure must become a
:class:`CheckpointError` that names the file and tensor instead of a bare
``struct``/``json`` error. The rules are the ones the safetensors library enforces.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_fastload.errors import (
    HeaderError,
    OutsideCheckpointError,
    TensorMetadataError,
    TruncatedFileError,
)
from vllm_fastload.frozen import FrozenMap

if TYPE_CHECKING:  # a file's bytes come from a source; parsing needs only its interface
    from vllm_fastload.sources.base import Source
    from vllm_fastload.sources.local import FileIdentity

#: Bits per element of every dtype safetensors 0.8 knows.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}

#: Same limit as the safetensors library: a header over 100 MB is treated as corrupt.
MAX_HEADER_BYTES = 100_000_000
#: The largest element count or stride of a shape: torch's sizes and strides are int64.
MAX_ELEMENTS = 2**63 - 1
INDEX_NAME = "model.safetensors.index.json"
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute file offsets, so the plan needs no other context."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """One file's (or object's) parsed header: what it holds and where, nothing open."""

    #: The path or URI (what ``TensorInfo.file`` and every message name).
    path: str
    #: Where the data section starts (8 + the header's length).
    data_offset: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]


class SafetensorsFile:
    """One checkpoint file (or object) held open: its parsed ``header`` and the ``Source`` its
    bytes come from. A local file's source holds its descriptor open, so later reads see the
    same inode."""

    def __init__(self, header: SafetensorsHeader, source: Source) -> None:
        self.header = header
        self.source = source

    @property
    def path(self) -> str:
        """The path or URI (what ``TensorInfo.file`` and every message name)."""
        return self.header.path

    @property
    def fd(self) -> int | None:
        """The local file's descriptor (the host reader's ``preadv`` target); None for an object."""
        return self.source.fd

    @property
    def is_local(self) -> bool:
        """Whether the bytes are in a local file (read with ``preadv`` on ``fd``)."""
        return self.source.fd is not None

    @property
    def identity(self) -> FileIdentity | None:
        """A local file's size, mtime and inode at open (an object is pinned by its ETag instead)."""
        return getattr(self.source, "identity", None) if self.is_local else None

    def check_unchanged(self) -> None:
        """Raise FileChangedError if the file (or object) was modified since its header was parsed."""
        self.source.check_unchanged()

    def close(self) -> None:
        """Close the source (a local file's descriptor); idempotent."""
        self.source.close()


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _overflows(shape: list[int]) -> bool:
    """Whether a shape's element count (multiplied left to right, as safetensors and torch do) or
    torch's largest stride (the dims right of the first, a 0 counted as 1) passes int64. Each loop
    stops at the first overflow: a hostile shape may hold thousands of huge dims."""
    count = 1
    for d in shape:
        count *= d
        if d > MAX_ELEMENTS or count > MAX_ELEMENTS:
            return True
    stride = 1
    for d in shape[1:]:
        stride *= max(d, 1)
        if stride > MAX_ELEMENTS:
            return True
    return False


def _parse_entry(path: str, name: str, entry: object, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise TensorMetadataError("header entry is not a JSON object", file=path, tensor=name)
    missing = [k for k in _ENTRY_KEYS if k not in entry]
    if missing:
        raise TensorMetadataError(f"header entry lacks {', '.join(missing)}", file=path, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise TensorMetadataError(
            f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})", file=path, tensor=name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise TensorMetadataError(
            f"shape must be a list of non-negative integers, got {shape!r}", file=path, tensor=name)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)):
        raise TensorMetadataError(
            f"data_offsets must be two integers, got {offsets!r}", file=path, tensor=name)
    if _overflows(shape):
        raise TensorMetadataError(f"shape {shape} overflows: its element count or largest stride passes "
                                  f"{MAX_ELEMENTS}", file=path, tensor=name)
    numel = math.prod(shape)
    begin, end = offsets
    if begin < 0 or end < begin:
        raise TensorMetadataError(f"data_offsets {offsets} are not a valid range", file=path, tensor=name)
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise TensorMetadataError(
            f"dtype {dtype} x shape {shape} needs {bits / 8:g} bytes but data_offsets {offsets} "
            f"span {end - begin}", file=path, tensor=name)
    if end > data_len:
        raise TruncatedFileError(
            f"data_offsets {offsets} reach past the end of the data section ({data_len} bytes); "
            "the file is truncated", file=path, tensor=name)
    return dtype, tuple(shape), begin, end


def _check_layout(path: str, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no gap, nothing left over."""
    spans.sort()
    cursor, previous = 0, None
    for begin, end, name in spans:
        if begin < cursor:
            raise TensorMetadataError(
                f"data_offsets [{begin}, {end}] overlap tensor {previous!r} (ends at {cursor})",
                file=path, tensor=name)
        if begin > cursor:
            raise TensorMetadataError(
                f"gap of {begin - cursor} bytes before this tensor in the data section",
                file=path, tensor=name)
        cursor, previous = end, name
    if cursor != data_len:
        raise HeaderError(
            f"data section is {data_len} bytes but the tensors cover {cursor}", file=path)


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is a string of Unicode scalars: JSON's ``\\udXXX`` escapes can spell a lone
    surrogate, which Python's json accepts and safetensors (and UTF-8) refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_header_bytes(path: str, raw: bytes, data_len: int) -> tuple[dict[str, tuple[Any, ...]], dict[str, str]]:
    """Validate a header's JSON text; returns ``{name: (dtype, shape, begin, end)}`` and metadata."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})", file=path) from exc
    if not text.lstrip().startswith("{"):
        raise HeaderError("header is not a JSON object (does not start with '{')", file=path)
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise HeaderError(f"header is not valid JSON: {exc}", file=path) from exc
    if not isinstance(doc, dict):
        raise HeaderError("header is not a JSON object", file=path)
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is no metadata, as in safetensors
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise HeaderError("__metadata__ must map strings to strings", file=path)
    for text in (*doc, *metadata, *metadata.values()):
        if not _is_unicode(text):
            raise HeaderError(f"header names {text!r}, which holds a lone surrogate (\\ud800-\\udfff): not a "
                              "Unicode string", file=path)
    entries = {name: _parse_entry(path, name, entry, data_len) for name, entry in doc.items()}
    _check_layout(path, [(b, e, n) for n, (_, _, b, e) in entries.items()], data_len)
    return entries, metadata


def header_length(path: str, first8: bytes | memoryview, size: int) -> int:
    """The header length a file's first 8 bytes state, checked against the file's size."""
    if size == 0:
        raise HeaderError("file is empty", file=path)
    if size < 8:
        raise HeaderError(f"file is {size} bytes, too short for the 8-byte header length", file=path)
    n = int.from_bytes(bytes(first8[:8]), "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; this is not a "
                          "safetensors file or it is corrupt", file=path)
    if n > size - 8:
        raise HeaderError(f"header length {n} reaches beyond the end of the {size}-byte file", file=path)
    return n


def parse_file(source: Source, header: bytes) -> SafetensorsFile:
    """A ``SafetensorsFile`` from a source and its header's JSON bytes (the ``header_length`` bytes after
    the first 8): local files and objects differ only in how those bytes were fetched."""
    return SafetensorsFile(parse_header(source.uri, source.size, header), source)


def parse_header(path: str, size: int, header: bytes) -> SafetensorsHeader:
    """The header of a file of ``size`` bytes at ``path``, from its header's JSON bytes."""
    data_offset = 8 + len(header)
    entries, metadata = parse_header_bytes(path, header, size - data_offset)
    tensors = {
        name: TensorInfo(name, path, dtype, shape, data_offset + begin, data_offset + end)
        for name, (dtype, shape, begin, end) in entries.items()
    }
    return SafetensorsHeader(path, data_offset, FrozenMap(tensors), FrozenMap(metadata))


def parse_weight_map(path: str, text: bytes) -> dict[str, str]:
    """An index's ``weight_map`` (tensor -> file name inside the checkpoint), validated; errors name
    ``path``. Each file name comes back normalised (``member_name``), so callers join it to the
    checkpoint's directory or prefix and open nothing else."""
    try:
        doc = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise HeaderError(f"cannot read index: {exc}", file=path) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise HeaderError("index has no 'weight_map' of tensor name -> file name", file=path)
    members: dict[str, str] = {}  # each distinct entry checked once (a large index names few files)
    for name, entry in weight_map.items():
        if entry not in members:
            members[entry] = member_name(path, name, entry)
    return {name: members[entry] for name, entry in weight_map.items()}


def member_name(index: str, tensor: str, entry: str) -> str:
    """``entry``, a file name from the index at ``index``, as a relative path that stays inside the
    checkpoint, resolved lexically (``sub/../a.safetensors`` is ``a.safetensors``).

    Lexically, not through the filesystem: a checkpoint's own file may be a symlink to elsewhere
    (the Hugging Face cache links each snapshot file to ``../../blobs/``), and it is the
    checkpoint's file wherever it points; what the index may not do is name a path that leaves
    the directory (or object prefix): ``..``, an absolute path, a URI of another store or bucket.
    The caller opens the normalised name, so the kernel never walks a ``..`` either.
    """
    def refuse(why: str) -> OutsideCheckpointError:
        return OutsideCheckpointError(f"index entry {entry!r} for this tensor {why}; fastload reads only the "
                                      "checkpoint's own files", file=index, tensor=tensor)

    if not entry or "\0" in entry:
        raise refuse("is empty or holds a NUL byte")
    if "://" in entry:
        raise refuse("names another store or scheme")
    if entry.startswith(("/", "\\")):
        raise refuse("is an absolute path")
    name = posixpath.normpath(entry)
    if name == ".." or name.startswith("../"):
        raise refuse("leaves the checkpoint's directory")
    if name == ".":
        raise refuse("names the checkpoint's directory itself, not a file in it")
    return name
