"""Cold reads through O_DIRECT: exact at every alignment, truncation reported, page cache left
alone, and a quiet fallback to buffered reads where a filesystem refuses O_DIRECT."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from vllm_fastload import TensorRequest
from vllm_fastload.bench.cache import evict
from vllm_fastload.errors import ReadError
from vllm_fastload.readers import direct, host, pagecache

from ._util import assert_bitexact, open_ckpt, random_tensor, save

SMALL = {"threads": 2, "read_size": 4096, "aggregate_size": 8192, "memory_budget": 1 << 20}


def _needs_o_direct(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        opened = direct.open_direct(fd)
    finally:
        os.close(fd)
    if opened is None:
        pytest.skip(f"the filesystem of {path.parent} refuses O_DIRECT: fastload reads it buffered")
    os.close(opened.fd)


@pytest.fixture
def odd(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors of odd byte sizes, so that no tensor after the first starts on a block boundary,
    and a last tensor that ends the file at an unaligned offset."""
    tensors = {
        "a": random_tensor((3,), torch.uint8, 1),
        "b": random_tensor((1001, 7), torch.bfloat16, 2),        # 14014 bytes: crosses many blocks
        "c": random_tensor((1,), torch.int8, 3),
        "d": random_tensor((777, 33), torch.float32, 4),
        "e": random_tensor((5, 3), torch.uint8, 5),              # ends the file mid-block
    }
    path = save(tmp_path / "m.safetensors", tensors)
    _needs_o_direct(path)
    return path, tensors


