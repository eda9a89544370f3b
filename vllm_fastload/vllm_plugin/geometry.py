"""Which bytes of a checkpoint tensor one recorded write needs, for writes that are not one narrow.

A write's source is described as a strided view ``(shape, strides, offset)`` of the contiguous
checkpoint tensor (the loader's transposes, reshapes, interleaves and concatenations of one
tensor all reduce to that: see ``probe``). Here we find the smallest single-dim slab of the
tensor that holds every element such a view touches, so that the reader reads only that slab,
and re-express the view relative to the slab. Every step is exact or gives up (``None``), and
giving up means reading the whole tensor, never a wrong byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, strides, offset) in elements


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


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
    return tuple(n for n, _ in dims), tuple(s for _, s in dims), int(cur[0])


@dataclass(frozen=True)
class Box:
    """How a strided view maps onto the dims of a contiguous tensor, without carries."""

    start: tuple[int, ...]               # coordinates of the view's first element
    mapping: tuple[tuple[int, int], ...]  # per view dim: (tensor dim, step along it); (-1, 0) if size 1 or stride 0
    extent: tuple[tuple[int, int], ...]  # per tensor dim: [lo, hi] coordinates touched


def box(tensor_shape: tuple[int, ...], view: Geometry) -> Box | None:
    """Factor each view stride as ``step * tensor_stride[d]`` so that no coordinate overflows its
    dim; then the view touches exactly a box of coordinates. ``None`` when it does not factor."""
    shape, strides, offset = view
    if not tensor_shape or any(n == 0 for n in tensor_shape):
        return None
    full = contiguous_strides(tensor_shape)
    start = [offset // full[0]] + [(offset // full[d]) % tensor_shape[d] for d in range(1, len(full))]
    if start[0] >= tensor_shape[0]:
        return None
    reach = [0] * len(full)
    mapping = []
    for n, s in zip(shape, strides):
        if n == 1 or s == 0:
            mapping.append((-1, 0))
            continue
        dims = [d for d in range(len(full)) if s % full[d] == 0 and tensor_shape[d] > 1]
        if not dims:
            return None
        d = dims[0]
        step = s // full[d]
        mapping.append((d, step))
        reach[d] += step * (n - 1)
    if any(start[d] + reach[d] >= tensor_shape[d] for d in range(len(full))):
        return None
    extent = tuple((start[d], start[d] + reach[d]) for d in range(len(full)))
    return Box(tuple(start), tuple(mapping), extent)


def rebase(b: Box, view: Geometry, tensor_shape: tuple[int, ...], dim: int, lo: int, length: int) -> Geometry:
    """The same view over the contiguous slab ``tensor.narrow(dim, lo, length)``."""
    slab = tuple(length if d == dim else n for d, n in enumerate(tensor_shape))
    full = contiguous_strides(slab)
    strides = tuple(step * full[d] if d >= 0 else 0 for d, step in b.mapping)
    offset = sum((c - (lo if d == dim else 0)) * full[d] for d, c in enumerate(b.start))
    return view[0], strides, offset


@dataclass
class Slab:
    """One read: ``tensor.narrow(dim, start, length)`` (``dim`` None: the whole tensor), and the
    views of the writes it serves, each re-expressed over the slab."""

    dim: int | None
    start: int
    length: int
    members: list[tuple[int, Geometry]]  # (index of the write, its view over the slab)


def _rows(tensor_shape: tuple[int, ...], view: Geometry) -> tuple[int, int] | None:
    """The dim-0 rows a view touches, from its first and last flat positions (strides are >= 0)."""
    shape, strides, offset = view
    if any(s < 0 for s in strides):
        return None
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    row = math.prod(tensor_shape[1:])
    if row == 0 or last >= math.prod(tensor_shape):
        return None
    return offset // row, last // row


def plan_slabs(tensor_shape: tuple[int, ...], views: list[Geometry]) -> list[Slab]:
    """Slabs that cover every view, each view read once: per view the single-dim slab with the
    fewest elements, then overlapping slabs along the same dim merged into one read.

    Dim 0 is always possible from the view's first and last flat positions (a slab of whole rows is
    contiguous, and the view keeps its strides, shifted); a later dim needs ``box``.
    """
    shape = tuple(tensor_shape)
    if not shape:
        return [Slab(None, 0, 1, list(enumerate(views)))]
    row = math.prod(shape[1:])
    by_dim: dict[int, list[tuple[int, int, int, Geometry | Box]]] = {}
    for i, view in enumerate(views):
        options = []  # (elements read, dim, lo, hi, how to rebase)
        rows = _rows(shape, view)
        if rows is not None:
            options.append(((rows[1] - rows[0] + 1) * row, 0, rows[0], rows[1], view))
        b = box(shape, view)
        if b is not None:
            for d in range(1, len(shape)):
                lo, hi = b.extent[d]
                options.append(((hi - lo + 1) * math.prod(shape) // shape[d], d, lo, hi, b))
        if not options:
            return [Slab(None, 0, shape[0], list(enumerate(views)))]
        cost, d, lo, hi, how = min(options, key=lambda o: (o[0], o[1]))
        if cost >= math.prod(shape):
            return [Slab(None, 0, shape[0], list(enumerate(views)))]
        by_dim.setdefault(d, []).append((lo, hi, i, how))
    slabs: list[Slab] = []
    for d, items in by_dim.items():
        items.sort(key=lambda x: x[0])
        groups: list[list] = []
        for item in items:
            if groups and item[0] <= groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], item[1])
                groups[-1][2].append(item)
            else:
                groups.append([item[0], item[1], [item]])
        for lo, hi, members in groups:
            length = hi - lo + 1
            slabs.append(Slab(d, lo, length, [(i, _shift(how, views[i], shape, d, lo, length))
                                              for _, _, i, how in members]))
    return slabs


def _shift(how: Geometry | Box, view: Geometry, shape: tuple[int, ...], dim: int, lo: int, length: int) -> Geometry:
    if isinstance(how, Box):
        return rebase(how, view, shape, dim, lo, length)
    # whole rows: the slab has the tensor's row layout, so only the offset moves
    return view[0], view[1], view[2] - lo * math.prod(shape[1:])
