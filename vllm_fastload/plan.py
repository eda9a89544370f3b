"""Turn "which tensors (or slices) does this rank need" into exactly the byte ranges to read.

A dim-0 slice of a row-major tensor is one contiguous range. A slice along a later dim is
one segment per outer row; the plan either reads those segments one by one ("strided") or
reads the rows that enclose them and narrows afterwards ("enclosing"). The cost rule:

    read row by row  iff  bytes skipped per row >= strided_min_skip

because one extra read call costs about as much as reading ``strided_min_skip`` bytes, and
below one page (4 KiB) the disk transfers the skipped bytes anyway. The default threshold
comes from the backend (``policy.reader_strided_min_skip``) and can be overridden.

Ranges are then coalesced, in file-offset order, into aggregated reads ("chunks") of up to
``aggregate_size`` bytes, and tensors are grouped by transformer layer so that layers complete
in order. Nothing here touches the disk beyond the already-parsed headers.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple, overload

from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.errors import InvalidRequestError, PlanError
from vllm_fastload.format import TensorInfo
from vllm_fastload.layers import LayerKey, layer_key
from vllm_fastload.sizes import contiguous_strides, round_up

if TYPE_CHECKING:
    import torch

#: Buffer positions that start a new read are aligned to this (covers every dtype, and
#: the 4 KiB-friendly sizes GPUDirect Storage prefers are multiples of it).
BUFFER_ALIGN = 64


class ByteRange(NamedTuple):
    """``length`` bytes of a file from ``offset``.

    A named tuple, not a dataclass: a slice holds one per row, made as they are iterated
    (``RowRanges``), and the readers' loops unpack them.
    """

    offset: int
    length: int


@dataclass(frozen=True)
class TensorRequest:
    """A whole tensor, or only ``[start, start + length)`` along ``dim``.

    Several requests may name the same tensor (the q/k/v parts of a fused parameter);
    ``key`` tells them apart in the results and defaults to ``name``. ``layer`` reads it with
    another layer group than its name's (``layers.layer_key``): e.g. ahead of the layers.
    """

    name: str
    dim: int | None = None
    start: int = 0
    length: int | None = None
    key: str | None = None
    layer: LayerKey | None = None

    @property
    def result_key(self) -> str:
        return self.key if self.key is not None else self.name


@dataclass(frozen=True)
class Rows:
    """A slice along a later dim, as the file lays it out: ``count`` segments of ``seg`` bytes,
    ``stride`` bytes apart from ``offset``.

    Readers that understand it read the segments without a Python call per row (the dominant
    cost for a 2048-row slice), and with ``gaps`` read through the bytes between them in one
    call per batch of rows, which is cheaper than a call per row when the gaps are small.
    """

    offset: int
    seg: int
    stride: int
    count: int
    gaps: bool = False
    #: Bytes from the start of each row to the segment (where in the row this slice begins).
    lead: int = 0

    @property
    def span(self) -> int:
        """File bytes from the first segment's start to the last one's end."""
        return (self.count - 1) * self.stride + self.seg if self.count else 0

    @property
    def read_bytes(self) -> int:
        """Bytes the reader moves: the segments, plus the gaps between them if ``gaps``."""
        return self.span if self.gaps else self.seg * self.count

    @property
    def bytes_per_row(self) -> int:
        """Bytes the reader moves per row: the stride when reading through the gaps, else the segment."""
        return self.stride if self.gaps else self.seg

    def ranges(self) -> RowRanges:
        """Each segment's ``ByteRange``, in order."""
        return RowRanges(self)

    def split(self, first: int, count: int) -> Rows:
        """Rows ``[first, first + count)`` of this slice."""
        return Rows(self.offset + first * self.stride, self.seg, self.stride, count, self.gaps, self.lead)


