"""Which pages of a row slice to ask the disk for, when other ranks read the rest of the same rows.

A slice along a later dim takes a part of every row, and the ranks' parts share the pages at
their boundaries (o_proj of a 2048-wide bf16 model at TP=2: every page is half one rank's, half
the other's). The rank that asks for a shared page first pays its disk read, so on a cold cache
one rank could fetch most of the shared pages. Ownership splits them
without the ranks talking: the shared pages of a 64 KiB block belong to the rank whose slice
holds the block's chosen position in a row. The block's number picks that position (Fibonacci
hashing: an evenly spread sequence), so each rank owns blocks in proportion to its slice, and
advice stays a few long ranges (each call is a system call on the loading thread). With more than
two ranks a shared page may not hold its owner's bytes; the ranks reading it ask for it right
before their reads, as they do for pages shared with a neighbouring tensor.

Ahead of its reads a rank asks only for the pages that hold nothing but its own bytes and for
the shared pages it owns (``owned_spans``); right before reading it asks for every page its
segments touch (``touched_spans``), which the kernel skips where a page is cached or already
being read. A peer that is late, on another machine or absent costs waiting, never a byte.
"""

from __future__ import annotations

import mmap

import numpy as np

from vllm_fastload import policy
from vllm_fastload.plan import ByteRange, Rows

PAGE = mmap.PAGESIZE
#: 2**64 / golden ratio: ``block * _HASH`` (mod 2**64) over 2**64 is the fractional part of
#: block / golden ratio, a sequence that spreads consecutive blocks' positions evenly.
_HASH = np.uint64(0x9E3779B97F4A7C15)


def touched_spans(rows: Rows) -> list[ByteRange]:
    """The page runs holding the segments (the whole span if ``gaps``)."""
    if rows.count == 0:
        return []
    if rows.gaps:
        return [ByteRange(rows.offset, rows.span)]
    base, touched, _ = _pages(rows)
    return _runs(base, touched)


def owned_spans(rows: Rows) -> list[ByteRange]:
    """Page runs this rank fetches ahead: pages holding only its bytes, and the pages it touches in
    the blocks it owns."""
    if rows.count == 0:
        return []
    if rows.gaps:
        return [ByteRange(rows.offset, rows.span)]
    base, touched, whole = _pages(rows)
    pages = base + np.arange(len(touched), dtype=np.int64)
    blocks = (pages * PAGE // policy.SHARED_PAGE_BLOCK).astype(np.uint64)
    position = ((blocks * _HASH) >> np.uint64(11)).astype(np.float64) / 2.0 ** 53 * rows.stride
    mine = (position >= rows.lead) & (position < rows.lead + rows.seg)
    return _runs(base, whole | (touched & mine))


def _pages(rows: Rows) -> tuple[int, np.ndarray, np.ndarray]:
    """First page of the span, and per page of the span: does a segment touch it, does a single
    segment cover it whole."""
    starts = rows.offset + np.arange(rows.count, dtype=np.int64) * rows.stride
    ends = starts + rows.seg
    base = rows.offset // PAGE
    count = (rows.offset + rows.span - 1) // PAGE - base + 1
    touched = _cover(starts // PAGE - base, (ends - 1) // PAGE - base, count)
    whole = _cover(-(-starts // PAGE) - base, ends // PAGE - 1 - base, count)
    return base, touched, whole


def _cover(first: np.ndarray, last: np.ndarray, count: int) -> np.ndarray:
    """Boolean per page: inside any of the inclusive page ranges ``[first[i], last[i]]``."""
    keep = last >= first
    edges = np.zeros(count + 1, dtype=np.int64)
    np.add.at(edges, first[keep], 1)
    np.add.at(edges, last[keep] + 1, -1)
    return np.cumsum(edges[:-1]) > 0


def _runs(base: int, pages: np.ndarray) -> list[ByteRange]:
    """Byte ranges of the runs of set pages."""
    padded = np.concatenate(([False], pages, [False])).astype(np.int8)
    change = np.flatnonzero(np.diff(padded))
    return [ByteRange(int(base + a) * PAGE, int(b - a) * PAGE) for a, b in zip(change[::2], change[1::2])]
