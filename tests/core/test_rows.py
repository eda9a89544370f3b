"""Slices along a later dim read as rows: row by row, through the gaps in batched ``preadv``
calls, or copied out of a mapping from the page cache; short reads, truncation, and the host
reader's memory and cache advice."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from vllm_fastload import TensorRequest, policy
from vllm_fastload.errors import ReadError
from vllm_fastload.libc import releasing_gil
from vllm_fastload.plan import Rows
from vllm_fastload.readers import ReadCall, RowsCall, base, host, mapped, memory, pagecache

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
        assert planned.rows == Rows(info.start + 80, 64, 192, ROWS, gaps=strategy == "enclosing", lead=80)
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
        tasks = reader.batches([RowsCall(planned.rows, dest)], 4096)
        parts = [call for task in tasks for call in task]
        assert len(parts) > 1
        assert sum(p.count for p, _ in parts) == ROWS
        assert [p.offset for p, _ in parts] == sorted(p.offset for p, _ in parts)
        assert all(d.numel() == p.count * p.seg for p, d in parts)
        # A reader without native rows gets one plain call per row, gaps never read.
        plain = base.Reader.plain_calls([RowsCall(planned.rows, dest)])
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


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "not-cached"])
@pytest.mark.parametrize("config", [ROW_BY_ROW, THROUGH_GAPS])
def test_cached_rows_are_copied_out_of_a_mapping(wide, monkeypatch, cached: bool, config: dict):
    """From the page cache a slice is one strided copy out of a mapping per batch of rows, with no
    read calls at all; off the cache through the gaps (here 92 bytes: under a page, so every page
    they touch holds a segment too and the disk reads nothing more), one ``preadv`` per batch."""
    path, w = wide
    real, reads, copies = os.preadv, [], []
    real_copy = mapped.copy_rows

    def counting(fd, buffers, offset, *flags):
        if not flags:  # not the page cache probe
            reads.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    def copying(fd, path, rows, view):
        copies.append(rows)
        return real_copy(fd, path, rows, view)

    with open_ckpt(path, dict(config, threads=1)) as ckpt:
        planned = ckpt.plan([TensorRequest(NAME, 1, 3, 50)]).tensors[0]
        assert planned.rows.gaps is (config is THROUGH_GAPS)
        monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: cached)
        monkeypatch.setattr(host, "has_holes", lambda fd, calls: False)  # wholly cached
        monkeypatch.setattr(os, "preadv", counting)
        monkeypatch.setattr(mapped, "copy_rows", copying)
        dest = torch.empty(ROWS, 50, dtype=torch.bfloat16)
        ckpt.read_into({TensorRequest(NAME, 1, 3, 50): dest})
    assert_bitexact(dest, w[:, 3:53])
    if cached:
        assert reads == [] and sum(r.count for r in copies) == ROWS
        assert all(r.offset % mmap.PAGESIZE for r in copies)  # the header puts rows off the page grid
    else:
        per_call = host.IOV_MAX // 2   # rows per preadv: a segment and a gap each, the last gap left out
        batched = [n for n in reads if n > 1]  # not O_DIRECT's one-time probe of the descriptor
        assert copies == [] and len(batched) == -(-ROWS // per_call) and max(batched) == 2 * per_call - 1
        assert len(reads) - len(batched) <= 1


def test_uncached_rows_with_gaps_of_a_page_or_more_are_read_one_by_one(tmp_path, monkeypatch):
    """Reading through a gap of a page or more would make the disk read pages the rank does not
    need: off the cache, such a slice is read with a call per row (plus O_DIRECT's one-time probe)."""
    rows, width = 40, 4096  # rows of 8 KiB; the slice takes 64 bytes of each
    w = random_tensor((rows, width), torch.bfloat16, 11)
    path = save(tmp_path / "m.safetensors", {NAME: w})
    real, reads = os.preadv, []

    def counting(fd, buffers, offset, *flags):
        if not flags:
            reads.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    with open_ckpt(path, {"threads": 1}) as ckpt:
        assert ckpt.plan([TensorRequest(NAME, 1, 8, 32)]).tensors[0].strategy == "strided"
        monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
        monkeypatch.setattr(os, "preadv", counting)
        dest = torch.empty(rows, 32, dtype=torch.bfloat16)
        ckpt.read_into({TensorRequest(NAME, 1, 8, 32): dest})
    assert_bitexact(dest, w[:, 8:40])
    assert len(reads) >= rows and set(reads) == {1}


def _spy_on_copies(monkeypatch) -> list[bool]:
    """What each ``mapped.copy_rows`` call returned (False: the caller read the rows instead)."""
    answers, real = [], mapped.copy_rows

    def spy(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(mapped, "copy_rows", spy)
    return answers


@pytest.mark.parametrize("refusal", ["mmap fails", "network filesystem"])
def test_rows_are_read_where_the_file_is_not_mapped(wide, monkeypatch, refusal: str):
    """A filesystem that refuses mappings (some FUSE mounts), or one across a network (where an I/O
    error under a mapped copy would be SIGBUS, not an error), gets reads: through the gaps from the
    page cache, as before mappings."""
    path, w = wide
    if refusal == "mmap fails":
        def refuse(*args, **kwargs):
            raise OSError(19, "No such device")

        monkeypatch.setattr(mapped.mmap, "mmap", refuse)
    else:
        monkeypatch.setattr(mapped.machine, "filesystem_type", lambda p: "fuse.sshfs")
        mapped._local.cache_clear()
    answers = _spy_on_copies(monkeypatch)
    real, reads = os.preadv, []

    def counting(fd, buffers, offset, *flags):
        if not flags:
            reads.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: True)
    monkeypatch.setattr(host, "has_holes", lambda fd, calls: False)  # wholly cached
    monkeypatch.setattr(os, "preadv", counting)
    try:
        with open_ckpt(path, dict(ROW_BY_ROW, threads=2)) as ckpt:
            dest = torch.empty(ROWS, 50, dtype=torch.bfloat16)
            ckpt.read_into({TensorRequest(NAME, 1, 3, 50): dest})
    finally:
        mapped._local.cache_clear()
    assert_bitexact(dest, w[:, 3:53])
    assert answers and not any(answers)
    assert max(reads) == 2 * (host.IOV_MAX // 2) - 1  # through the gaps, 512 rows a call


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "not-cached"])
@pytest.mark.parametrize("config", [ROW_BY_ROW, THROUGH_GAPS])
def test_truncated_file_fails_inside_a_rows_read(tmp_path: Path, monkeypatch, config: dict, cached: bool):
    """A clear error, also from the page cache, where a mapped page past the end would be SIGBUS."""
    w = random_tensor((ROWS, 96), torch.bfloat16, 3)
    path = save(tmp_path / "m.safetensors", {NAME: w})
    monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: cached)
    monkeypatch.setattr(host, "has_holes", lambda fd, calls: False)  # wholly cached
    answers = _spy_on_copies(monkeypatch)
    mapping, real_mmap = [], mmap.mmap

    def mapping_spy(fileno, *args, **kwargs):
        if fileno != -1:  # not the reader's own anonymous buffers
            mapping.append(fileno)
        return real_mmap(fileno, *args, **kwargs)

    monkeypatch.setattr(mapped.mmap, "mmap", mapping_spy)
    with open_ckpt(path, dict(config, check_file_changes=False)) as ckpt:
        cut = ckpt.info(NAME).start + 100 * 192   # row 100 is the last one left
        os.truncate(path, cut)
        with pytest.raises(ReadError) as info:
            ckpt.read_into({TensorRequest(NAME, 1, 8, 8): torch.empty(ROWS, 8, dtype=torch.bfloat16)})
    message = str(info.value)
    assert str(path) in message and repr(NAME) in message and "end of file" in message
    # From the page cache the size check refused the mapping before any was made.
    assert (answers == [False] and mapping == []) if cached else answers == []


