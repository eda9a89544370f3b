"""Row exchange: ranks that each need a column slice of the same tensor read whole rows and swap columns.

A row-parallel weight's slice on a rank is part of every row. From a warm page cache that is
cheap (row-wise ``preadv``), but an object store answers one range per request: a rank either
pays one request per row or reads the rows whole, and at TP=2 the ranks then fetch the
row-parallel weights twice over. Instead each rank of the group
reads a contiguous block of whole rows (``row_requests``) and, once a layer is delivered, one
``all_to_all`` per layer sends every other rank the columns it takes from those rows. Every
byte is fetched once in the group, in large reads.

The same machinery serves replicas (``agree_replicas``): ranks that each need the same slice of a
tensor (the data-parallel ranks of an MoE hold the same attention, embeddings and norms) each
read a block of its rows, and send every other rank the whole block.
Every byte of what they hold alike is fetched once among them, not once per rank. A replica
after the last layer (the head: as large as the embeddings) is read with the embeddings, ahead
of the layers: each layer's exchange overlaps the reads of the layers after it, and nothing
comes after the last one.

Engine-independent: the ranks talk through ``Collectives``, over any ``torch.distributed
process group that runs ``all_gather_object`` and ``all_to_all_single`` on host tensors (gloo);
the vLLM loader passes its tensor-parallel CPU group. Every rank of the group must call ``agree`` once, and then run its
read with the exchange's requests and hooks: the collectives happen in the same order on every
rank because layers are read in the same order (``plan`` sorts them) and the tensors shared in
a layer are exchanged in name order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_fastload.errors import CheckpointError
from vllm_fastload.format import TensorInfo
from vllm_fastload.layers import EMBEDDINGS, FINAL, LayerKey, layer_key
from vllm_fastload.plan import LayerGroup, TensorRequest
from vllm_fastload.sizes import round_up
from vllm_fastload.tensors import dtype_of, shape_of

#: Pieces are packed at this alignment in the swap buffers, so that each can be viewed as its dtype.
PIECE_ALIGN = 16


def _padded(nbytes: int) -> int:
    return round_up(nbytes, PIECE_ALIGN)


@dataclass(frozen=True)
class Span:
    """``[start, start + length)`` along one dim of a shared tensor: the columns a rank keeps (its
    sliced dim), or the whole rows it reads for the group (dim 0)."""

    start: int
    length: int


@dataclass(frozen=True)
class SharedTensor:
    """One tensor every rank of the group needs part of, read as blocks of whole rows: each rank
    slices it along ``dim`` (>= 1) and keeps its ``columns`` of every block, or (``dim`` None,
    replicas) every rank needs the same rows ``[offset, offset + rows)`` and keeps every block."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    #: Per group rank: the columns it keeps (empty for replicas).
    columns: tuple[Span, ...]
    #: Per group rank: the rows it reads for everyone, from ``offset``.
    rows: tuple[Span, ...]
    #: Where the rows the ranks need start along dim 0 (replicas of a row slice).
    offset: int = 0
    #: The layer group its rows are read with, where not its own (``read_with``).
    layer: LayerKey | None = None

    def piece_shape(self, row_rank: int, column_rank: int) -> list[int]:
        """Shape of ``column_rank``'s part of ``row_rank``'s rows."""
        shape = list(self.shape)
        shape[0] = self.rows[row_rank].length
        if self.dim is not None:
            shape[self.dim] = self.columns[column_rank].length
        return shape

    def row_request(self, rank: int) -> TensorRequest:
        """What ``rank`` reads of it: its block of whole rows (under a key of its own)."""
        block = self.rows[rank]
        first = self.offset + block.start
        return TensorRequest(self.name, dim=0, start=first, length=block.length,
                             key=f"{self.name}[rows {first}:{first + block.length}]", layer=self.layer)


def read_with(name: str) -> LayerKey | None:
    """The layer group a replica's rows are read with: the embeddings' for one after the last
    layer, whose exchange would otherwise follow the last read; None: its own."""
    return LayerKey(EMBEDDINGS) if layer_key(name).stage == FINAL else None


@dataclass(frozen=True)
class ExchangeStats:
    """What one rank's exchange did, for the loader's summary line."""

    tensors: int = 0
    layers: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Layout:
    """What every rank must agree on to share a tensor."""

    shape: tuple[int, ...]
    #: The checkpoint's dtype name (``TensorInfo.dtype``).
    dtype: str
    dim: int


@dataclass(frozen=True)
class Candidate:
    """What a rank says of one tensor it slices along a later dim."""

    #: The tensor's shape in torch's units.
    shape: tuple[int, ...]
    #: The checkpoint's dtype name (``TensorInfo.dtype``).
    dtype: str
    dim: int
    start: int
    length: int

    @property
    def layout(self) -> Layout:
        return Layout(self.shape, self.dtype, self.dim)


