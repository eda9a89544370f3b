"""The lifetime contract: what the caller holds never changes; what it drops is reused.

The bug class (see notes/anchors.md): loaders that reuse a read buffer while the caller still
holds a tensor viewing it, so that tensor silently changes. Here every yielded tensor the
caller keeps is compared with the oracle only at the very end, after the pool had every
chance to reuse (and overwrite) its memory.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fastload import LoadStats, TensorRequest
from vllm_fastload.buffers import BufferPool, storage_references

from ._util import assert_bitexact, random_tensor, save
from ._util import open_ckpt as _open_ckpt


def open_ckpt(path, config: dict | None = None, device: str = "cpu"):
    """With ``map_cached`` off: the files here were just written, so they are cached, and the read
    buffers are what these tests are about (mapped views: test_mapped_views.py)."""
    return _open_ckpt(path, {"map_cached": False, **(config or {})}, device)

N_LAYERS = 24
TINY = {"threads": 2, "read_size": 4096, "aggregate_size": 4096, "memory_budget": 3 * 4096}
#: A budget in whole 2 MiB allocation granules: the pool's usual regime (five buffers, see
#: ``policy.BUFFERS_IN_USE``, beside the reader's own staging).
GRANULE = {"threads": 2, "read_size": 4096, "aggregate_size": 4096, "memory_budget": 6 * (2 << 20)}
POOLS = pytest.mark.parametrize("pool_config", [TINY, GRANULE], ids=["tiny", "granule"])


def layered_checkpoint(root: Path, n: int = N_LAYERS, files: int = 2) -> dict[str, torch.Tensor]:
    """Two tensors per layer (4 KiB and 1 KiB), spread over ``files`` files."""
    tensors = {}
    for i in range(n):
        tensors[f"model.layers.{i}.w"] = random_tensor((32, 32), torch.float32, 2 * i)
        tensors[f"model.layers.{i}.b"] = random_tensor((16, 16), torch.float32, 2 * i + 1)
    tensors["model.embed_tokens.weight"] = random_tensor((10, 32), torch.float32, 999)
    tensors["lm_head.weight"] = random_tensor((10, 32), torch.float32, 998)
    names = sorted(tensors)
    for k in range(files):
        save(root / f"model-{k}.safetensors", {n_: tensors[n_] for n_ in names[k::files]})
    return tensors


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    return tmp_path, layered_checkpoint(tmp_path)


def count_allocations(ckpt) -> list[int]:
    """Wrap the reader's allocator (before the pool exists) and record every allocation size."""
    sizes: list[int] = []
    reader = ckpt.reader
    original = reader.allocate

    def allocate(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return original(nbytes)

    reader.allocate = allocate
    return sizes


def consume_copies(ckpt, requests=None, **kw) -> dict[str, torch.Tensor]:
    """A well-behaved caller: copy each tensor and drop the view."""
    return consume_copies_stats(ckpt, requests, **kw)[0]


def consume_copies_stats(ckpt, requests=None, **kw) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """``consume_copies``, and what the read did."""
    out = {}
    stream = ckpt.iter_tensors(requests, **kw)
    for key, view in stream:
        out[key] = view.clone()
    return out, stream.stats


# -- keeping views -------------------------------------------------------------------------------


@POOLS
@pytest.mark.parametrize("threads", [1, 4])
def test_kept_views_never_change(ckpt_dir, threads: int, pool_config: dict):
    root, tensors = ckpt_dir
    with open_ckpt(root, dict(pool_config, threads=threads)) as ckpt:
        stream = ckpt.iter_tensors()
        kept = list(stream)
        handed_over = stream.stats.buffers_handed_over
        assert stream.stats.oversize_tensors == 0
        # The pool had to give buffers up (the caller holds them all): far more chunks than fit.
        assert handed_over > 0
        assert stream.stats.chunks > 3
        # More loads through the same pool, which now reuses whatever it can.
        for _ in range(2):
            consume_copies(ckpt)
            consume_copies(ckpt, [TensorRequest(n, 0, 1, 1, key=n) for n in tensors])
        gc.collect()
        for key, view in kept:
            assert_bitexact(view, tensors[key], key)


def test_kept_derived_views_never_change(ckpt_dir):
    """A slice, a reshaped view, a numpy array or a DLPack import of a yielded tensor counts as holding it."""
    root, tensors = ckpt_dir
    with open_ckpt(root, TINY) as ckpt:
        holders = {}
        for i, (key, view) in enumerate(ckpt.iter_tensors()):
            kind = i % 4
            if kind == 0:
                holders[key] = ("slice", view[1:])
            elif kind == 1:
                holders[key] = ("numpy", view.numpy())
            elif kind == 2:
                holders[key] = ("dlpack", torch.from_dlpack(view))
            else:
                holders[key] = ("flat", view.reshape(-1))
        del view
        for _ in range(3):
            consume_copies(ckpt)
        for key, (kind, held) in holders.items():
            want = tensors[key]
            if kind == "slice":
                assert_bitexact(held, want[1:], key)
            elif kind == "numpy":
                assert np.array_equal(held.view(np.uint8), want.numpy().view(np.uint8)), key
            elif kind == "dlpack":
                assert_bitexact(held, want, key)
            else:
                assert_bitexact(held, want.reshape(-1), key)


def test_views_kept_across_separate_loads(ckpt_dir):
    root, tensors = ckpt_dir
    with open_ckpt(root, TINY) as ckpt:
        first = {k: v for k, v in ckpt.iter_tensors() if ".1" in k}
        second = {k: v for k, v in ckpt.iter_tensors() if ".2" in k}
        consume_copies(ckpt)
        for key, view in {**first, **second}.items():
            assert_bitexact(view, tensors[key], key)


@settings(max_examples=30, deadline=None)
@given(keep=st.lists(st.booleans(), min_size=2 * N_LAYERS + 2, max_size=2 * N_LAYERS + 2),
       threads=st.sampled_from([1, 2, 4]), slices=st.booleans())
def test_random_keep_patterns(keep: list[bool], threads: int, slices: bool):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tensors = layered_checkpoint(root)
        requests = ([TensorRequest(n, 1, 0, 8, key=n) for n in tensors] if slices else None)
        want = {n: (t[:, :8] if slices else t) for n, t in tensors.items()}
        with open_ckpt(root, dict(TINY, threads=threads, strided_min_skip=0)) as ckpt:
            kept, copied = {}, {}
            for i, (key, view) in enumerate(ckpt.iter_tensors(requests)):
                if keep[i]:
                    kept[key] = view
                else:
                    copied[key] = view.clone()
            del view
            _, stats = consume_copies_stats(ckpt)   # reuse everything that can be reused
            for key, view in {**kept, **copied}.items():
                assert_bitexact(view, want[key], key)
            if not any(keep):
                assert stats.buffers_handed_over == 0


# -- dropping views: buffers are reused ------------------------------------------------------------


@POOLS
@pytest.mark.parametrize("threads", [1, 4])
def test_dropped_views_are_reused(ckpt_dir, threads: int, pool_config: dict):
    root, tensors = ckpt_dir
    config = dict(pool_config, threads=threads)
    with open_ckpt(root, config) as ckpt:
        allocations = count_allocations(ckpt)
        for run in range(3):
            got, stats = consume_copies_stats(ckpt)
            assert stats.buffers_handed_over == 0
            assert stats.oversize_tensors == 0
            assert stats.peak_buffer_bytes <= config["memory_budget"]
            assert stats.chunks > 3 * len(allocations)
            assert sum(allocations) <= config["memory_budget"], (run, allocations)
            for key, want in tensors.items():
                assert_bitexact(got[key], want, key)
        assert ckpt._pool.held <= config["memory_budget"]


@POOLS
def test_read_into_reuses_buffers_between_calls(ckpt_dir, pool_config: dict):
    root, tensors = ckpt_dir
    config = pool_config
    with open_ckpt(root, config) as ckpt:
        allocations = count_allocations(ckpt)
        for _ in range(4):
            # Strided destinations force the buffered path (read, then copy_).
            dests = {n: torch.empty(t.shape[::-1]).t() for n, t in tensors.items()}
            stats = ckpt.read_into(dests)
            assert stats.buffers_handed_over == 0 and stats.oversize_tensors == 0
            for n, d in dests.items():
                assert_bitexact(d, tensors[n], n)
        assert sum(allocations) <= config["memory_budget"], allocations


def test_tiny_budget_is_used_not_bypassed(ckpt_dir):
    """A budget below the 2 MiB allocation granule still pools (no one-off buffer per chunk)."""
    root, tensors = ckpt_dir
    config = {"threads": 2, "read_size": 4096, "aggregate_size": 8192, "memory_budget": 64 << 10}
    with open_ckpt(root, config) as ckpt:
        got, stats = consume_copies_stats(ckpt)
        assert stats.oversize_tensors == 0
        assert 0 < stats.peak_buffer_bytes <= config["memory_budget"]
    for key, want in tensors.items():
        assert_bitexact(got[key], want, key)


def test_tensor_larger_than_budget_takes_the_oversize_path(tmp_path: Path):
    tensors = {"model.layers.0.small": random_tensor((8,), torch.float32, 1),
               "model.layers.1.huge": random_tensor((64, 64), torch.float32, 2),   # 16 KiB > budget
               "model.layers.2.small": random_tensor((8,), torch.float32, 3)}
    save(tmp_path / "m.safetensors", tensors)
    config = {"threads": 2, "read_size": 4096, "aggregate_size": 4096, "memory_budget": 8192}
    with open_ckpt(tmp_path, config) as ckpt:
        stream = ckpt.iter_tensors()
        kept = list(stream)
        assert stream.stats.oversize_tensors == 1
        assert stream.stats.peak_buffer_bytes <= config["memory_budget"]
        consume_copies(ckpt)
        for key, view in kept:
            assert_bitexact(view, tensors[key], key)
        # read_into with strided destinations needs the buffered path for the huge tensor too.
        dests = {n: torch.empty(t.shape[::-1]).t() if t.dim() == 2 else torch.empty_like(t)
                 for n, t in tensors.items()}
        ckpt.read_into(dests)
        for n, d in dests.items():
            assert_bitexact(d, tensors[n], n)


# -- stopping early ---------------------------------------------------------------------------------


def track_reads(ckpt) -> list:
    """Record every future the reader hands out, to check none is still running later."""
    futures: list = []
    reader = ckpt.reader
    original = reader.submit

    def submit(sf, calls):
        pending = original(sf, calls)
        futures.extend(pending._futures)
        return pending

    reader.submit = submit
    return futures


@POOLS
@pytest.mark.parametrize("stop_after", [0, 1, 7, 30])
def test_early_break_stops_cleanly_and_can_read_again(ckpt_dir, stop_after: int, pool_config: dict):
    root, tensors = ckpt_dir
    config = dict(pool_config, threads=4)
    with open_ckpt(root, config) as ckpt:
        futures = track_reads(ckpt)
        held = []
        for _ in range(4):  # more early stops than the pool has buffers
            it = ckpt.iter_tensors()
            for i, (key, view) in enumerate(it):
                if i == stop_after:
                    held.append((key, view))      # the caller keeps the tensor it stopped at
                    break
            del view
            it.close()
            assert futures and all(f.done() for f in futures)
            assert ckpt._pool.held <= config["memory_budget"]
        del held[1:]  # drop some of what was kept: those buffers become reusable
        # Read everything again, twice: the pool is intact (no leaked accounting, no one-off buffers).
        for _ in range(2):
            got, stats = consume_copies_stats(ckpt)
            assert stats.oversize_tensors == 0
            assert stats.peak_buffer_bytes <= config["memory_budget"]
            for k, want in tensors.items():
                assert_bitexact(got[k], want, k)
        assert_bitexact(held[0][1], tensors[held[0][0]], held[0][0])


@POOLS
def test_exception_in_consumer_and_dropped_iterator(ckpt_dir, pool_config: dict):
    root, tensors = ckpt_dir
    config = dict(pool_config, threads=4)
    with open_ckpt(root, config) as ckpt:
        futures = track_reads(ckpt)
        with pytest.raises(ZeroDivisionError):
            for i, (_key, _view) in enumerate(ckpt.iter_tensors()):
                if i == 5:
                    raise ZeroDivisionError
        it = ckpt.iter_tensors()
        next(it)
        next(it)
        del it      # never closed explicitly: the generator's finaliser must clean up
        gc.collect()
        assert all(f.done() for f in futures)
        for _ in range(2):
            got, stats = consume_copies_stats(ckpt)
            assert stats.oversize_tensors == 0
            assert stats.buffers_handed_over == 0
        for k, want in tensors.items():
            assert_bitexact(got[k], want, k)


def test_close_after_break_then_reopen(ckpt_dir):
    root, tensors = ckpt_dir
    ckpt = open_ckpt(root, TINY)
    it = ckpt.iter_tensors()
    next(it)
    it.close()
    ckpt.close()
    with open_ckpt(root, TINY) as again:
        got = consume_copies(again)
    for k, want in tensors.items():
        assert_bitexact(got[k], want, k)


# -- owned results -------------------------------------------------------------------------------------


def test_get_tensor_results_are_owned(ckpt_dir):
    root, tensors = ckpt_dir
    name = "model.layers.3.w"
    with open_ckpt(root, TINY) as ckpt:
        a = ckpt.get_tensor(name)
        s = ckpt.get_slice(name, 1, 4, 8)
        e = ckpt.get_slice(name, 1, 4, 8)  # enclosing or strided, either way owned
        assert storage_references(a) == storage_references(torch.empty(1))
        a.add_(1.0)
        s.zero_()
        e.fill_(7.0)
        assert_bitexact(ckpt.get_tensor(name), tensors[name])
        assert_bitexact(ckpt.get_slice(name, 1, 4, 8), tensors[name][:, 4:12])
        got = consume_copies(ckpt)
        assert_bitexact(got[name], tensors[name])
        # and the iterator's views modified in place by the caller don't leak into later reads
        for _key, view in ckpt.iter_tensors():
            view.fill_(0)
        assert_bitexact(consume_copies(ckpt)[name], tensors[name])


def test_read_into_fills_the_callers_tensors_only(ckpt_dir):
    root, tensors = ckpt_dir
    with open_ckpt(root, TINY) as ckpt:
        dest = torch.empty(32, 32)
        ckpt.read_into({"model.layers.0.w": dest})
        assert_bitexact(dest, tensors["model.layers.0.w"])
        dest.zero_()
        again = torch.empty(32, 32)
        ckpt.read_into({"model.layers.0.w": again})
        assert_bitexact(again, tensors["model.layers.0.w"])
        assert not torch.equal(dest, again)


# -- the pool on its own -------------------------------------------------------------------------------


def plain_pool(budget: int, min_size: int = 0) -> BufferPool:
    return BufferPool(lambda n: torch.zeros(n, dtype=torch.uint8), budget, min_size)


def test_pool_free_list_of_mixed_sizes():
    # Buffers are compared by identity: picking the best fit from a free list holding
    # buffers of different sizes must not compare tensors elementwise.
    pool = plain_pool(16 << 20, 1 << 20)
    small, big = pool.try_acquire(1 << 20), pool.try_acquire(3 << 20)
    pool.release(small)
    pool.release(big)
    assert pool.try_acquire(3 << 20) is big
    assert pool.try_acquire(100) is small


def test_pool_respects_budget_and_parks_referenced_buffers():
    pool = plain_pool(3 * 4096, 4096)
    a, b, c = (pool.try_acquire(4096) for _ in range(3))
    assert None not in (a, b, c)
    assert pool.try_acquire(4096) is None            # budget full
    view = a.tensor[10:20]                           # the caller keeps a view of a
    pool.release(a)
    pool.release(b)
    assert pool.try_acquire(4096) is b               # b is free; a is parked, not reused
    assert pool.handed_over == 0
    del view
    assert pool.try_acquire(4096) is a               # view gone: a comes back
    keep = c.tensor.view(torch.int32)               # the caller keeps a view of c
    pool.release(c)
    pool.release(a)
    pool.release(b)
    assert pool.held <= pool.budget
    big = pool.try_acquire(3 * 4096)                 # needs all the room: a, b evicted, c handed over
    assert big is not None and big not in (a, b, c)
    assert pool.handed_over == 1
    assert pool.held <= pool.budget == pool.peak
    assert keep.numel() == 4096 // 4


def test_pool_small_budget_rounds_to_pages_not_granules():
    pool = plain_pool(64 << 10, 8192)
    bufs = [pool.try_acquire(5000) for _ in range(8)]
    assert all(b is not None and b.capacity == 8192 for b in bufs)
    assert pool.try_acquire(1) is None
    assert pool.held == pool.peak == 64 << 10


def test_close_during_iteration_fails_cleanly(ckpt_dir):
    """Closing the checkpoint under a running iterator: reads in flight finish first, and the
    iterator then fails with a CheckpointError instead of reading from closed descriptors."""
    from vllm_fastload.errors import CheckpointError

    root, tensors = ckpt_dir
    ckpt = open_ckpt(root, dict(TINY, threads=4))
    futures = track_reads(ckpt)
    it = ckpt.iter_tensors()
    key, view = next(it)
    ckpt.close()
    assert all(f.done() for f in futures)
    with pytest.raises(CheckpointError) as info:
        for _ in it:
            pass
    assert str(root) in str(info.value)
    assert_bitexact(view, tensors[key], key)


def test_reading_after_close_says_closed(ckpt_dir):
    root, tensors = ckpt_dir
    ckpt = open_ckpt(root, TINY)
    ckpt.close()
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="is closed"):
        ckpt.get_tensor(name)
    with pytest.raises(ValueError, match="is closed"):
        next(ckpt.iter_tensors())