class RowRanges(Sequence[ByteRange]):
    """A slice's segments as ``ByteRange``s, computed when asked for.

    A plan holds one per sliced tensor. Building thousands of tuples per tensor up front would keep
    the loading thread from feeding the reader's threads.
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return self._rows.count

    @overload
    def __getitem__(self, index: int) -> ByteRange: ...

    @overload
    def __getitem__(self, index: slice) -> list[ByteRange]: ...

    def __getitem__(self, index: int | slice) -> ByteRange | list[ByteRange]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("segment index out of range")
        return ByteRange(self._rows.offset + index * self._rows.stride, self._rows.seg)

    def __iter__(self) -> Iterator[ByteRange]:
        offset, stride, seg = self._rows.offset, self._rows.stride, self._rows.seg
        return (ByteRange(offset + i * stride, seg) for i in range(self._rows.count))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RowRanges({self._rows!r})"


#: How a request is read: the whole tensor; one contiguous range of it (a dim-0 slice, or one
#: where every outer dim is 1); a slice along a later dim row by row ("strided"); or the rows
#: enclosing it, narrowed afterwards ("enclosing").
Strategy = Literal["whole", "contiguous", "strided", "enclosing"]


@dataclass(frozen=True, eq=False)  # identity: it may hold the caller's tensor (no elementwise ==)
class PlannedTensor:
    """One request resolved against the file: what to read and how to view it afterwards."""

    request: TensorRequest
    info: TensorInfo
    #: Shape of the result.
    shape: tuple[int, ...]
    strategy: Strategy
    #: The bytes read, in result order (a tuple; a slice's rows as ``RowRanges``, made as iterated).
    ranges: Sequence[ByteRange]
    needed_bytes: int
    layer: LayerKey
    #: For "enclosing": element strides of the view over the read bytes.
    view_strides: tuple[int, ...] | None = None
    #: The caller's destination (``read_into``), where the bytes land directly.
    dest: torch.Tensor | None = None
    #: For "strided" and "enclosing": the same ranges as row geometry, for direct reads.
    rows: Rows | None = None

    @property
    def read_bytes(self) -> int:
        if self.rows is not None:
            return self.rows.read_bytes
        return sum(length for _, length in self.ranges)

    @property
    def key(self) -> str:
        return self.request.result_key


@dataclass(frozen=True)
class ReadOp:
    """One read call: ``length`` bytes at ``file_offset`` into the chunk buffer at ``buf_offset``;
    with ``rows``, a slice's segments (``length`` bytes in all) packed there instead."""

    file_offset: int
    length: int
    buf_offset: int
    rows: Rows | None = None


@dataclass(frozen=True)
class ChunkTensor:
    """A tensor of a chunk, and where its bytes start in the chunk's buffer (0 in a direct chunk,
    whose reads land in the tensor's own ``dest``)."""

    tensor: PlannedTensor
    buf_offset: int


@dataclass(frozen=True)
class Chunk:
    """An aggregated read from one file: the unit of buffering and of reads in flight."""

    file: str
    ops: tuple[ReadOp, ...]
    #: Buffer size needed.
    nbytes: int
    #: In yield order.
    tensors: tuple[ChunkTensor, ...]
    #: Reads land in the tensors' own ``dest``.
    direct: bool = False


@dataclass(frozen=True)
class LayerGroup:
    key: LayerKey
    tensors: tuple[PlannedTensor, ...] = ()
    chunks: tuple[Chunk, ...] = ()

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tensors)


