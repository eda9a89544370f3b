"""iter_tensors hands out cached tensors of a local file as views of a private mapping
(readers/mapped.py ``file_window``): the caller's copy is then the only one, as with safetensors."""

from __future__ import annotations

import gc
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_fastload import TensorRequest, policy
from vllm_fastload.readers import host, mapped, pagecache

from ._util import assert_bitexact, open_ckpt, random_tensor, save


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {f"model.layers.{i}.mlp.weight": random_tensor((64, 48), dtype, i)
               for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.int8, torch.float64] * 2)}
    tensors["model.embed_tokens.weight"] = random_tensor((100, 16), torch.float16, 99)
    path = save(tmp_path / "model.safetensors", tensors)
    return path, tensors


def _spy_reads(monkeypatch) -> list:
    submitted: list = []
    real = host.HostReader.submit
    monkeypatch.setattr(host.HostReader, "submit", lambda self, sf, calls: submitted.append(len(calls)) or
                        real(self, sf, calls))
    return submitted


def test_cached_tensors_are_views_of_the_file_and_outlive_the_checkpoint(ckpt, monkeypatch):
    path, tensors = ckpt
    submitted = _spy_reads(monkeypatch)
    with open_ckpt(path) as c:
        stream = c.iter_tensors()
        kept = dict(stream)
        stats = stream.stats
    assert submitted == []                        # nothing read into a buffer
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    gc.collect()
    with safe_open(str(path), "pt") as f:         # the views stay valid after close
        for name, t in kept.items():
            assert_bitexact(t, f.get_tensor(name), name)
    # Private and copy-on-write: writing into a view changes neither the file nor a later load.
    name = "model.layers.0.mlp.weight"
    kept[name].view(torch.uint8).fill_(0x5A)
    with open_ckpt(path) as c:
        assert_bitexact(c.get_tensor(name), tensors[name], name)
    assert bytes(path.read_bytes()).count(b"\x5a" * 64) == 0


def test_slices_and_casts_from_views_are_exact(ckpt):
    path, tensors = ckpt
    name = "model.layers.1.mlp.weight"
    with open_ckpt(path, {"strided_min_skip": 1 << 40}) as c:  # the dim-1 slice read as enclosing rows
        got = dict(c.iter_tensors([TensorRequest(name, dim=0, start=8, length=20, key="rows"),
                                   TensorRequest(name, dim=1, start=5, length=9, key="cols")],
                                  dtype=torch.float64))
    assert_bitexact(got["rows"], tensors[name][8:28].double())
    assert_bitexact(got["cols"], tensors[name][:, 5:14].double())


@pytest.mark.parametrize("why", ["not cached", "network filesystem", "mmap fails", "turned off"])
def test_tensors_are_read_where_the_file_is_not_mapped(ckpt, monkeypatch, why):
    path, tensors = ckpt
    config = {}
    if why == "not cached":
        monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
        monkeypatch.setattr(host.pagecache, "cached_share", lambda fd, start, end: 0.0)
    elif why == "network filesystem":
        monkeypatch.setattr(mapped, "_local", lambda path: False)
    elif why == "mmap fails":
        real = mapped.keeping_gil()
        refusing = types.SimpleNamespace(mmap=lambda *args: mapped.MAP_FAILED, munmap=real.munmap)
        monkeypatch.setattr(mapped, "keeping_gil", lambda: refusing)
    else:
        config = {"map_cached": False}
    submitted = _spy_reads(monkeypatch)
    with open_ckpt(path, config) as c:
        got = {k: v.clone() for k, v in c.iter_tensors()}
    assert submitted                              # read, not mapped
    for name, t in tensors.items():
        assert_bitexact(got[name], t, name)


def test_a_file_cut_short_is_a_clear_error_not_a_crash(ckpt):
    """The plan's ranges are checked against the mapping: bytes past the end are never touched."""
    path, _ = ckpt
    c = open_ckpt(path, {"check_file_changes": False})
    try:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(size - 100)
        with pytest.raises(Exception) as err:
            for _ in c.iter_tensors():
                pass
        assert str(path) in str(err.value)
    finally:
        c.close()


def test_with_buffered_reads_uncached_tensors_are_views_too_after_advice(ckpt, monkeypatch):
    """``direct_io`` "never" (the vLLM loader's choice where every rank reads every tensor, so that
    the ranks share one disk read through the page cache): no read calls, the chunk is advised."""
    path, tensors = ckpt
    monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
    advised: list = []
    real = host.advise
    monkeypatch.setattr(host, "advise", lambda fd, calls: advised.append(len(calls)) or real(fd, calls))
    submitted = _spy_reads(monkeypatch)
    with open_ckpt(path, {"direct_io": "never"}) as c:
        got = dict(c.iter_tensors())
    assert submitted == [] and sum(advised) == len(tensors)
    for name, t in tensors.items():
        assert_bitexact(got[name], t, name)


@pytest.mark.parametrize("share", [0.9, 0.1])
def test_a_mostly_cached_chunk_is_mapped_and_its_missing_pages_advised(ckpt, monkeypatch, share):
    """Pages reclaimed here and there: O_DIRECT would fetch the whole chunk from disk again."""
    path, tensors = ckpt
    monkeypatch.setattr(pagecache, "is_cached", lambda fd, offsets: False)
    monkeypatch.setattr(host.pagecache, "cached_share", lambda fd, start, end, **_: share)
    advised: list = []
    real = host.advise
    monkeypatch.setattr(host, "advise", lambda fd, calls: advised.append(len(calls)) or real(fd, calls))
    submitted = _spy_reads(monkeypatch)
    with open_ckpt(path) as c:
        got = {k: v.clone() for k, v in c.iter_tensors()}
    mapped_views = share >= policy.MOSTLY_CACHED
    assert (submitted == []) is mapped_views and (sum(advised) == len(tensors)) is mapped_views
    for name, t in tensors.items():
        assert_bitexact(got[name], t, name)


def test_cached_share_counts_sampled_pages(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (64 << 12))
    fd = os.open(path, os.O_RDONLY)
    try:
        share = pagecache.cached_share(fd, 0, 64 << 12)
        if share is None:
            pytest.skip("mincore cannot be asked truthfully for this file here")
        assert share == 1.0  # just written
        assert pagecache.cached_share(fd, 100, 100) == 1.0  # nothing to ask about
    finally:
        os.close(fd)


def test_overlapping_requests_never_share_memory(ckpt):
    """Two views of one mapping would share bytes: such a chunk is read into a buffer instead."""
    path, tensors = ckpt
    name = "model.layers.1.mlp.weight"
    with open_ckpt(path) as c:
        got = dict(c.iter_tensors([TensorRequest(name, key="a"), TensorRequest(name, dim=0, start=0, length=8,
                                                                                  key="b")]))
    got["a"].zero_()
    assert_bitexact(got["b"], tensors[name][:8])


def test_kept_views_hold_no_file_descriptors(ckpt, monkeypatch):
    """Python's mmap would keep a duplicate descriptor per mapping while a view lives."""
    path, tensors = ckpt
    submitted = _spy_reads(monkeypatch)
    before = len(os.listdir("/proc/self/fd"))
    kept = []
    for _ in range(5):
        with open_ckpt(path, {"aggregate_size": 4096, "read_size": 4096}) as c:  # a mapping per tensor
            kept += [t for _, t in c.iter_tensors()]
    assert len(kept) == 5 * len(tensors) and submitted == []  # all mapped
    assert len(os.listdir("/proc/self/fd")) <= before
    del kept
    gc.collect()