def candidates(targets: Mapping[TensorRequest, object], infos: Mapping[str, TensorInfo]) -> dict[str, Candidate]:
    """This rank's slices along a later dim, one per tensor. Shapes in torch's units (an F4
    tensor's last dim is packed), as the requests are. A tensor asked for more than once is left
    to the plain read (no single slice to swap)."""
    seen: dict[str, int] = {}
    found: dict[str, Candidate] = {}
    for req in targets:
        seen[req.name] = seen.get(req.name, 0) + 1
        info = infos[req.name]
        shape = tuple(shape_of(info))
        if req.dim is None or len(shape) < 2:
            continue
        dim = req.dim % len(shape)
        if dim == 0:
            continue  # a dim-0 slice is already one contiguous range
        length = shape[dim] - req.start if req.length is None else req.length
        found[req.name] = Candidate(shape, info.dtype, dim, req.start, length)
    return {name: c for name, c in found.items() if seen[name] == 1}


class Collectives:
    """The two collectives the exchange runs, over a ``torch.distributed`` group of host tensors."""

    def __init__(self, group: object, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def all_gather_object(self, obj: object) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int],
                   send_sizes: list[int]) -> None:
        """``send[...]`` split by ``send_sizes`` to the ranks in order; ``recv`` split by ``recv_sizes`` from them."""
        import torch.distributed as dist

        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)