@dataclass(frozen=True)
class Plan:
    groups: tuple[LayerGroup, ...]
    checkpoint_bytes: int

    @property
    def tensors(self) -> tuple[PlannedTensor, ...]:
        return tuple(t for g in self.groups for t in g.tensors)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(c for g in self.groups for c in g.chunks)

    @property
    def read_bytes(self) -> int:
        return sum(g.read_bytes for g in self.groups)

    @property
    def needed_bytes(self) -> int:
        return sum(t.needed_bytes for t in self.tensors)

    @property
    def largest_chunk(self) -> int:
        return max((c.nbytes for c in self.chunks if not c.direct), default=0)

    def bytes_per_file(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            out[t.info.file] += t.read_bytes
        return dict(out)

    def strategy_counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            out[t.strategy] += 1
        return dict(out)

    def summary(self) -> str:
        """Human-readable table: bytes per file and per layer, totals, read amplification."""
        lines = ["bytes per file:"]
        for path, nbytes in sorted(self.bytes_per_file().items()):
            lines.append(f"  {Path(path).name:<40} {_mb(nbytes):>12}")
        lines.append("bytes per layer group:")
        for g in self.groups:
            lines.append(f"  {g.key.name:<14} {len(g.tensors):>5} tensors {_mb(g.read_bytes):>12}"
                         f" in {len(g.chunks)} reads")
        amp = self.read_bytes / self.needed_bytes if self.needed_bytes else 1.0
        frac = self.read_bytes / self.checkpoint_bytes if self.checkpoint_bytes else 0.0
        strategies = ", ".join(f"{k} {v}" for k, v in sorted(self.strategy_counts().items()))
        lines += [
            f"tensors: {len(self.tensors)} ({strategies})",
            f"aggregated reads: {len(self.chunks)}, read calls: {sum(len(c.ops) for c in self.chunks)}",
            f"checkpoint: {_mb(self.checkpoint_bytes)}  needed: {_mb(self.needed_bytes)}  "
            f"read: {_mb(self.read_bytes)} ({frac:.3f} of checkpoint)",
            f"read amplification (read / needed): {amp:.3f}",
        ]
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def plan_tensor(info: TensorInfo, request: TensorRequest, strided_min_skip: int) -> PlannedTensor:
    """Resolve one request into byte ranges (validating dim/start/length against the tensor)."""
    shape, bits, name = info.shape, info.bits, info.name
    layer = request.layer if request.layer is not None else layer_key(name)
    if request.dim is None:
        ranges = (ByteRange(info.start, info.nbytes),) if info.nbytes else ()
        return PlannedTensor(request, info, shape, "whole", ranges, info.nbytes, layer)
    ndim = len(shape)
    dim = request.dim + ndim if request.dim < 0 else request.dim
    if not 0 <= dim < ndim:
        raise InvalidRequestError(
            f"dim {request.dim} is out of range for a tensor of shape {list(shape)}", file=info.file, tensor=name)
    size = shape[dim]
    start = request.start
    length = size - start if request.length is None else request.length
    if start < 0 or length < 0 or start + length > size:
        raise InvalidRequestError(
            f"slice [{start}, {start + length}) along dim {dim} is outside the tensor's size {size} "
            f"(shape {list(shape)})", file=info.file, tensor=name)
    out_shape = shape[:dim] + (length,) + shape[dim + 1:]
    outer = math.prod(shape[:dim])
    inner_bits = math.prod(shape[dim + 1:]) * bits
    if bits % 8 and (dim != 0 or (start * inner_bits) % 8 or (length * inner_bits) % 8):
        raise InvalidRequestError(
            f"a slice of a {info.dtype} tensor must start and end on whole bytes along dim 0",
            file=info.file, tensor=name)
    seg = length * inner_bits // 8
    row = size * inner_bits // 8
    lead = start * inner_bits // 8
    first = info.start + lead
    needed = outer * seg
    if outer == 1 or seg == row or needed == 0:
        # One contiguous range: dim 0, a full-size slice, or everything before `dim` is 1.
        ranges = (ByteRange(first, needed),) if needed else ()
        return PlannedTensor(request, info, out_shape, "contiguous", ranges, needed, layer)
    if row - seg >= strided_min_skip:
        rows = Rows(first, seg, row, outer, lead=lead)
        return PlannedTensor(request, info, out_shape, "strided", rows.ranges(), needed, layer, rows=rows)
    # Read from the first needed byte to the last and view it with the original strides.
    rows = Rows(first, seg, row, outer, gaps=True, lead=lead)
    strides = contiguous_strides(shape)
    return PlannedTensor(request, info, out_shape, "enclosing", (ByteRange(first, rows.span),), needed, layer,
                         view_strides=strides, rows=rows)


def _check_inside(t: PlannedTensor) -> None:
    """Every byte a request reads lies inside its tensor's bytes (ranges are in file order, so the
    first and the last say it), and a contiguous read is exactly what it delivers."""
    if not t.ranges:
        return
    lo = t.ranges[0][0]
    hi = t.ranges[-1][0] + t.ranges[-1][1]
    if lo < t.info.start or hi > t.info.start + t.info.nbytes or lo > hi:
        raise PlanError(f"a read of bytes [{lo}, {hi}) falls outside the tensor's bytes "
                        f"[{t.info.start}, {t.info.start + t.info.nbytes})", file=t.info.file, tensor=t.key)
    if t.strategy in ("whole", "contiguous") and t.read_bytes != t.needed_bytes:
        raise PlanError(f"a contiguous read of {t.read_bytes} bytes delivers {t.needed_bytes}",
                        file=t.info.file, tensor=t.key)


def _align(n: int) -> int:
    return round_up(n, BUFFER_ALIGN)


def _element_align(t: PlannedTensor) -> int:
    return max(1, t.info.bits // 8)


def _one_range(t: PlannedTensor) -> bool:
    """Whether ``t`` is read as (at most) one range of the file, not as a slice's row segments."""
    return t.rows is None or t.rows.gaps


class _ChunkBuilder:
    """A chunk while tensors are added to it (``freeze`` makes the ``Chunk``)."""

    def __init__(self, file: str, direct: bool) -> None:
        self.file, self.direct = file, direct
        self.ops: list[ReadOp] = []
        self.tensors: list[ChunkTensor] = []
        self.nbytes = 0

    def freeze(self) -> Chunk:
        return Chunk(self.file, tuple(self.ops), self.nbytes, tuple(self.tensors), self.direct)


def _buffer_position(chunk: _ChunkBuilder, t: PlannedTensor) -> int:
    """Where ``t`` goes in ``chunk``'s buffer: right after the previous read if it continues it
    in the file (so the two merge into one read call), else at the next aligned position."""
    last = chunk.ops[-1] if chunk.ops else None
    pos = chunk.nbytes
    continues = (last is not None and last.rows is None and _one_range(t) and t.ranges
                 and last.file_offset + last.length == t.ranges[0][0])
    if not (continues and pos % _element_align(t) == 0):
        pos = _align(pos)
    return pos


def _build_chunks(tensors: Sequence[PlannedTensor], aggregate_size: int) -> tuple[Chunk, ...]:
    """Pack tensors (already in file order) into chunks; merge reads contiguous in file and buffer.

    A chunk's buffer (alignment padding included) stays within ``aggregate_size`` unless it
    holds a single tensor larger than that. Direct tensors (read straight into a caller's
    destination) get chunks of their own with no buffer; the executor derives their read
    calls from ``tensor.ranges``.
    """
    chunks: list[_ChunkBuilder] = []
    filled = 0
    for t in tensors:
        current = chunks[-1] if chunks else None
        if current is None or not _joins(current, t, filled, aggregate_size):
            current = _ChunkBuilder(t.info.file, direct=t.dest is not None)
            chunks.append(current)
            filled = 0
        filled += t.read_bytes
        if current.direct:
            current.tensors.append(ChunkTensor(t, 0))
        else:
            _place(current, t)
    return tuple(c.freeze() for c in chunks)


def _joins(chunk: _ChunkBuilder, t: PlannedTensor, filled: int, aggregate_size: int) -> bool:
    """Whether ``t`` goes into ``chunk``: the same file, read the same way (direct or into a
    buffer), and the chunk stays within ``aggregate_size`` (``filled``: its direct bytes so far)."""
    direct = t.dest is not None
    if not chunk.tensors or chunk.file != t.info.file or chunk.direct != direct:
        return False
    end = filled + t.read_bytes if direct else _buffer_position(chunk, t) + t.read_bytes
    return end <= aggregate_size


def _place(chunk: _ChunkBuilder, t: PlannedTensor) -> None:
    """Add a buffered tensor's reads to ``chunk``; reads contiguous in file and buffer merge."""
    pos = _buffer_position(chunk, t)
    chunk.tensors.append(ChunkTensor(t, pos))
    if t.rows is not None and not t.rows.gaps:  # a slice read row by row: one call for all its rows
        chunk.ops.append(ReadOp(t.rows.offset, t.read_bytes, pos, rows=t.rows))
        pos += t.read_bytes
    else:
        for offset, length in t.ranges:
            last = chunk.ops[-1] if chunk.ops else None
            if (last is not None and last.rows is None and last.file_offset + last.length == offset
                    and last.buf_offset + last.length == pos):
                chunk.ops[-1] = replace(last, length=last.length + length)
            else:
                chunk.ops.append(ReadOp(offset, length, pos))
            pos += length
    chunk.nbytes = max(chunk.nbytes, pos)


def plan_requests(checkpoint: Checkpoint, requests: Iterable[TensorRequest | str],
                  strided_min_skip: int) -> list[PlannedTensor]:
    """Each request resolved against the checkpoint's headers into what to read (validated: the
    tensor exists, the slice fits it, every read lies inside its bytes, no result key twice)."""
    planned: list[PlannedTensor] = []
    seen: set[str] = set()
    for req in requests:
        req = TensorRequest(req) if isinstance(req, str) else req
        if req.result_key in seen:
            raise InvalidRequestError("the same result key is requested twice; give each slice a distinct key",
                                      file=checkpoint.source, tensor=req.result_key)
        seen.add(req.result_key)
        t = plan_tensor(checkpoint.info(req.name), req, strided_min_skip)
        _check_inside(t)
        planned.append(t)
    return planned


def build_plan(planned: Iterable[PlannedTensor], *, aggregate_size: int, checkpoint_bytes: int) -> Plan:
    """The per-rank plan: the planned tensors (``plan_requests``, their ``dest`` set where the bytes
    land in the caller's tensor) grouped by layer and coalesced into chunks."""
    layers: dict[LayerKey, list[PlannedTensor]] = {}
    for t in planned:
        layers.setdefault(t.layer, []).append(t)
    groups = []
    for key in sorted(layers):
        tensors = sorted(layers[key], key=lambda t: (t.dest is not None, t.info.file,
                                                     t.ranges[0][0] if t.ranges else t.info.start))
        groups.append(LayerGroup(key, tuple(tensors), _build_chunks(tensors, aggregate_size)))
    return Plan(tuple(groups), checkpoint_bytes)
