"""Which part of a checkpoint tensor the recorded writes need, and how to replay them from what was read.

A write's source is a strided view ``(shape, strides, offset)`` of the contiguous checkpoint
tensor (the loader's transposes, reshapes, interleaves and concatenations of one tensor all
reduce to that: see ``probe``). ``plan_slabs`` picks single-dim slabs of the tensor
(``tensor.narrow(dim, start, length)``) that hold every element the views touch, costed by the
bytes the reader will really move, and never more than the tensor itself.

A slab arrives in whatever layout the reader gives it: contiguous (whole rows, or a later dim
read row by row) or a strided view of the enclosing rows (a later dim read through the gaps).
So each view is kept as coordinates in its slab (``SlabView``) and built against the slab's
actual strides when replayed, with the slab's shape and layout checked first. Every step is
exact or gives up (``None``), and giving up means reading the whole tensor, never a wrong byte.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_fastload.sizes import contiguous_strides

#: ``read_cost(dim, start, length)``: bytes the reader moves for ``tensor.narrow(dim, start, length)``
#: (``dim`` None: the whole tensor).
ReadCost = Callable[[int | None, int, int], int]


@dataclass(frozen=True)
class Geometry:
    """A strided view of a contiguous tensor, in elements (what ``as_strided`` takes)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def last(self) -> int:
        """The flat position of the view's last element (strides are >= 0)."""
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides))


@dataclass(frozen=True)
class Step:
    """How one dim of a view walks a dim of the tensor (or slab) it views: ``step`` indices along
    ``dim`` per index; ``dim`` -1 (and ``step`` 0) where the view's dim has size 1 or stride 0."""

    dim: int
    step: int


#: A view dim that stays in place (size 1 or stride 0).
STILL = Step(-1, 0)


class LayoutError(ValueError):
    """A slab did not arrive in a layout its views can be built on (a bug: never replayed)."""


def affine(index: torch.Tensor) -> Geometry | None:
    """A strided view ``(shape, strides, offset)`` whose elements, in row-major order, are exactly
    the flat positions in ``index`` (row-major order too); ``None`` when there is none.

    Built from the innermost run outwards: the first run of equal steps gives the innermost dim,
    every block of that length must repeat it exactly, and the blocks' starts are decomposed the
    same way. Negative steps (flips) are refused: ``as_strided`` takes none.
    """
    flat = index.reshape(-1).to(torch.int64)
    if flat.numel() == 0 or bool((flat < 0).any()):
        return None
    dims: list[tuple[int, int]] = []
    cur = flat
    while cur.numel() > 1:
        diffs = cur[1:] - cur[:-1]
        step = int(diffs[0])
        if step < 0:
            return None
        breaks = torch.nonzero(diffs != step)
        run = int(breaks[0]) + 1 if breaks.numel() else cur.numel()
        if cur.numel() % run:
            return None
        blocks = cur.view(-1, run)
        if not torch.equal(blocks, blocks[:, :1] + step * torch.arange(run, dtype=torch.int64)):
            return None
        dims.insert(0, (run, step))
        cur = blocks[:, 0].contiguous()
    if not dims:
        dims = [(1, 1)]
    return Geometry(tuple(n for n, _ in dims), tuple(s for _, s in dims), int(cur[0]))


@dataclass(frozen=True)
class Box:
    """How a strided view maps onto the dims of a contiguous tensor, without carries."""

    start: tuple[int, ...]               # coordinates of the view's first element
    mapping: tuple[Step, ...]            # per view dim: the tensor dim it walks, and the step
    extent: tuple[tuple[int, int], ...]  # per tensor dim: [lo, hi] coordinates touched


