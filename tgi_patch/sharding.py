"""TGI's block arithmetic and cast rules, kept apart so each rule can be checked against TGI's text.

Every function reproduces ``text_generation_server/utils/weights.py`` (v2.4.1..v3.3.7)
exactly, including its ``assert`` statements (so ``python -O`` behaves as TGI does) and
its messages, because TGI model code catches ``AssertionError`` to choose a fallback.
"""

from __future__ import annotations

import torch

#: ``get_tensor`` and ``get_packed_sharded`` leave these dtypes alone (GPTQ/exl2/fp8 data).
NO_CAST: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.int8, torch.int16, torch.int32, torch.int64})
#: ``get_partial_sharded`` (and so ``get_sharded``) omits int64 from its list: TGI's quirk, kept.
NO_CAST_PARTIAL: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.int8, torch.int16, torch.int32})


def clamp(start: int, stop: int, size: int) -> tuple[int, int]:
    """``[start:stop]`` on a dimension of ``size``, as Python and safetensors slicing clamp it."""
    begin, end, _ = slice(start, stop).indices(size)
    return begin, max(begin, end)


def ceil_block(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``get_partial_sharded``'s range: blocks of ``ceil(size / world)``, the last one short or empty."""
    block_size = (size + world_size - 1) // world_size
    return clamp(rank * block_size, (rank + 1) * block_size, size)


def floor_block(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``get_tensor_shard``'s range: blocks of ``size // world`` (a remainder is dropped)."""
    block_size = size // world_size
    return clamp(rank * block_size, (rank + 1) * block_size, size)


def blocks_to_block_sizes(total_size: int, blocks: int | list[int]) -> list[int]:
    """An int is a number of equal blocks; a list gives proportions (``[2, 1, 1]`` of 1024 -> 512, 256, 256).

    Only a ``list`` counts as proportions, as in TGI (a tuple fails the same way it does there).
    """
    if isinstance(blocks, list):
        total_blocks = sum(blocks)
        assert total_size % total_blocks == 0, f"Cannot split {total_size} in proportional blocks: {blocks}"
        part_size = total_size // total_blocks
        return [part_size * block for block in blocks]
    assert total_size % blocks == 0, f"Prepacked is not divisible by {blocks}"
    single_size = total_size // blocks
    return [single_size] * blocks


def packed_ranges(block_sizes: list[int], dim: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """This rank's ``[start, stop)`` inside every packed block, in order (what TGI concatenates)."""
    ranges = []
    block_offset = 0
    for block_size in block_sizes:
        assert block_size % world_size == 0, f"Prepacked tensor cannot be sharded across {world_size} shards"
        shard_block_size = block_size // world_size
        start = block_offset + rank * shard_block_size
        if dim not in (0, 1):
            raise NotImplementedError("Currently only dim=0 or dim=1 is supported")
        ranges.append((start, start + shard_block_size))
        block_offset += block_size
    return ranges
