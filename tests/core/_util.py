"""Helpers shared by the core tests.

The oracle everywhere is the safetensors library itself (``save_file`` to write,
``safe_open`` to read back) or the in-memory tensors that were written.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

import vllm_fastload

#: Every dtype torch has and safetensors writes (safetensors 0.8 + torch 2.13).
ALL_DTYPES: list[torch.dtype] = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
for _attr in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _attr):
        ALL_DTYPES.append(getattr(torch, _attr))

#: Dtypes safetensors writes but cannot read back into torch (compare with what was written).
SAFE_OPEN_CANNOT_LOAD = {getattr(torch, "float8_e8m0fnu", None)} - {None}

#: Config that keeps test output quiet; everything else at its default.
QUIET = {"progress": False}

#: Reader configurations the properties run under.
CONFIGS: dict[str, dict] = {
    # Tiny buffers: many chunks, reads split into 4 KiB calls, pool reuse, the oversize path
    # (cached tensors read into buffers too, not handed out as views of a mapping).
    "tiny": {"progress": False, "threads": 2, "read_size": 4096, "aggregate_size": 4096,
             "memory_budget": 8192, "map_cached": False},
    # Every dim>0 slice read row by row.
    "strided": {"progress": False, "threads": 4, "read_size": 4096, "aggregate_size": 16384,
                "memory_budget": 65536, "strided_min_skip": 0},
    # Every dim>0 slice read through the enclosing rows.
    "enclosing": {"progress": False, "threads": 1, "read_size": 4096, "aggregate_size": 8192,
                  "memory_budget": 1 << 20, "strided_min_skip": 1 << 40},
    "default-4t": {"progress": False, "threads": 4},
    # Contiguous ranges through O_DIRECT even when cached, in 4 KiB pieces (rows stay buffered).
    "direct": {"progress": False, "threads": 2, "read_size": 4096, "aggregate_size": 8192,
               "memory_budget": 1 << 20, "direct_io": "always"},
}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaNs included for floats: comparisons are on raw bytes)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes in row-major order (any dtype, any strides, any device)."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_bitexact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert raw_bytes(got) == raw_bytes(want), f"{what}: bytes differ"


def write_raw(path: Path, header: dict | str | bytes, data: bytes = b"", *,
              header_len: int | None = None) -> Path:
    """Write a (possibly invalid) safetensors file by hand."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + header + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def open_ckpt(path, config: dict | None = None, device: str = "cpu") -> vllm_fastload.FastCheckpoint:
    return vllm_fastload.open(path, device=device, config=dict(QUIET, **(config or {})))


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
