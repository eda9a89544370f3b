"""Ranks reading parts of the same rows split the shared pages' disk reads (readers/row_pages.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fastload.plan import Rows
from vllm_fastload.readers import host, row_pages
from vllm_fastload.readers.row_pages import PAGE


def _pages(spans: list[tuple[int, int]]) -> set[int]:
    pages: set[int] = set()
    for offset, length in spans:
        assert offset % PAGE == 0 and length % PAGE == 0 and length > 0
        pages.update(range(offset // PAGE, (offset + length) // PAGE))
    return pages


def _segment_pages(rows: Rows) -> set[int]:
    return {p for offset, length in rows.ranges() for p in range(offset // PAGE, (offset + length - 1) // PAGE + 1)}


def _ranks(start: int, count: int, seg: int, world: int) -> list[Rows]:
    """The dim-1 slices of a ``count`` x ``world * seg`` byte tensor at ``start``, one per rank."""
    return [Rows(start + r * seg, seg, world * seg, count, lead=r * seg) for r in range(world)]


@settings(max_examples=150, deadline=None)
@given(start=st.integers(0, 3 * PAGE), count=st.integers(1, 300), seg=st.integers(1, 3 * PAGE),
       world=st.integers(2, 4))
def test_every_page_is_fetched_ahead_by_at_most_one_rank_and_read_by_its_own(start, count, seg, world):
    ranks = _ranks(start, count, seg, world)
    owned = [_pages(row_pages.owned_spans(r)) for r in ranks]
    for rows, mine in zip(ranks, owned):
        touched = _pages(row_pages.touched_spans(rows))
        assert touched == _segment_pages(rows)      # right before reading: every page it needs
        assert mine <= touched                     # ahead: never a page it does not need
    for a in range(world):
        for b in range(a + 1, world):
            assert not owned[a] & owned[b]         # no page fetched ahead twice
    if world == 2:
        # Every page that holds only this tensor has an owner: none is left to the last-moment
        # advice (with more ranks, a shared page may not hold its block's owner's bytes).
        end = start + count * world * seg
        assert set(range(-(-start // PAGE), end // PAGE)) <= set().union(*owned)


@pytest.mark.parametrize("start", [0, 8, 3000])
@pytest.mark.parametrize("row_bytes", [4096, 11264])  # o_proj and down_proj rows of a 2048-wide bf16 model
def test_the_shared_pages_are_split_evenly(start, row_bytes):
    ranks = _ranks(start, 2048, row_bytes // 2, 2)
    touched = [_segment_pages(r) for r in ranks]
    shared = touched[0] & touched[1]
    owned = [_pages(row_pages.owned_spans(r)) for r in ranks]
    assert len(owned[0] | owned[1]) >= len(touched[0] | touched[1]) - 2  # only pages shared with neighbours left
    for mine in owned:
        assert 0.47 <= len(mine & shared) / len(shared) <= 0.53


def test_advice_ahead_is_the_owned_pages_and_before_the_read_all_of_them(monkeypatch, tmp_path):
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((off, n)))
    rows = _ranks(8, 512, 2048, 2)[1]
    host.advise_rows(-1, rows, ahead=True)
    assert advised == row_pages.owned_spans(rows) and _pages(advised) < _segment_pages(rows)
    del advised[:]
    host.advise_rows(-1, rows)
    assert advised == [(0, 513 * PAGE)]  # touching pages merged into one run
    del advised[:]
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * (513 * PAGE // 256))
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(bytearray(rows.seg * rows.count))
        host.read_rows(fd, str(path), rows, view, cached=False)
        assert advised == [(0, 513 * PAGE)]  # what the other rank has not fetched is asked for now
        data = path.read_bytes()
        assert bytes(view) == b"".join(data[o:o + n] for o, n in rows.ranges())
    finally:
        os.close(fd)