def box(tensor_shape: tuple[int, ...], view: Geometry) -> Box | None:
    """Factor each view stride as ``step * tensor_stride[d]`` so that no coordinate overflows its
    dim; then the view touches exactly a box of coordinates. ``None`` when it does not factor.

    The outermost dim whose stride divides the view's stride is the only candidate: for an inner
    one the step would be at least that dim's size, so a second element would overflow it.
    """
    offset = view.offset
    if not tensor_shape or any(n == 0 for n in tensor_shape) or any(s < 0 for s in view.strides):
        return None
    full = contiguous_strides(tensor_shape)
    start = [offset // full[0]] + [(offset // full[d]) % tensor_shape[d] for d in range(1, len(full))]
    if start[0] >= tensor_shape[0]:
        return None
    reach = [0] * len(full)
    mapping = []
    for n, s in zip(view.shape, view.strides):
        if n == 1 or s == 0:
            mapping.append(STILL)
            continue
        dims = [d for d in range(len(full)) if s % full[d] == 0 and tensor_shape[d] > 1]
        if not dims:
            return None
        d = dims[0]
        step = s // full[d]
        mapping.append(Step(d, step))
        reach[d] += step * (n - 1)
    if any(start[d] + reach[d] >= tensor_shape[d] for d in range(len(full))):
        return None
    extent = tuple((start[d], start[d] + reach[d]) for d in range(len(full)))
    return Box(tuple(start), tuple(mapping), extent)


@dataclass(frozen=True)
class SlabView:
    """One write's source as a view of its slab, built on the slab as it arrives.

    ``axes`` (with ``start``): per view dim, the slab dim it walks and the step, which works for
    any slab strides. Without them (a view of whole rows that wraps from one row into the next)
    only ``flat`` describes it, which holds for a contiguous slab only.
    """

    slab_shape: tuple[int, ...]
    shape: tuple[int, ...]
    flat: Geometry                           # over the slab laid out contiguously
    start: tuple[int, ...] | None = None     # coordinates of the first element in the slab
    axes: tuple[Step, ...] | None = None     # per view dim: the slab dim it walks, and the step

    def on(self, slab: torch.Tensor) -> torch.Tensor:
        """The view over ``slab``; ``LayoutError`` if the slab is not the one this view was planned on."""
        if tuple(slab.shape) != self.slab_shape:
            raise LayoutError(f"the slab read has shape {list(slab.shape)}, planned {list(self.slab_shape)}")
        if self.axes is not None and self.start is not None:
            strides = slab.stride()
            view_strides = tuple(a.step * strides[a.dim] if a.dim >= 0 else 0 for a in self.axes)
            offset = sum(c * s for c, s in zip(self.start, strides))
        elif slab.is_contiguous():
            view_strides, offset = self.flat.strides, self.flat.offset
        else:
            raise LayoutError(f"a view that wraps across rows needs a contiguous slab; the slab read has strides "
                              f"{list(slab.stride())} for shape {list(slab.shape)}")
        return slab.as_strided(self.shape, view_strides, slab.storage_offset() + offset)


def slab_view(tensor_shape: tuple[int, ...], view: Geometry, dim: int | None, lo: int, length: int) -> SlabView | None:
    """``view`` (over the whole tensor) as a view of ``tensor.narrow(dim, lo, length)``; None if it
    does not lie inside that slab."""
    if dim is None:
        dim, lo, length = 0, 0, tensor_shape[0] if tensor_shape else 1
    slab = tuple(length if d == dim else n for d, n in enumerate(tensor_shape))
    b = box(tensor_shape, view) if tensor_shape else None
    if b is not None and lo <= b.extent[dim][0] and b.extent[dim][1] < lo + length:
        start = tuple(c - (lo if d == dim else 0) for d, c in enumerate(b.start))
        full = contiguous_strides(slab)
        flat = Geometry(view.shape, tuple(a.step * full[a.dim] if a.dim >= 0 else 0 for a in b.mapping),
                        sum(c * s for c, s in zip(start, full)))
        return SlabView(slab, view.shape, flat, start, b.mapping)
    if dim != 0 and tensor_shape:
        return None  # a later dim is planned from the box only
    row = math.prod(tensor_shape[1:]) if tensor_shape else 1
    flat = Geometry(view.shape, view.strides, view.offset - lo * row)
    if flat.offset < 0 or flat.last >= math.prod(slab):
        return None
    return SlabView(slab, view.shape, flat)


@dataclass(frozen=True)
class Member:
    """A write a slab serves: its index among the views planned, and its view of the slab."""

    write: int
    view: SlabView


@dataclass(frozen=True)
class Slab:
    """One read: ``tensor.narrow(dim, start, length)`` (``dim`` None: the whole tensor), and the
    views of the writes it serves."""

    dim: int | None
    start: int
    length: int
    members: tuple[Member, ...] = ()


def _rows(tensor_shape: tuple[int, ...], view: Geometry) -> tuple[int, int] | None:
    """The dim-0 rows a view touches, from its first and last flat positions (strides are >= 0)."""
    if any(s < 0 for s in view.strides):
        return None
    last = view.last
    row = math.prod(tensor_shape[1:])
    if row == 0 or view.offset < 0 or last >= math.prod(tensor_shape):
        return None
    return view.offset // row, last // row


def plan_slabs(tensor_shape: tuple[int, ...], views: list[Geometry], read_cost: ReadCost) -> list[Slab]:
    """Slabs that cover every view, read as few bytes as ``read_cost`` says they can.

    Each view spans an index range along dim 0 (from its first and last flat positions) and along
    each later dim (from its ``box``). Two candidates per dim are costed: each view on its own
    cheapest dim, and every view on one shared dim; slabs along one dim are merged where one read
    costs no more than two (overlapping slabs always; slabs read through the gaps between rows,
    whose reads would overlap in the file). The cheapest candidate wins, or the whole tensor if
    that costs no more.
    """
    shape = tuple(tensor_shape)
    extents = _extents(shape, views)
    if extents is not None:
        cover = min(_covers(extents, read_cost), key=lambda c: c.cost)
        if cover.cost < read_cost(None, 0, shape[0]):
            assigned = _assign(shape, views, cover.slabs)
            if assigned is not None:
                return [s for s in assigned if s.members]
    return _whole(shape, views)


def _whole(shape: tuple[int, ...], views: list[Geometry]) -> list[Slab]:
    """The whole tensor as one slab, holding every view."""
    length = shape[0] if shape else 1
    return [Slab(None, 0, length, tuple(Member(i, _view_or_raise(shape, v, None, 0, length))
                                        for i, v in enumerate(views)))]


def _extents(shape: tuple[int, ...], views: list[Geometry]) -> list[dict[int, tuple[int, int]]] | None:
    """Per view: dim -> the (first, last) index it spans along it; None where the tensor is empty
    or a view spans no dim it can be planned on."""
    if not shape or any(n == 0 for n in shape):
        return None
    extents = []
    for view in views:
        options: dict[int, tuple[int, int]] = {}
        rows = _rows(shape, view)
        if rows is not None:
            options[0] = rows
        b = box(shape, view)
        if b is not None:
            options.update({d: b.extent[d] for d in range(1, len(shape))})
        if not options:
            return None
        extents.append(options)
    return extents


@dataclass
class _Cover:
    """A candidate set of slabs, and what reading them costs."""

    cost: int
    slabs: list[Slab]


def _covers(extents: list[dict[int, tuple[int, int]]], read_cost: ReadCost) -> list[_Cover]:
    """The candidates: every view on its own cheapest dim, and all views on one shared dim (views
    that only together make a cheap slab, as the gate and up halves of each expert in a fused stack)."""
    own: dict[int, list[tuple[int, int]]] = {}
    for options in extents:
        d, (lo, hi) = min(options.items(), key=lambda o: (read_cost(o[0], o[1][0], o[1][1] - o[1][0] + 1), o[0]))
        own.setdefault(d, []).append((lo, hi))
    covers = [_merge(own, read_cost)]
    for d in set.intersection(*(set(o) for o in extents)):
        covers.append(_merge({d: [o[d] for o in extents]}, read_cost))
    return covers


def _merge(picks: dict[int, list[tuple[int, int]]], read_cost: ReadCost) -> _Cover:
    """Slabs for index ranges along their dims, merged along one dim where one read costs no more
    than two (always where they overlap)."""
    slabs: list[Slab] = []
    total = 0
    for d, intervals in sorted(picks.items()):
        merged: list[list[int]] = []
        for lo, hi in sorted(intervals):
            if merged:
                plo, phi = merged[-1]
                together = read_cost(d, plo, max(phi, hi) - plo + 1)
                if lo <= phi or together <= read_cost(d, plo, phi - plo + 1) + read_cost(d, lo, hi - lo + 1):
                    merged[-1][1] = max(phi, hi)
                    continue
            merged.append([lo, hi])
        for lo, hi in merged:
            slabs.append(Slab(d, lo, hi - lo + 1))
            total += read_cost(d, lo, hi - lo + 1)
    return _Cover(total, slabs)


def _assign(shape: tuple[int, ...], views: list[Geometry], slabs: list[Slab]) -> list[Slab] | None:
    """``slabs``, each with the views that lie inside it and in no slab before it; None where one
    lies in none (cannot happen: every view's own pick lies inside a merged slab)."""
    members: list[list[Member]] = [[] for _ in slabs]
    for i, view in enumerate(views):
        for slab, served in zip(slabs, members):
            member = slab_view(shape, view, slab.dim, slab.start, slab.length)
            if member is not None:
                served.append(Member(i, member))
                break
        else:
            return None
    return [dataclasses.replace(slab, members=tuple(served)) for slab, served in zip(slabs, members)]


def _view_or_raise(shape: tuple[int, ...], view: Geometry, dim: int | None, lo: int, length: int) -> SlabView:
    member = slab_view(shape, view, dim, lo, length)
    if member is None:
        raise LayoutError(f"a recorded write's source {view} does not lie inside its tensor of shape {list(shape)}")
    return member
