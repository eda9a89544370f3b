"""Early reads (``sources.readahead``): a file evicted from the page cache is in it afterwards,
by either way in (mapping populated, or read through a buffer on kernels without
``MADV_POPULATE_READ``), and nothing is read when the files do not fit the memory limit."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from vllm_fastload.bench.machine import evict
from vllm_fastload.readers.pagecache import is_cached
from vllm_fastload.sources import readahead

SIZE = (3 * readahead.CHUNK) // 2 + 12345  # two chunks, the last one partial and not page-aligned


def _cached_share(path: Path, samples: int = 64) -> float:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(is_cached(fd, [size * i // samples]) for i in range(samples)) / samples
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path: Path) -> Path:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(os.urandom(1 << 20) * (SIZE >> 20) + os.urandom(SIZE % (1 << 20)))
    os.sync()
    evict([str(path)])
    if _cached_share(path) > 0.5:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED (tmpfs?)")
    return path


@pytest.mark.parametrize("populate", [True, False], ids=["populate", "read-through"])
def test_read_ahead_brings_the_file_into_the_page_cache(cold_file: Path, populate: bool, monkeypatch):
    if not populate:
        monkeypatch.setattr(readahead, "_populate", lambda fd, offset, length: False)
    thread = readahead.read_ahead([str(cold_file)], limit=SIZE)
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _cached_share(cold_file) == 1.0


def test_files_larger_than_the_limit_are_left_alone(cold_file: Path, caplog):
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        assert readahead.read_ahead([str(cold_file)], limit=SIZE - 1) is None
    assert "no early reads" in caplog.text and "read at load time" in caplog.text
    assert _cached_share(cold_file) < 0.5


def test_a_file_that_cannot_be_read_is_skipped(cold_file: Path, tmp_path: Path):
    """No exception (the loader reports a missing file at load time), and the next file is read."""
    readahead._read_in([str(tmp_path / "gone.safetensors"), str(cold_file)])
    assert _cached_share(cold_file) == 1.0


def test_available_memory_is_positive_and_below_the_machine():
    total = readahead._meminfo("MemTotal")
    assert 0 < readahead.available_memory() <= total


def _drop(path: Path, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_chunk_with_reclaimed_pages_is_told_from_a_cached_one(cold_file: Path):
    from vllm_fastload.readers import host

    readahead._read_in([str(cold_file)])
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        calls = [(0, SIZE, None)]
        assert host.cached_calls(fd, calls) and not host._has_holes(fd, calls)
        _drop(cold_file, SIZE // 4, SIZE // 8)  # a hole in the middle, ends still cached
        assert host.cached_calls(fd, calls) and host._has_holes(fd, calls)
    finally:
        os.close(fd)


def test_a_tensor_with_reclaimed_pages_is_read_exactly(tmp_path: Path, monkeypatch):
    """A checkpoint read into the page cache early, then partly reclaimed: every byte still right,
    read through the path for chunks with holes."""
    import torch
    from safetensors.torch import load_file, save_file

    import vllm_fastload
    from vllm_fastload.readers import host

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(1536, 1024), "b": torch.randn(1024)}, str(path))
    os.sync()
    evict([str(path)])
    readahead._read_in([str(path)])
    size = path.stat().st_size
    _drop(path, size // 8, size // 16)
    holes = []
    original = host._has_holes
    monkeypatch.setattr(host, "_has_holes", lambda fd, calls: holes.append(original(fd, calls)) or holes[-1])
    want = load_file(str(path))
    _drop(path, size // 8, size // 16)  # safetensors' read filled it again
    dests = {name: torch.empty_like(t) for name, t in want.items()}
    with vllm_fastload.open(str(path), config={"progress": False}) as ckpt:
        ckpt.read_into(dests)
    assert any(holes)
    for name, t in want.items():
        assert torch.equal(dests[name], t), name