def _split_rows(count: int, world: int) -> tuple[Span, ...]:
    bounds = [count * q // world for q in range(world + 1)]
    return tuple(Span(bounds[q], bounds[q + 1] - bounds[q]) for q in range(world))


@dataclass(frozen=True)
class Replica:
    """What a rank says of one tensor it needs rows ``[start, start + length)`` of, whole otherwise."""

    #: The tensor's shape in torch's units.
    shape: tuple[int, ...]
    #: The checkpoint's dtype name (``TensorInfo.dtype``).
    dtype: str
    start: int
    length: int


def replicas(targets: Mapping[TensorRequest, object], infos: Mapping[str, TensorInfo]) -> dict[str, Replica]:
    """This rank's requests of whole tensors and of row slices (dim 0), one per tensor, where the
    bytes land in a destination; a tensor asked for more than once is left to the plain read."""
    seen: dict[str, int] = {}
    found: dict[str, Replica] = {}
    for req, dest in targets.items():
        seen[req.name] = seen.get(req.name, 0) + 1
        info = infos[req.name]
        shape = tuple(shape_of(info))
        if dest is None or not shape or (req.dim is not None and req.dim % len(shape) != 0):
            continue
        start = req.start if req.dim is not None else 0
        length = shape[0] - start if req.dim is None or req.length is None else req.length
        found[req.name] = Replica(shape, info.dtype, start, length)
    return {name: r for name, r in found.items() if seen[name] == 1}


def _offers(collectives: Collectives, make: Callable[[], dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Every rank's offers (``make``'s, or None: this rank offers nothing), in rank order; None
    unless every rank offered. Taken by every rank once, also by one whose ``make`` fails."""
    try:
        mine = None if make is None else make()
    except BaseException:
        collectives.all_gather_object(None)  # the others must not wait for this rank
        raise
    offers = collectives.all_gather_object(mine)
    return None if any(o is None for o in offers) else offers


def agree_replicas(collectives: Collectives, targets: Mapping[TensorRequest, torch.Tensor] | None,
                   infos: Mapping[str, TensorInfo], group: str = "data-parallel group") -> RowExchange | None:
    """Find, with every rank of ``group``, the tensors all of them need the same rows of, whole
    otherwise; each then reads a block of those rows for everyone (as ``agree``; None when
    nothing is shared). What the ranks need differently (their experts) is read as before."""
    world = collectives.world
    everyone = _offers(collectives, None if targets is None else lambda: replicas(targets, infos))
    if everyone is None or targets is None:
        return None
    shared: dict[str, SharedTensor] = {}
    for name in sorted(set.intersection(*(set(o) for o in everyone))):
        if len({o[name] for o in everyone}) != 1:
            continue  # another slice on some rank: each reads its own
        replica = everyone[0][name]
        if replica.length < world:
            continue  # fewer rows than ranks: not worth a special case
        shared[name] = SharedTensor(name, replica.shape, None, (), _split_rows(replica.length, world),
                                    offset=replica.start, layer=read_with(name))
    if not shared:
        return None
    dests = {req.name: dest for req, dest in targets.items() if req.name in shared}
    return RowExchange(collectives, shared, dests, infos, group)


def agree(collectives: Collectives, targets: Mapping[TensorRequest, torch.Tensor] | None,
          infos: Mapping[str, TensorInfo]) -> RowExchange | None:
    """Find, with every rank of the group, the tensors all of them slice along the same later dim.

    Every rank must call this once (``targets`` None: this rank reads nothing by plan, e.g. it
    falls back to whole reads, or does not offer to share; then no rank exchanges). Returns None
    when nothing is shared.
    """
    world = collectives.world
    everyone = _offers(collectives, None if targets is None else lambda: candidates(targets, infos))
    if everyone is None:
        return None
    shared: dict[str, SharedTensor] = {}
    for name in sorted(set.intersection(*(set(c) for c in everyone))):
        # Same shape, dtype and dim on every rank (ranks reading different copies share nothing).
        if len({c[name].layout for c in everyone}) != 1:
            continue
        layout = everyone[0][name].layout
        if layout.shape[0] < world:
            continue  # fewer rows than ranks: some rank would read nothing; not worth a special case
        columns = tuple(Span(c[name].start, c[name].length) for c in everyone)
        shared[name] = SharedTensor(name, layout.shape, layout.dim, columns, _split_rows(layout.shape[0], world))
    if not shared or targets is None:
        return None
    dests = {req.name: dest for req, dest in targets.items() if req.name in shared}
    return RowExchange(collectives, shared, dests, infos)


class RowExchange:
    """This rank's part of the exchange: its row reads, where the columns go, and the collectives.

    Each layer's swap starts with a status round (every rank says whether it is still loading),
    so that a rank whose read fails tells the others (``abort``) instead of leaving them waiting
    in the swap: all ranks then stop with an error.
    """

    def __init__(self, collectives: Collectives, shared: dict[str, SharedTensor], dests: dict[str, torch.Tensor],
                 infos: Mapping[str, TensorInfo], group: str = "tensor-parallel group") -> None:
        self.collectives = collectives
        #: What the ranks are to one another, for errors ("tensor-parallel group").
        self.group = group
        self.shared = shared
        #: This rank's destination (its column slice) of every shared tensor.
        self.dests = dests
        self.infos = infos
        #: This rank's row reads, and the tensor each is of.
        self._row_reads = {s.row_request(self.rank): s for s in shared.values()}
        #: Replicas whose block this rank reads straight into its own rows of the destination
        #: (``direct_targets``): no read buffer, so an object store's link is kept busy as for
        #: any read into a parameter. Where the destination converts the dtype, the block is read
        #: as a slab (``take``), as the others receive the checkpoint's bytes.
        self._direct = {req: s for req, s in self._row_reads.items()
                        if s.dim is None and dests[s.name].dtype == dtype_of(infos[s.name])}
        self._outgoing: dict[str, list[torch.Tensor]] = {}
        self._done: set[str] = set()
        #: A collective failed half-way, or a peer reported its failure: no further collective.
        self._broken = False
        # What ``stats`` reports, counted as the swaps go.
        self._tensors = self._layers = self._bytes_sent = 0
        self._seconds = 0.0

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def world(self) -> int:
        return self.collectives.world

    @property
    def stats(self) -> ExchangeStats:
        """What this rank's exchange did so far."""
        return ExchangeStats(self._tensors, self._layers, self._bytes_sent, self._seconds)

    def owns(self, request: TensorRequest) -> bool:
        """Whether ``request`` (one of this rank's slices) is delivered by the exchange instead."""
        return request.name in self.shared

    def row_requests(self) -> list[TensorRequest]:
        """What this rank reads and hands to ``take``: its block of whole rows of every shared
        tensor not in ``direct_targets``."""
        return [req for req in self._row_reads if req not in self._direct]

    def direct_targets(self) -> dict[TensorRequest, torch.Tensor]:
        """What this rank reads straight into its destination: its block of rows of the replicas
        whose destination holds the checkpoint's dtype; sent from there once the layer is read."""
        return {req: self._block(s) for req, s in self._direct.items()}

    def _block(self, s: SharedTensor) -> torch.Tensor:
        block = s.rows[self.rank]
        return self.dests[s.name].narrow(0, block.start, block.length)

    def take(self, request: TensorRequest, rows: torch.Tensor) -> bool:
        """Per-tensor hook: keep this rank's columns of its rows, set aside copies of the others'
        (in host memory: ``rows`` is only valid during the call, and gloo sends host tensors).
        False if ``request`` is not one of the exchange's reads."""
        s = self._row_reads.get(request)
        if s is None:
            return False
        self._block(s).copy_(self._piece(s, rows, self.rank))
        if s.dim is None:  # replicas: every other rank gets the whole block, one copy for all
            self._outgoing[s.name] = [self._owned(rows)] * (self.world - 1)
        else:
            self._outgoing[s.name] = [self._owned(self._piece(s, rows, q)) for q in range(self.world) if q != self.rank]
        return True

    @staticmethod
    def _piece(s: SharedTensor, rows: torch.Tensor, rank: int) -> torch.Tensor:
        """What ``rank`` keeps of ``rows``: its columns, or (replicas) all of them."""
        return rows if s.dim is None else rows.narrow(s.dim, s.columns[rank].start, s.columns[rank].length)

    @staticmethod
    def _owned(piece: torch.Tensor) -> torch.Tensor:
        """A host copy of ``piece``, padded to ``PIECE_ALIGN`` bytes, as the swap sends it."""
        nbytes = piece.numel() * piece.element_size()
        owned = torch.empty(_padded(nbytes), dtype=torch.uint8)
        owned[:nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
        return owned

    def layer_done(self, group: LayerGroup) -> None:
        """Swap the columns of the layer's shared tensors: one ``all_to_all`` for the layer."""
        names = sorted({s.name for t in group.tensors if (s := self._row_reads.get(t.request)) is not None})
        if names:
            self._swap(names)

    def finish(self) -> None:
        """Raise if a shared tensor was never exchanged (a read that did not run as planned)."""
        missing = sorted(self.shared.keys() - self._done)
        if missing:
            info = self.infos[missing[0]]
            raise CheckpointError(f"{len(missing)} tensors were read for the row exchange but never exchanged",
                                  file=info.file, tensor=info.name)

    def abort(self, error: BaseException) -> None:
        """This rank stops loading: tell the ranks waiting in the next swap, so that they stop too.

        Called by the loader when its read raises; nothing to do once every swap is done, or
        when the failure came from the exchange itself (the peers know, or are gone).
        """
        if self._broken or not (self.shared.keys() - self._done):
            return
        self._broken = True
        self._statuses(f"{type(error).__name__}: {error}"[:2000])

    # -- internals ---------------------------------------------------------------------------
    def _statuses(self, mine: str | None) -> list[str | None]:
        return self.collectives.all_gather_object(mine)

    def _swap(self, names: Sequence[str]) -> None:
        start = time.perf_counter()
        for name in names:
            s = self.shared[name]
            if s.row_request(self.rank) in self._direct:  # read into this rank's rows by now
                self._outgoing[name] = [self._owned(self._block(s))] * (self.world - 1)
            if name not in self._outgoing:
                info = self.infos[name]
                raise CheckpointError("the layer ended before this rank's rows of the tensor were read",
                                      file=info.file, tensor=name)
        # Everything that can fail on this rank alone happens before or after the collectives,
        # never between them, so that ``abort`` can still reach the others.
        sends: list[torch.Tensor] = []
        send_sizes, recv_sizes = [], []
        for q in range(self.world):
            if q == self.rank:
                send_sizes.append(0)
                recv_sizes.append(0)
                continue
            slot = q if q < self.rank else q - 1
            pieces = [self._outgoing[n][slot] for n in names]
            sends += pieces
            send_sizes.append(sum(p.numel() for p in pieces))
            recv_sizes.append(sum(_padded(self._piece_bytes(n, q)) for n in names))
        send = torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)

        self._broken = True  # until both collectives are through
        failed = [(q, why) for q, why in enumerate(self._statuses(None)) if why is not None]
        if failed:
            q, why = failed[0]
            info = self.infos[names[0]]
            raise CheckpointError(f"rank {q} of the {self.group} stopped loading, so the row exchange "
                                  f"cannot go on: {why}", file=info.file, tensor=info.name)
        self.collectives.all_to_all(recv, send, recv_sizes, send_sizes)
        self._broken = False
        for name in names:  # done for the others: an error below must not start another status round
            del self._outgoing[name]
            self._done.add(name)

        at = 0
        for q in range(self.world):
            if q == self.rank:
                continue
            for name in names:
                s = self.shared[name]
                block = s.rows[q]
                nbytes = self._piece_bytes(name, q)
                piece = recv[at:at + nbytes].view(dtype_of(self.infos[name])).view(s.piece_shape(q, self.rank))
                self.dests[name].narrow(0, block.start, block.length).copy_(piece)
                at += _padded(nbytes)
        self._tensors += len(names)
        self._layers += 1
        self._bytes_sent += send.numel()
        self._seconds += time.perf_counter() - start

    def _piece_bytes(self, name: str, row_rank: int) -> int:
        """Bytes of this rank's columns in ``row_rank``'s rows of ``name``."""
        return self._itemsize(name) * math.prod(self.shared[name].piece_shape(row_rank, self.rank))

    def _itemsize(self, name: str) -> int:
        return dtype_of(self.infos[name]).itemsize
