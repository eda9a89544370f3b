"""Shared by the TGI tests: a two-file checkpoint spec with odd shapes and many dtypes, and an oracle.

The oracle is TGI's documented behaviour (shared/notes/tgi.md) written against safetensors'
own ``safe_open(...).get_slice``, independently of tgi_patch's code.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class FakeGroup:
    """What TGI's Weights uses of a process group."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=gen) == 1).reshape(shape)
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**40)), min(info.max, 2**40)
        return torch.randint(low, high, (n,), generator=gen, dtype=torch.int64).to(dtype).reshape(shape)
    return (torch.randn(n, generator=gen) * 3).to(dtype).reshape(shape)


#: name -> (shape, dtype); file A then file B. Sizes are odd on purpose (5, 7, 11, 13).
FILE_A: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((11, 6), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((12, 7), torch.bfloat16),
    "model.layers.0.self_attn.qkv_proj.weight": ((48, 5), torch.float32),
    "model.layers.0.self_attn.o_proj.weight": ((6, 13), torch.float32),
    "model.layers.0.mlp.gate_up_proj.weight": ((24, 9), torch.bfloat16),
    "model.layers.0.mlp.qweight": ((5, 9), torch.int32),
    "model.layers.0.mlp.g_idx": ((13,), torch.int64),
    "model.layers.0.input_layernorm.weight": ((6,), torch.bfloat16),
}
FILE_B: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.layers.1.self_attn.q_proj.weight": ((12, 7), torch.bfloat16),
    "model.layers.1.mlp.down_proj.weight": ((8, 10), torch.float8_e4m3fn),
    "model.layers.1.mlp.down_proj.weight_scale": ((), torch.float32),
    "model.layers.1.mlp.experts": ((3, 4, 5), torch.float32),
    "model.layers.1.mlp.wide": ((4, 12), torch.int64),
    "model.layers.1.mlp.q8": ((4, 6), torch.int8),
    "model.layers.1.mlp.q16": ((4, 6), torch.int16),
    "model.layers.1.mlp.u8": ((4, 6), torch.uint8),
    "model.layers.1.mlp.mask": ((4, 6), torch.bool),
    "model.layers.1.mlp.half": ((7, 4), torch.float16),
    "model.layers.1.mlp.empty": ((0, 4), torch.float32),
    "model.norm.weight": ((6,), torch.float16),
    "lm_head.weight": ((11, 6), torch.bfloat16),
}
ALL_SPECS = {**FILE_A, **FILE_B}
WORLDS = [(world, rank) for world in range(1, 5) for rank in range(world)]


def write(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int) -> dict[str, torch.Tensor]:
    tensors = {name: _values(shape, dtype, seed + i) for i, (name, (shape, dtype)) in enumerate(specs.items())}
    save_file(tensors, str(path))
    return tensors


class Oracle:
    """TGI's formulas over safetensors' slices (tgi.md), for one (world, rank) and target dtype."""

    KEEP_TENSOR = (torch.float8_e4m3fn, torch.int8, torch.int16, torch.int32, torch.int64)
    KEEP_PARTIAL = (torch.float8_e4m3fn, torch.int8, torch.int16, torch.int32)

    def __init__(self, files: list[Path], world: int, rank: int, dtype: torch.dtype) -> None:
        self.handles = {}
        self.where = {}
        for f in files:
            h = safe_open(str(f), framework="pt")
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f
        self.world, self.rank, self.dtype = world, rank, dtype

    def slice(self, name: str):
        return self.handles[self.where[name]].get_slice(name)

    def get_tensor(self, name: str, to_dtype: bool = True) -> torch.Tensor:
        t = self.handles[self.where[name]].get_tensor(name)
        return t.to(self.dtype) if to_dtype and t.dtype not in self.KEEP_TENSOR else t

    def get_partial_sharded(self, name: str, dim: int, to_dtype: bool = True) -> torch.Tensor:
        s = self.slice(name)
        size = s.get_shape()[dim]
        block = math.ceil(size / self.world)
        start, stop = self.rank * block, min(size, (self.rank + 1) * block)
        t = s[start:stop] if dim == 0 else s[:, start:stop]
        return t.to(self.dtype) if to_dtype and t.dtype not in self.KEEP_PARTIAL else t

    def get_packed_sharded(self, name: str, dim: int, blocks: int | list[int], to_dtype: bool = True) -> torch.Tensor:
        s = self.slice(name)
        total = s.get_shape()[dim]
        sizes = [total // sum(blocks) * b for b in blocks] if isinstance(blocks, list) else [total // blocks] * blocks
        parts, offset = [], 0
        for size in sizes:
            shard = size // self.world
            lo, hi = offset + self.rank * shard, offset + (self.rank + 1) * shard
            parts.append(s[lo:hi] if dim == 0 else s[:, lo:hi])
            offset += size
        t = torch.cat(parts, dim=dim)
        return t.to(self.dtype) if to_dtype and t.dtype not in self.KEEP_TENSOR else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and bytes (fp8- and NaN-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh tensor has canonical strides; views of slices may not (size-1 dims keep odd strides).
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


#: Filled by ``record_event``, the ``on_layer_ready`` callback given as an import string in tests.
EVENTS: list = []


def record_event(event: object) -> None:
    EVENTS.append(event)
