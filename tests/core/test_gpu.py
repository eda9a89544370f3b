"""The cuda and kvikio backends, and ``auto`` on a CUDA device, bit-exact against the oracle.

These run only on a machine with CUDA (and, for kvikio, with kvikio installed); elsewhere
they are skipped with the reason. ``scripts/gpu-check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fastload import CheckpointError, TensorRequest
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tp_rules import rank_requests

from ._util import ALL_DTYPES, assert_bitexact, open_ckpt, random_tensor, save
from .test_reading import Case, Spec, cases, check_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False"),
]

#: Budget >= 4 x read_size, so the GPU backends' pinned staging (a quarter of the budget, at
#: least one slot of read_size) leaves room for read buffers.
GPU_CONFIGS = {
    "small": {"threads": 2, "read_size": 4096, "aggregate_size": 8192, "memory_budget": 65536},
    "strided": {"threads": 4, "read_size": 4096, "aggregate_size": 16384, "memory_budget": 1 << 20,
                "strided_min_skip": 0},
    "enclosing": {"threads": 1, "read_size": 4096, "aggregate_size": 16384, "memory_budget": 1 << 20,
                  "strided_min_skip": 1 << 40},
    # A tiny budget: one 4 KiB pinned slot (its quarter) and three 4 KiB chunk buffers. Every
    # chunk holds one small tensor; anything bigger takes the oversize path.
    "tiny": {"threads": 2, "read_size": 4096, "aggregate_size": 4096, "memory_budget": 16384},
    # Chunks of three pages: tensors straddle chunk and read boundaries, reads split over threads.
    "split": {"threads": 3, "read_size": 4096, "aggregate_size": 12288, "memory_budget": 65536},
    "default": {},
}


def _kvikio_missing() -> str | None:
    """Why the kvikio backend cannot run here (not installed, or its native libraries fail to load)."""
    from vllm_fastload.readers.kvikio import import_kvikio

    try:
        import_kvikio()
    except Exception as exc:
        return f"the kvikio backend needs a working kvikio package: {type(exc).__name__}: {exc}"
    return None


KVIKIO_MISSING = _kvikio_missing()
HAS_KVIKIO = KVIKIO_MISSING is None


@pytest.fixture(params=["cuda", "kvikio", "auto"])
def backend(request) -> str:
    if request.param == "kvikio" and not HAS_KVIKIO:
        pytest.skip(KVIKIO_MISSING)
    return request.param


def test_auto_picks_kvikio_only_with_gds(tmp_path: Path):
    from vllm_fastload.readers.kvikio import gds_available

    path = save(tmp_path / "m.safetensors", {"a": torch.arange(10.0)})
    with open_ckpt(path, {"backend": "auto"}, device="cuda") as ckpt:
        assert ckpt.reader.name == ("kvikio" if gds_available() else "cuda")
        assert ckpt.reader.device == torch.device("cuda", torch.cuda.current_device())
        got = ckpt.get_tensor("a")
        assert got.device.type == "cuda"
        assert_bitexact(got, torch.arange(10.0))


def test_every_dtype(tmp_path: Path, backend: str):
    tensors = {f"t{i}.{j}": random_tensor(shape, dtype, 10 * i + j)
               for i, dtype in enumerate(ALL_DTYPES)
               for j, shape in enumerate([(), (7,), (3, 5), (0, 4), (2, 3, 4)])}
    path = save(tmp_path / "m.safetensors", tensors)
    with open_ckpt(path, dict(GPU_CONFIGS["small"], backend=backend), device="cuda") as ckpt:
        for name, want in tensors.items():
            got = ckpt.get_tensor(name)
            assert got.is_cuda
            assert_bitexact(got, want, name)
        for key, view in ckpt.iter_tensors():
            assert view.is_cuda
            assert_bitexact(view, tensors[key], key)
        on_gpu = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in tensors.items()}
        on_cpu = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in tensors.items()}
        ckpt.read_into(on_gpu)
        ckpt.read_into(on_cpu)
        for n, want in tensors.items():
            assert_bitexact(on_gpu[n], want, n)
            assert_bitexact(on_cpu[n], want, n)


@pytest.mark.parametrize("config_name", sorted(GPU_CONFIGS))
@settings(max_examples=15, deadline=None)
@given(case=cases())
def test_reads_match_safetensors_on_gpu(config_name: str, case: Case):
    for backend in ("cuda", "auto"):
        check_case(case, dict(GPU_CONFIGS[config_name], backend=backend), device="cuda")


@pytest.mark.skipif(not HAS_KVIKIO, reason=str(KVIKIO_MISSING))
@pytest.mark.parametrize("config_name", sorted(GPU_CONFIGS))
@settings(max_examples=10, deadline=None)
@given(case=cases())
def test_reads_match_safetensors_with_kvikio(config_name: str, case: Case):
    check_case(case, dict(GPU_CONFIGS[config_name], backend="kvikio"), device="cuda")


def odd_case() -> Case:
    """Sizes and offsets that line up with nothing: not with 4 KiB pages (what GDS wants), not
    with read_size or aggregate_size, not with each other; plus every dtype, sliced both ways.

    Each request is checked by ``check_case`` through get_slice, iter_tensors and read_into
    (contiguous destinations read directly, strided ones through a buffer).
    """
    specs = [
        Spec("model.embed_tokens.a", (1,), torch.uint8, 0),
        Spec("model.layers.0.b", (4095,), torch.uint8, 0),
        Spec("model.layers.0.c", (4097,), torch.int8, 0),
        Spec("model.layers.0.d", (3, 1365), torch.bfloat16, 0),        # 8190 bytes
        Spec("model.layers.0.e", (1025, 3), torch.float32, 0),         # 12300 bytes
        Spec("model.layers.1.f", (8193,), torch.uint8, 1),
        Spec("model.layers.1.g", (513,), torch.float64, 1),
        Spec("model.layers.1.h", (64, 129), torch.bfloat16, 1),        # bigger than the tiny budget
        Spec("model.layers.1.i", (4096,), torch.uint8, 1),             # exactly one page
        Spec("model.layers.2.j", (2049,), torch.int16, 1),
        Spec("model.layers.2.k", (3, 4096), torch.int8, 1),            # rows of exactly one page
    ]
    specs += [Spec(f"model.layers.3.dtype{i}", (5, 7), dtype, i % 2) for i, dtype in enumerate(ALL_DTYPES)]
    slices = {
        "model.layers.0.b": [(0, 1, 4093)], "model.layers.0.c": [(0, 4096, 1), (0, 0, 0)],
        "model.layers.0.d": [(1, 1, 700), (0, 1, 2), (-1, 1364, 1)], "model.layers.0.e": [(0, 1, 511), (1, 1, 2)],
        "model.layers.1.f": [(0, 4095, 4098)], "model.layers.1.h": [(1, 3, 65), (0, 63, 1), (1, 0, 129)],
        "model.layers.1.i": [(0, 4095, 1)], "model.layers.2.j": [(0, 2048, None)],
        "model.layers.2.k": [(1, 1, 4094), (1, 2048, 2048), (0, 1, 1)],
    }
    for s in specs:
        if s.name.startswith("model.layers.3."):
            slices[s.name] = [(0, 1, 3), (1, 2, 3), (1, 6, 1)]
    requests = []
    for s in specs:
        requests.append(TensorRequest(s.name, key=f"{s.name}#whole"))
        requests += [TensorRequest(s.name, dim, start, length, key=f"{s.name}#{j}")
                     for j, (dim, start, length) in enumerate(slices.get(s.name, []))]
    kinds = ["contiguous" if i % 3 else "strided" for i in range(len(requests))]
    return Case(specs, requests, nfiles=2, seed=11, dest_kind=kinds)


def check_fixed_case(case: Case, config: dict, device: str = "cuda") -> None:
    """``check_case`` on one given case (it records hypothesis events, so it runs under ``given``)."""

    @settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.just(case))
    def run(c: Case) -> None:
        check_case(c, config, device=device)

    run()


@pytest.mark.parametrize("config_name", ["tiny", "split", "strided", "enclosing", "default"])
def test_odd_sizes_alignments_and_every_dtype_sliced(backend: str, config_name: str):
    check_fixed_case(odd_case(), dict(GPU_CONFIGS[config_name], backend=backend))


@pytest.mark.parametrize("config", [{}, {"strided_min_skip": 0}, {"strided_min_skip": 1 << 40}],
                         ids=["default", "row-by-row", "enclosing"])
def test_tp_rank_slices_on_gpu(tmp_path: Path, backend: str, config: dict):
    """The benchmark's TP=2 rank-1 request set (dim-1 slices of row-parallel weights included),
    read into device tensors, equals safetensors' slicing of the same files."""
    from safetensors import safe_open

    root = write_checkpoint(tmp_path / "ck", "tiny-llama", files=3)
    with open_ckpt(root, dict(config, backend=backend), device="cuda") as ckpt:
        requests = rank_requests(ckpt.tensors, 2, 1)
        assert any(r.dim == 1 for r in requests)
        wants = {}
        for r in requests:
            with safe_open(ckpt.info(r.name).file, "pt") as f:
                part = f.get_slice(r.name)
                wants[r.result_key] = (part[:] if r.dim is None else
                                       part[(slice(None),) * r.dim + (slice(r.start, r.start + r.length),)])
        dests = {r: torch.empty(wants[r.result_key].shape, dtype=wants[r.result_key].dtype, device="cuda")
                 for r in requests}
        stats = ckpt.read_into(dests)
        torch.cuda.synchronize()
        assert stats.bytes_read == ckpt.plan(requests).read_bytes < ckpt.total_bytes
        for r, dest in dests.items():
            assert_bitexact(dest, wants[r.result_key], r.result_key)