def test_populate_faults_in_fresh_memory_once():
    size = 4 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    address = t.data_ptr()
    assert not memory.populate(address, policy.MIN_POPULATE_BYTES - 1)     # too small to bother
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


def test_prefault_fills_fresh_tensors_in_the_background_without_changing_a_byte():
    """What the vLLM loader wraps around ``load_weights`` on its whole-read path."""
    size = 4 << 20
    regions = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(3)]
    fresh = [torch.frombuffer(r, dtype=torch.uint8) for r in regions]
    fresh[1].fill_(9)                                 # one the caller has written already
    strided = torch.zeros(64, 64)[:, ::2]             # not contiguous: passed over
    with memory.Prefault([*fresh, strided, torch.empty(0)]) as prefault:
        prefault._thread.join()                       # the caller would be copying meanwhile
    if not memory._supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): nothing to fault in")
    assert prefault.faulted == 2                      # the two fresh ones; fresh[1] was resident
    libc = releasing_gil()
    for t in fresh:
        assert memory._resident(libc, t.data_ptr()) and memory._resident(libc, t.data_ptr() + size - memory.PAGE)
    assert int(fresh[0].sum()) == 0 and int(fresh[2].sum()) == 0 and bool((fresh[1] == 9).all())
    # Stopped before it starts (the caller failed at once): it faults in nothing more.
    late = torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    stopped = memory.Prefault([late])
    stopped._stop.set()
    with stopped:
        pass
    assert stopped.faulted == 0 and not memory._resident(libc, late.data_ptr())
    del fresh, late


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
        calls = [ReadCall(8, 4096, torch.empty(4096, dtype=torch.uint8))]
        assert host.cached_calls(fd, calls) is hasattr(os, "RWF_NOWAIT")
        monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
        assert host.cached_calls(fd, calls) is False
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
    """Cached reads are CPU work: with the reader's threads on one CPU they run on one thread."""
    path, w = wide
    with open_ckpt(path, {"threads": 4, "read_size": 4096, "cpus": [min(os.sched_getaffinity(0))]}) as ckpt:
        names: set[str] = set()
        real = host._read_batch

        def spy(*args, **kw):
            import threading

            names.add(threading.current_thread().name)
            return real(*args, **kw)

        monkeypatch.setattr(host, "_read_batch", spy)
        assert_bitexact(ckpt.get_tensor(NAME), w)
        cached = hasattr(os, "RWF_NOWAIT")
        if cached:
            assert len(names) == 1 and next(iter(names)).startswith("fastload-copy")
        monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
        names.clear()
        assert_bitexact(ckpt.get_tensor(NAME), w)
        assert all(n.startswith("fastload-host") for n in names)