def _spy(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = direct.read_into

    def counting(dfd, align, path, offset, dest, bounce):
        calls.append(dest.numel())
        return original(dfd, align, path, offset, dest, bounce)

    monkeypatch.setattr(direct, "read_into", counting)
    return calls


@pytest.mark.parametrize("config", [SMALL, {}], ids=["4KiB-pieces", "defaults"])
def test_cold_reads_go_direct_and_are_exact(odd, monkeypatch, config: dict):
    path, tensors = odd
    calls = _spy(monkeypatch)
    with open_ckpt(path, config) as ckpt:
        evict([str(path)])  # after open: parsing the header read the start of the file
        dests = {n: torch.empty_like(t) for n, t in tensors.items()}
        ckpt.read_into(dests)
        for name, t in tensors.items():
            assert_bitexact(dests[name], t, name)
        evict([str(path)])
        for name, t in ckpt.iter_tensors():
            assert_bitexact(t, tensors[name], name)
        evict([str(path)])
        assert_bitexact(ckpt.get_slice("d", 0, 100, 300), tensors["d"][100:400])
    assert sum(calls) >= sum(t.nbytes for t in tensors.values())


def test_direct_reads_leave_the_page_cache_alone(odd):
    path, tensors = odd
    with open_ckpt(path, SMALL) as ckpt:
        evict([str(path)])
        dest = torch.empty_like(tensors["d"])
        ckpt.read_into({"d": dest})
        middle = ckpt.info("d").start + tensors["d"].nbytes // 2
        fd = ckpt._checkpoint.files[str(path)].fd
        assert not pagecache.is_cached(fd, [middle]), "an O_DIRECT read should not have filled the page cache"
    assert_bitexact(dest, tensors["d"])


def test_truncated_file_is_reported_with_file_and_tensor(odd, monkeypatch):
    path, tensors = odd
    calls = _spy(monkeypatch)
    with open_ckpt(path, dict(SMALL, direct_io="always", check_file_changes=False)) as ckpt:
        os.truncate(path, ckpt.info("d").start + 1000)
        with pytest.raises(ReadError) as err:
            ckpt.read_into({"d": torch.empty_like(tensors["d"])})
    assert "end of file" in str(err.value) and str(path) in str(err.value) and "'d'" in str(err.value)
    assert calls, "the truncation should have been met by an O_DIRECT read"


def test_filesystem_without_o_direct_reads_buffered(odd, monkeypatch):
    path, tensors = odd
    monkeypatch.setattr(direct, "open_direct", lambda fd: None)
    calls = _spy(monkeypatch)
    with open_ckpt(path, dict(SMALL, direct_io="always")) as ckpt:
        for name, t in ckpt.iter_tensors():
            assert_bitexact(t, tensors[name], name)
    assert calls == []


def test_o_direct_refused_mid_load_falls_back(odd, monkeypatch):
    """EINVAL on a direct read (an alignment the probe did not catch): the rest of the batch is read buffered."""
    path, tensors = odd

    def refuse(*args):
        raise direct.DirectUnsupported("Invalid argument")

    monkeypatch.setattr(direct, "read_into", refuse)
    with open_ckpt(path, dict(SMALL, direct_io="always")) as ckpt:
        dests = {n: torch.empty_like(t) for n, t in tensors.items()}
        ckpt.read_into(dests)
    for name, t in tensors.items():
        assert_bitexact(dests[name], t, name)


def test_rows_stay_buffered_under_direct_io(tmp_path: Path, monkeypatch):
    """A slice along dim 1 is many small segments: read through the page cache even with direct_io."""
    w = random_tensor((300, 40), torch.bfloat16, 9)
    path = save(tmp_path / "m.safetensors", {"w": w})
    calls = _spy(monkeypatch)
    with open_ckpt(path, dict(SMALL, direct_io="always", strided_min_skip=0)) as ckpt:
        dest = torch.empty(300, 16, dtype=torch.bfloat16)
        ckpt.read_into({TensorRequest("w", 1, 20, 16): dest})
    assert_bitexact(dest, w[:, 20:36])
    assert calls == []


def test_buffers_are_counted_in_the_budget_or_direct_io_is_off():
    from vllm_fastload.config import FastloadConfig

    reader = host.HostReader(FastloadConfig(progress=False, threads=4), torch.device("cpu"))
    assert reader.bounce_size == (8 << 20) + 2 * max(direct.ALIGNMENTS)
    assert reader.staging_bytes == 4 * reader.bounce_size
    tight = FastloadConfig(progress=False, threads=2, read_size=4096, aggregate_size=4096, memory_budget=8192)
    assert host.HostReader(tight, torch.device("cpu")).staging_bytes == 0
    never = FastloadConfig(progress=False, direct_io="never")
    assert host.HostReader(never, torch.device("cpu")).staging_bytes == 0


def test_row_slices_turn_read_ahead_off_once_per_file(tmp_path: Path, monkeypatch):
    """With O_DIRECT carrying contiguous reads, the buffered descriptor serves only advised row
    slices: read-ahead is turned off on it (once), so a miss does not pull in other ranks' bytes."""
    w = random_tensor((300, 40), torch.bfloat16, 9)
    v = random_tensor((50, 64), torch.float32, 10)
    path = save(tmp_path / "m.safetensors", {"w": w, "v": v})
    _needs_o_direct(path)
    advice: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, what):
        advice.append((fd, offset, length, what))
        return real(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    with open_ckpt(path, dict(SMALL, strided_min_skip=0)) as ckpt:
        evict([str(path)])
        dests = {TensorRequest("w", 1, 20, 16): torch.empty(300, 16, dtype=torch.bfloat16),
                 TensorRequest("v", 1, 0, 32): torch.empty(50, 32, dtype=torch.float32)}
        ckpt.read_into(dests)
    assert_bitexact(dests[TensorRequest("w", 1, 20, 16)], w[:, 20:36])
    assert_bitexact(dests[TensorRequest("v", 1, 0, 32)], v[:, :32])
    random = [a for a in advice if a[3] == os.POSIX_FADV_RANDOM]
    assert len(random) == 1 and random[0][1:3] == (0, 0), advice
    willneed = [a for a in advice if a[3] == os.POSIX_FADV_WILLNEED]
    assert willneed and all(a[0] == random[0][0] for a in willneed)


@pytest.mark.parametrize("ncpus", [1, 2], ids=["one-cpu", "two-cpus"])
def test_cached_reads_with_fewer_copiers_than_threads(tmp_path: Path, monkeypatch, ncpus: int):
    """Fewer copier threads than reader threads: with two CPUs (two copiers, three threads) the
    destinations are faulted in on the reader threads first; with one CPU (a vLLM-CPU rank bound
    to one core) the one copier faults in its own, on no other thread. Either way the copies are
    exact and a read error on that path reaches the caller with the file and tensor."""
    cpus = sorted(os.sched_getaffinity(0))[:ncpus]
    if len(cpus) < ncpus:
        pytest.skip(f"needs {ncpus} CPUs, this process may run on {len(cpus)}")
    tensors = {f"t{i}": random_tensor((257, 129), torch.bfloat16, i) for i in range(6)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    path = save(tmp_path / "m.safetensors", tensors)
    populated: list[tuple[str, int]] = []  # (thread, bytes) of every fault-in call
    readers: set[str] = set()
    real_populate, real_read = host.populate, host._read_batch

    def populating(address: int, nbytes: int) -> bool:
        populated.append((threading.current_thread().name, nbytes))
        return real_populate(address, nbytes)

    def reading(*args, **kw):
        readers.add(threading.current_thread().name)
        return real_read(*args, **kw)

    monkeypatch.setattr(host, "populate", populating)
    monkeypatch.setattr(host, "_read_batch", reading)
    config = dict(SMALL, threads=3, read_size=16384, aggregate_size=65536, direct_io="never", check_file_changes=False,
                  cpus=cpus)
    with open_ckpt(path, config) as ckpt:
        for _ in ckpt.iter_tensors():
            pass  # fills the page cache, so the next reads take the cached path
        dests = {n: torch.empty_like(t) for n, t in tensors.items()}
        populated.clear()
        readers.clear()
        ckpt.read_into(dests)
        for name, t in tensors.items():
            assert_bitexact(dests[name], t, name)
        assert readers and all(n.startswith("fastload-copy") for n in readers), readers  # the cached path
        ahead = sum(n for thread, n in populated if thread.startswith("fastload-host"))
        if ncpus == 1:
            assert len(readers) == 1 and {thread for thread, _ in populated} == readers, (readers, populated)
            assert sum(n for _, n in populated) >= total and ahead == 0
        else:
            assert ahead >= total, populated
        # The same path when a read fails: the file cut short under a chunk the probe calls cached.
        os.truncate(path, ckpt.info("t5").start + 100)
        monkeypatch.setattr(host, "cached_calls", lambda fd, calls: True)
        monkeypatch.setattr(host, "has_holes", lambda fd, calls: False)
        readers.clear()
        with pytest.raises(ReadError) as err:
            ckpt.read_into({"t5": torch.empty_like(tensors["t5"])})
        assert readers and all(n.startswith("fastload-copy") for n in readers), readers
    assert str(path) in str(err.value) and "'t5'" in str(err.value)


def test_the_page_cache_probe_reads_nothing(tmp_path: Path):
    """Asking whether a page is cached must not bring it (or its neighbours) into the cache;
    a one-byte RWF_NOWAIT read would start read-ahead around it."""
    from vllm_fastload.readers import pagecache

    path = save(tmp_path / "m.safetensors", {"w": random_tensor((256, 1024), torch.uint8, 3)})
    fd = os.open(path, os.O_RDONLY)
    try:
        evict([str(path)])
        offsets = list(range(0, 256 * 1024, 4096))
        assert pagecache._may_ask_mincore(fd)  # the test's own file
        assert not any(pagecache.is_cached(fd, [o]) for o in offsets)
        assert not any(pagecache.is_cached(fd, [o]) for o in offsets), "probing filled the page cache"
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # the read below: that page only
        os.pread(fd, 4096, 8192)
        assert pagecache.is_cached(fd, [8192, 8192 + 4095])
        assert pagecache._nowait(fd, [8192]) is True
        assert pagecache.is_cached(fd, [8192, 128 * 1024 + 4096]) is False
    finally:
        os.close(fd)