def test_kept_views_survive_allocator_recycling(tmp_path: Path, backend: str):
    """Views kept from ``iter_tensors`` never change while the caching allocator recycles the
    memory around them: dropped buffers, freed junk and ``empty_cache`` all hand blocks back
    out, and the reader keeps refilling its own buffers meanwhile."""
    tensors = {f"model.layers.{i}.w": random_tensor((64, 64), torch.float32, i) for i in range(32)}  # 16 KiB
    save(tmp_path / "m.safetensors", tensors)
    config = {"backend": backend, "threads": 2, "read_size": 4096, "aggregate_size": 16384,
              "memory_budget": 65536}
    with open_ckpt(tmp_path, config, device="cuda") as ckpt:
        kept = []
        for i, (key, view) in enumerate(ckpt.iter_tensors()):
            if i % 3 == 0:
                kept.append((key, view))
            # Scribble on blocks of the same size class as the reader's buffers, then free them.
            junk = torch.full((16384,), 0xFF, dtype=torch.uint8, device="cuda")
            del junk
        del view
        torch.cuda.empty_cache()
        scribbles = [torch.full((16384,), 0xEE, dtype=torch.uint8, device="cuda") for _ in range(64)]
        for _ in range(2):
            copies = {k: v.clone() for k, v in ckpt.iter_tensors()}
        dests = {k: torch.empty_like(t, device="cuda").t() for k, t in tensors.items()}  # strided: via buffers
        ckpt.read_into(dests)
        torch.cuda.synchronize()
        for key, view in kept:
            assert_bitexact(view, tensors[key], key)
        for key, want in tensors.items():
            assert_bitexact(copies[key], want, key)
            assert_bitexact(dests[key], want, key)
        assert all(bool((s == 0xEE).all()) for s in scribbles)