@pytest.mark.parametrize("gaps", [False, True], ids=["row-by-row", "through-gaps"])
def test_gpu_staging_packs_rows_and_ranges_into_a_slot(wide, gaps: bool):
    """The GPU readers' pinned staging, on a CPU slot (the copy to the device needs a GPU, see
    test_gpu.py): a batch of ranges and rows lands packed, each where ``fill_slot`` says."""
    from vllm_fastload.readers.staging import fill_slot

    path, w = wide
    raw = w.view(torch.uint8).reshape(ROWS, 192)
    with open_ckpt(path, {}) as ckpt:
        sf = next(iter(ckpt._checkpoint.files.values()))
        start = ckpt.info(NAME).start
        rows = Rows(start + 10 * 192 + 64, 32, 192, 700, gaps)   # rows 10..709, bytes 64..95
        batch = [ReadCall(start, 100, "head"), RowsCall(rows, "rows"), ReadCall(start + 192, 8, "tail")]
        slot = torch.zeros(100 + 700 * 32 + 8, dtype=torch.uint8)
        placed = fill_slot(sf, memoryview(slot.numpy()), batch, read_size=64)
    assert [(p.offset, p.length, p.dest) for p in placed] == [(0, 100, "head"), (100, 700 * 32, "rows"),
                                                              (100 + 700 * 32, 8, "tail")]
    assert torch.equal(slot[:100], raw.flatten()[:100])
    assert torch.equal(slot[100:100 + 700 * 32].reshape(700, 32), raw[10:710, 64:96])
    assert torch.equal(slot[-8:], raw[1, :8])


def test_rows_longer_than_a_piece_are_split_like_ranges(wide):
    """Bounded tasks (a GPU staging slot) never hold more than a piece: rows wider than the
    piece go as plain ranges, split into pieces. Unbounded, they stay rows, one per task."""
    path, _ = wide
    with open_ckpt(path, ROW_BY_ROW) as ckpt:
        reader = ckpt.reader
        assert reader.reads_rows
        rows = Rows(1000, 5000, 9000, 3)
        dest = torch.empty(3 * 5000, dtype=torch.uint8)
        unbounded = reader.batches([RowsCall(rows, dest)], 4096)
        assert [[call[0] for call in task] for task in unbounded] == [[rows.split(i, 1)] for i in range(3)]
        tasks = reader.batches([RowsCall(rows, dest)], 4096, bounded=True)
        calls = [call for task in tasks for call in task]
        assert all(not isinstance(call[0], Rows) and call[1] <= 4096 for call in calls)
        assert [(o, n) for o, n, _ in calls] == [(1000, 4096), (5096, 904), (10000, 4096), (14096, 904),
                                                  (19000, 4096), (23096, 904)]


def test_gpu_staging_error_keeps_no_destination_alive(tmp_path: Path):
    """A failed slot fill raises ReadError naming the file, and the error's traceback holds no
    view of the destinations (the buffer pool would take a held buffer for a caller's)."""
    from vllm_fastload.buffers import storage_references
    from vllm_fastload.readers.staging import fill_slot

    w = random_tensor((ROWS, 96), torch.bfloat16, 5)
    path = save(tmp_path / "m.safetensors", {NAME: w})
    with open_ckpt(path, {"check_file_changes": False}) as ckpt:
        sf = next(iter(ckpt._checkpoint.files.values()))
        start = ckpt.info(NAME).start
        os.truncate(path, start + 100 * 192)
        buffer = torch.empty(32 * ROWS, dtype=torch.uint8)
        baseline = storage_references(buffer)
        batch = [ReadCall(start, 4096, buffer[:4096]), RowsCall(Rows(start + 64, 32, 192, ROWS), buffer[:32 * ROWS])]
        slot = torch.zeros(4096 + 32 * ROWS, dtype=torch.uint8)
        with pytest.raises(ReadError) as info:
            fill_slot(sf, memoryview(slot.numpy()), batch)
        batch.clear()
        assert str(path) in str(info.value) and "end of file" in str(info.value)
        assert storage_references(buffer) == baseline
