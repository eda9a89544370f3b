"""Slices along a later dim read as rows: row by row, or through the gaps in batched ``preadv``
calls; short reads, truncation, and the host reader's memory and cache advice."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from vllm_fastload import TensorRequest
from vllm_fastload.errors import ReadError
from vllm_fastload.plan import Rows
from vllm_fastload.readers import base, host, memory

from ._util import assert_bitexact, open_ckpt, random_tensor, save

ROWS = 1500           # more rows than one preadv takes (IOV_MAX // 2 rows with gaps)
NAME = "model.layers.0.mlp.down_proj.weight"
ROW_BY_ROW = {"strided_min_skip": 0}
THROUGH_GAPS = {"strided_min_skip": 1 << 40}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    w = random_tensor((ROWS, 96), torch.bfloat16, 7)   # rows of 192 bytes
    path = save(tmp_path_factory.mktemp("rows") / "m.safetensors", {NAME: w, "model.norm.weight": w[0].clone()})
    return path, w


@pytest.mark.parametrize(("config", "strategy"), [(ROW_BY_ROW, "strided"), (THROUGH_GAPS, "enclosing")])
@pytest.mark.parametrize("read_size", [4096, 8 << 20])
def test_rows_land_exactly_in_the_destination(wide, config: dict, strategy: str, read_size: int):
    path, w = wide
    with open_ckpt(path, dict(config, read_size=read_size, threads=3)) as ckpt:
        info = ckpt.info(NAME)
        req = TensorRequest(NAME, 1, 40, 32)
        planned = ckpt.plan([req]).tensors[0]
        assert planned.strategy == strategy
        assert planned.rows == Rows(info.start + 80, 64, 192, ROWS, gaps=strategy == "enclosing")
        dest = torch.empty(ROWS, 32, dtype=torch.bfloat16)
        stats = ckpt.read_into({req: dest})
        assert_bitexact(dest, w[:, 40:72])
        # Row by row reads only the segments; through the gaps moves the gaps too (and says so).
        want = ROWS * 64 if strategy == "strided" else (ROWS - 1) * 192 + 64
        assert stats.bytes_read == planned.read_bytes == want
        assert_bitexact(ckpt.get_slice(NAME, 1, 40, 32), w[:, 40:72])


def test_rows_split_into_tasks_keep_their_order(wide):
    path, _ = wide
    with open_ckpt(path, dict(THROUGH_GAPS, read_size=4096)) as ckpt:
        reader = ckpt.reader
        planned = ckpt.plan([TensorRequest(NAME, 1, 0, 10)]).tensors[0]
        dest = torch.empty(ROWS * 20, dtype=torch.uint8)
        tasks = reader.batches([(planned.rows, dest)], 4096)
        parts = [call for task in tasks for call in task]
        assert len(parts) > 1
        assert sum(p.count for p, _ in parts) == ROWS
        assert [p.offset for p, _ in parts] == sorted(p.offset for p, _ in parts)
        assert all(d.numel() == p.count * p.seg for p, d in parts)
        # A reader without native rows gets one plain call per row, gaps never read.
        plain = base.Reader.plain_calls([(planned.rows, dest)])
        assert len(plain) == ROWS and {length for _, length, _ in plain} == {20}


@pytest.mark.parametrize("config", [ROW_BY_ROW, THROUGH_GAPS, {}])
def test_short_reads_are_completed(wide, monkeypatch, config: dict):
    """The kernel may return fewer bytes than asked (signals, some file systems): keep reading."""
    path, w = wide
    real = os.preadv

    def stingy(fd, buffers, offset, *flags):
        if flags:  # the page cache probe
            return real(fd, buffers, offset, *flags)
        first = buffers[0]
        return real(fd, [first[:max(1, len(first) // 3)]], offset)

    monkeypatch.setattr(os, "preadv", stingy)
    with open_ckpt(path, config) as ckpt:
        dest = torch.empty(ROWS, 50, dtype=torch.bfloat16)
        ckpt.read_into({TensorRequest(NAME, 1, 3, 50): dest})
        assert_bitexact(dest, w[:, 3:53])
        assert_bitexact(ckpt.get_tensor(NAME), w)


@pytest.mark.parametrize("config", [ROW_BY_ROW, THROUGH_GAPS])
def test_truncated_file_fails_inside_a_rows_read(tmp_path: Path, config: dict):
    w = random_tensor((ROWS, 96), torch.bfloat16, 3)
    path = save(tmp_path / "m.safetensors", {NAME: w})
    with open_ckpt(path, dict(config, check_file_changes=False)) as ckpt:
        cut = ckpt.info(NAME).start + 100 * 192   # row 100 is the last one left
        os.truncate(path, cut)
        with pytest.raises(ReadError) as info:
            ckpt.read_into({TensorRequest(NAME, 1, 8, 8): torch.empty(ROWS, 8, dtype=torch.bfloat16)})
    message = str(info.value)
    assert str(path) in message and repr(NAME) in message and "end of file" in message


def test_populate_faults_in_fresh_memory_once():
    size = 4 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    address = t.data_ptr()
    assert not memory.populate(address, memory.MIN_BYTES - 1)     # too small to bother
    did = memory.populate(address, size)
    if not memory._supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): reads fault as usual")
    assert did
    assert not memory.populate(address, size)                     # resident now: left alone
    assert int(t.sum()) == 0                                      # contents untouched (zero pages)
    t[:10] = 7
    assert not memory.populate(address, size) and int(t[:10].sum()) == 70
    del t
    region.close()


def test_cache_probe_and_advice(tmp_path: Path, monkeypatch):
    """The probe tells cached chunks (copied on few threads, never advised) from cold ones; the
    buffered fallback advises the span, and rows are advised only for the pages holding them."""
    w = random_tensor((64, 64), torch.float32, 1)
    path = save(tmp_path / "m.safetensors", {NAME: w})
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((off, n)))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 1 << 20, 0)                       # just written and read: cached
        calls = [(8, 4096, torch.empty(4096, dtype=torch.uint8))]
        assert host._cached_calls(fd, calls) is hasattr(os, "RWF_NOWAIT")
        monkeypatch.setattr(host, "_cached", lambda fd, offsets: False)
        assert host._cached_calls(fd, calls) is False
        host.advise(fd, calls)
        assert advised == [(8, 4096)]
        page = mmap.PAGESIZE
        # Segments of 100 bytes every 3 pages: one page each, the pages between are not advised.
        host.advise_rows(fd, Rows(page + 10, 100, 3 * page, 4, gaps=False))
        assert advised[1:] == [(page * (1 + 3 * i), page) for i in range(4)]
        # Segments whose pages touch are merged into one advice.
        del advised[:]
        host.advise_rows(fd, Rows(10, 3000, 4096, 3, gaps=False))
        assert advised == [(0, 3 * 4096)]
        del advised[:]
        host.advise_rows(fd, Rows(8, 16, 64, 10, gaps=True))
        assert advised == [(8, Rows(8, 16, 64, 10).span)]
    finally:
        os.close(fd)


def test_copies_from_the_page_cache_use_no_more_threads_than_cpus(wide, monkeypatch):
    """Cached reads are CPU work: on a rank bound to one core they run on one thread."""
    path, w = wide
    monkeypatch.setattr(host, "usable_cpus", lambda: 1)
    with open_ckpt(path, {"threads": 4, "read_size": 4096}) as ckpt:
        names: set[str] = set()
        real = host._read_batch

        def spy(*args):
            import threading

            names.add(threading.current_thread().name)
            return real(*args)

        monkeypatch.setattr(host, "_read_batch", spy)
        assert_bitexact(ckpt.get_tensor(NAME), w)
        cached = hasattr(os, "RWF_NOWAIT")
        if cached:
            assert len(names) == 1 and next(iter(names)).startswith("fastload-copy")
        monkeypatch.setattr(host, "_cached", lambda fd, offsets: False)
        names.clear()
        assert_bitexact(ckpt.get_tensor(NAME), w)
        assert all(n.startswith("fastload-host") for n in names)