@pytest.mark.parametrize("dest_layout", ["direct", "buffered", "iter"])
def test_device_memory_stays_within_budget(tmp_path: Path, backend: str, dest_layout: str):
    """torch's allocator peak during a load, beyond the destinations, is at most memory_budget
    (the cuda backend's pinned staging, a quarter of it, is host memory); direct reads into
    destinations on the device allocate no chunk buffer at all."""
    tensors = {f"model.layers.{i // 4}.w{i % 4}": random_tensor((128, 256), torch.bfloat16, i)
               for i in range(48)}  # 64 KiB each, 3 MiB in all
    save(tmp_path / "m.safetensors", tensors)
    budget, aggregate = 1 << 20, 256 << 10
    config = {"backend": backend, "threads": 4, "read_size": 64 << 10, "aggregate_size": aggregate,
              "memory_budget": budget}
    with open_ckpt(tmp_path, config, device="cuda") as ckpt:
        if dest_layout == "direct":
            dests = {k: torch.empty(t.shape, dtype=t.dtype, device="cuda") for k, t in tensors.items()}
            targets = dests
        else:
            wide = {k: torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device="cuda") for k, t in tensors.items()}
            dests = {k: w.t() for k, w in wide.items()}  # non-contiguous: filled from read buffers
            targets = dests
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if dest_layout == "iter":
            stream = ckpt.iter_tensors()
            for key, view in stream:
                dests[key].copy_(view)
            del view
            stats = stream.stats
        else:
            stats = ckpt.read_into(targets)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert stats.oversize_tensors == 0
        assert ckpt.reader.staging_bytes <= budget // 4
        assert extra <= budget - ckpt.reader.staging_bytes, f"{extra} bytes beyond the destinations"
        if dest_layout == "direct":
            assert extra < aggregate, f"direct reads allocated {extra} bytes on the device"
        for key, want in tensors.items():
            assert_bitexact(dests[key], want, key)


