"""The cuda and kvikio backends, and ``auto`` on a CUDA device, bit-exact against the oracle.

These run only on a machine with CUDA (and, for kvikio, with kvikio installed); elsewhere
they are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from vllm_fastload import TensorRequest

from ._util import ALL_DTYPES, assert_bitexact, open_ckpt, random_tensor, save
from .test_reading import Case, cases, check_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False"),
]

#: Budget >= 4 x read_size, so the cuda backend's pinned staging (at least two slots of
#: read_size) leaves room for read buffers.
GPU_CONFIGS = {
    "small": {"threads": 2, "read_size": 4096, "aggregate_size": 8192, "memory_budget": 65536},
    "strided": {"threads": 4, "read_size": 4096, "aggregate_size": 16384, "memory_budget": 1 << 20,
                "strided_min_skip": 0},
    "enclosing": {"threads": 1, "read_size": 4096, "aggregate_size": 16384, "memory_budget": 1 << 20,
                  "strided_min_skip": 1 << 40},
    "default": {},
}


HAS_KVIKIO = importlib.util.find_spec("kvikio") is not None


@pytest.fixture(params=["cuda", "kvikio", "auto"])
def backend(request) -> str:
    if request.param == "kvikio" and not HAS_KVIKIO:
        pytest.skip("the kvikio backend needs the kvikio package")
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


@pytest.mark.skipif(not HAS_KVIKIO, reason="the kvikio backend needs the kvikio package")
@settings(max_examples=10, deadline=None)
@given(case=cases())
def test_reads_match_safetensors_with_kvikio(case: Case):
    check_case(case, dict(GPU_CONFIGS["small"], backend="kvikio"), device="cuda")


def test_kept_views_never_change_on_gpu(tmp_path: Path, backend: str):
    tensors = {f"model.layers.{i}.w": random_tensor((32, 32), torch.bfloat16, i) for i in range(24)}
    save(tmp_path / "m.safetensors", tensors)
    with open_ckpt(tmp_path, dict(GPU_CONFIGS["small"], backend=backend), device="cuda") as ckpt:
        kept = list(ckpt.iter_tensors())
        assert ckpt.last_stats.buffers_handed_over > 0
        for _ in range(2):
            copies = {k: v.clone() for k, v in ckpt.iter_tensors()}
        assert ckpt.last_stats.buffers_handed_over == 0
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
        got = {k: v.clone() for k, v in ckpt.iter_tensors()}
        assert ckpt.last_stats.buffers_handed_over == 0
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
        for key, view in ckpt.iter_tensors():
            torch.cuda._sleep(1_000_000)     # ~1 ms of spinning queued ahead of the copy
            out[key] = view.clone()          # queued; returns at once
        del view
        assert ckpt.last_stats.chunks > 8 and ckpt.last_stats.oversize_tensors == 0
        torch.cuda.synchronize()
    for key, want in tensors.items():
        assert_bitexact(out[key], want, key)