def test_truncated_file_is_a_read_error_naming_it(tmp_path: Path, backend: str):
    w = random_tensor((256, 256), torch.float32, 1)
    path = save(tmp_path / "m.safetensors", {"model.layers.0.w": w})
    with open_ckpt(path, {"backend": backend, "check_file_changes": False}, device="cuda") as ckpt:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100_000)
        with pytest.raises(CheckpointError) as info:
            ckpt.get_tensor("model.layers.0.w")
        assert str(path) in str(info.value)
        with pytest.raises(CheckpointError):
            ckpt.read_into({"model.layers.0.w": torch.empty(256, 256, device="cuda")})


def test_kept_views_never_change_on_gpu(tmp_path: Path, backend: str):
    tensors = {f"model.layers.{i}.w": random_tensor((32, 32), torch.bfloat16, i) for i in range(24)}
    save(tmp_path / "m.safetensors", tensors)
    with open_ckpt(tmp_path, dict(GPU_CONFIGS["small"], backend=backend), device="cuda") as ckpt:
        stream = ckpt.iter_tensors()
        kept = list(stream)
        assert stream.stats.buffers_handed_over > 0
        for _ in range(2):
            stream = ckpt.iter_tensors()
            copies = {k: v.clone() for k, v in stream}
        assert stream.stats.buffers_handed_over == 0
        torch.cuda.synchronize()
        for key, view in kept:
            assert_bitexact(view, tensors[key], key)
            assert_bitexact(copies[key], tensors[key], key)


def test_slices_and_conversion_on_gpu(tmp_path: Path, backend: str):
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    save(tmp_path / "m.safetensors", {"model.layers.0.w": w})
    name = "model.layers.0.w"
    with open_ckpt(tmp_path, {"backend": backend}, device="cuda:0") as ckpt:
        assert_bitexact(ckpt.get_slice(name, 0, 16, 16), w[16:32])
        assert_bitexact(ckpt.get_slice(name, 1, 8, 24), w[:, 8:32])
        assert_bitexact(ckpt.get_slice(name, 1, 8, 24, dtype=torch.float32), w[:, 8:32].float())
        dest = torch.empty(64, 24, dtype=torch.float16, device="cuda")
        ckpt.read_into({TensorRequest(name, 1, 24, 24): dest})
        assert_bitexact(dest, w[:, 24:].half())
        got = dict(ckpt.iter_tensors([TensorRequest(name, 0, 0, 32, key="top")], dtype=torch.float32))
        assert_bitexact(got["top"], w[:32].float())


def test_early_break_on_gpu(tmp_path: Path, backend: str):
    tensors = {f"model.layers.{i}.w": random_tensor((64, 64), torch.float32, i) for i in range(16)}
    save(tmp_path / "m.safetensors", tensors)
    with open_ckpt(tmp_path, dict(GPU_CONFIGS["small"], backend=backend), device="cuda") as ckpt:
        for _ in range(3):
            for i, _item in enumerate(ckpt.iter_tensors()):
                if i == 2:
                    break
            del _item   # hold nothing: every buffer may be reused
        stream = ckpt.iter_tensors()
        got = {k: v.clone() for k, v in stream}
        assert stream.stats.buffers_handed_over == 0
    for key, want in tensors.items():
        assert_bitexact(got[key], want, key)


def test_queued_gpu_work_on_a_dropped_view_is_not_overwritten(tmp_path: Path, backend: str):
    """The caller queues slow work reading each view on its stream, then drops the view; the
    buffer is refilled (from the reader's own stream, or by DMA) only after that work ran."""
    tensors = {f"model.layers.{i}.w": random_tensor((256, 256), torch.float32, i) for i in range(32)}
    save(tmp_path / "m.safetensors", tensors)
    config = {"backend": backend, "threads": 4, "read_size": 65536, "aggregate_size": 262144,
              "memory_budget": 2 << 20}
    with open_ckpt(tmp_path, config, device="cuda") as ckpt:
        out = {}
        stream = ckpt.iter_tensors()
        for key, view in stream:
            torch.cuda._sleep(1_000_000)     # ~1 ms of spinning queued ahead of the copy
            out[key] = view.clone()          # queued; returns at once
        del view
        assert stream.stats.chunks > 8 and stream.stats.oversize_tensors == 0
        torch.cuda.synchronize()
    for key, want in tensors.items():
        assert_bitexact(out[key], want, key)
