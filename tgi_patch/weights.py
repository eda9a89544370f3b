"""``FastWeights``: TGI's ``Weights`` with the same surface and results, reading through the core.

Each method follows ``text_generation_server/utils/weights.py`` (v2.4.1..v3.3.7) step by
step: name resolution, block arithmetic, which dtypes are cast, and whether the cast comes
before or after the move to ``device``. What changes is how bytes arrive: only the rows or
columns a call returns are read, by the core's threaded reader, instead of through mmap.

Every call is local to the rank (no collectives): TGI's ranks make different calls (a bias
loaded on rank 0 only), so anything collective per call would deadlock.

Layer readiness is counted, not predicted (``vllm_fastload.LayerTracker``): TGI pulls tensors one
call at a time, in an order only the model code knows. The groups are the core's layer groups over
the tensors in the routing at construction; a tensor counts as served once any read of it returned
(whole, sharded, packed, or an indexed ``_get_slice``; ``has_tensor`` and ``get_shape`` read
nothing); a group is ready when every one of its tensors has been served. A group holding a tensor
this rank never reads (an unused buffer, a rank-0-only bias on other ranks) never fires.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tgi_patch.files import CheckpointFiles
from tgi_patch.log import emit
from tgi_patch.sharding import NO_CAST, NO_CAST_PARTIAL, blocks_to_block_sizes, ceil_block, floor_block, packed_ranges
from tgi_patch.slices import FastHandle, FastSlice
from vllm_fastload import FastloadConfig, LayerTracker, LoadReport


class FastWeights:
    """Drop-in for TGI's ``Weights(filenames, device, dtype, process_group, weights_loader, aliases, prefix)``.

    ``process_group`` needs only ``size()`` and ``rank()``. ``config`` (keyword only) is a
    FastloadConfig or dict; by default ``FastloadConfig.from_env()``. Its ``on_layer_ready``
    callbacks fire as layer groups become ready (see the module docstring); the bar shows on rank 0
    only. ``report`` says what it has read so far, as the other engines' loaders report a rank's load.
    """

    def __init__(self, filenames: Sequence[str | os.PathLike[str]], device: Any, dtype: Any, process_group: Any,
                 weights_loader: Any, aliases: dict[str, list[str]] | None = None, prefix: str | None = None,
                 *, config: FastloadConfig | dict[str, Any] | None = None) -> None:
        self.config = FastloadConfig.from_env() if config is None else FastloadConfig.build(config)
        self._files = CheckpointFiles(self.config)
        self._finalizer = weakref.finalize(self, self._files.close)
        routing: dict[str, Any] = {}
        for filename in filenames:
            for k in sorted(self._files.parse(filename).tensors):
                if k in routing:
                    raise RuntimeError(f"Key {k} was found in multiple files: {filename} and {routing[k]}")
                routing[k] = filename
        self._files.open(filenames)
        if aliases is None:
            aliases = {}
        self.aliases = aliases
        self.routing = routing
        self.device = device
        self.dtype = dtype
        self.process_group = process_group
        self.prefix = prefix
        self.weights_loader = weights_loader
        self._handles: dict[str, FastHandle] = {}
        self._rank = process_group.rank()
        self._start = time.perf_counter()
        self._readiness = LayerTracker(self._files.tensors, callbacks=self.config.on_layer_ready,
                                       show_bar=self.config.progress and self._rank == 0,
                                       log_layers=self.config.log_layers, description="fastload-tgi")

    # -- lifetime (TGI drops its Weights after loading; the finalizer does the same) ------------
    def close(self) -> None:
        """Close the files and stop the reader threads; later reads fail."""
        self._readiness.close()
        self._finalizer()

    @property
    def bytes_read(self) -> int:
        """Bytes this object has read from disk so far (this rank's share only)."""
        return self._files.bytes_read

    @property
    def report(self) -> LoadReport:
        """What this rank has read so far: the bytes of the calls TGI made (not a per-rank plan:
        TGI's model code asks for each slice), against the routed files' tensors."""
        total = sum(t.nbytes for t in self._files.tensors)
        return LoadReport(rank=self._rank, world=self.process_group.size(), planned=False, bytes_read=self.bytes_read,
                          bytes_total=total, backend="host", seconds=time.perf_counter() - self._start,
                          summary=f"read as TGI's Weights calls asked; {self._readiness.progress.layers_done} of "
                                  f"{self._readiness.progress.total_layers} layer groups ready")

    # -- names ---------------------------------------------------------------------------------
    def _get_handle(self, filename: str) -> FastHandle:
        if filename not in self._handles:
            self._handles[filename] = FastHandle(self._files, filename, _weak(self._served))
        return self._handles[filename]

    def get_filename(self, tensor_name: str) -> tuple[str, str]:
        """``(file, name)``: tries ``name``, then ``{prefix}.{name}``; for each, itself then its aliases."""
        names = [tensor_name]
        if self.prefix is not None:
            names.append(f"{self.prefix}.{tensor_name}")
        for name in names:
            filename = self.routing.get(name, None)
            if filename is not None:
                return str(filename), name
            for alias in self.aliases.get(name, []):
                filename = self.routing.get(alias, None)
                if filename is not None:
                    return str(filename), alias
        raise RuntimeError(f"weight {tensor_name} does not exist")

    def _get_slice(self, tensor_name: str) -> FastSlice:
        filename, tensor_name = self.get_filename(tensor_name)
        return self._get_handle(filename).get_slice(tensor_name)

    def has_tensor(self, tensor_name: str) -> bool:
        try:
            self.get_filename(tensor_name)
        except Exception:
            return False
        return True

    def get_shape(self, tensor_name: str) -> list[int]:
        return self._get_slice(tensor_name).get_shape()

    # -- reads ---------------------------------------------------------------------------------
    def get_tensor(self, tensor_name: str, to_device: bool = True, to_dtype: bool = True) -> torch.Tensor:
        filename, tensor_name = self.get_filename(tensor_name)
        tensor = self._files.read(filename, tensor_name)
        self._served(tensor_name)
        return self._cast_then_move(tensor, NO_CAST, to_dtype, to_device)

    def get_partial_sharded(self, tensor_name: str, dim: int, to_device: bool = True,
                            to_dtype: bool = True) -> torch.Tensor:
        """This rank's block of ``ceil(size / world)`` along dim 0 or 1 (the last block short or empty)."""
        filename, tensor_name = self.get_filename(tensor_name)
        size = self._shape(filename, tensor_name)[dim]
        start, stop = ceil_block(size, self.process_group.size(), self.process_group.rank())
        if dim not in (0, 1):
            raise NotImplementedError("Let's make that generic when needed")
        tensor = self._files.read(filename, tensor_name, dim, start, stop - start)
        self._served(tensor_name)
        return self._cast_then_move(tensor, NO_CAST_PARTIAL, to_dtype, to_device)

    def _cast_then_move(self, tensor: torch.Tensor, no_cast: Collection[torch.dtype], to_dtype: bool,
                        to_device: bool) -> torch.Tensor:
        """TGI's order for get_tensor / get_partial_sharded: cast first (unless exempt), then move."""
        if tensor.dtype not in no_cast and to_dtype:
            tensor = tensor.to(dtype=self.dtype)
        if to_device:
            tensor = tensor.to(device=self.device)
        return tensor

    def get_sharded(self, tensor_name: str, dim: int, to_device: bool = True, to_dtype: bool = True) -> torch.Tensor:
        """``get_partial_sharded`` after asserting the size divides by the world size (TGI code catches this)."""
        filename, tensor_name = self.get_filename(tensor_name)
        world_size = self.process_group.size()
        size = self._shape(filename, tensor_name)[dim]
        assert size % world_size == 0, \
            f"The choosen size {size} is not compatible with sharding on {world_size} shards"
        return self.get_partial_sharded(tensor_name, dim, to_device=to_device, to_dtype=to_dtype)

    def get_packed_sharded(self, tensor_name: str, dim: int, block_sizes: int | list[int],
                           to_dtype: bool = True) -> torch.Tensor:
        """This rank's shard of every packed block (fused qkv, gate_up), concatenated; moved, then cast."""
        filename, tensor_name = self.get_filename(tensor_name)
        total_size = self._shape(filename, tensor_name)[dim]
        block_sizes = blocks_to_block_sizes(total_size=total_size, blocks=block_sizes)
        ranges = packed_ranges(block_sizes, dim, self.process_group.size(), self.process_group.rank())
        tensor = self._files.read_blocks(filename, tensor_name, dim, ranges)
        self._served(tensor_name)
        tensor = tensor.to(device=self.device)
        if tensor.dtype not in NO_CAST and to_dtype:
            tensor = tensor.to(dtype=self.dtype)
        return tensor

    def get_tensor_shard(self, var: torch.Tensor, dim: int) -> torch.Tensor:
        """Shard an already loaded tensor: blocks of ``size // world`` (unlike get_partial_sharded), always cast."""
        start, stop = floor_block(var.size()[dim], self.process_group.size(), self.process_group.rank())
        if dim == 0:
            tensor = var[start:stop]
        elif dim == 1:
            tensor = var[:, start:stop]
        else:
            raise NotImplementedError("Let's make that generic when needed")
        tensor = tensor.to(dtype=self.dtype)
        return tensor.to(device=self.device)

    # -- the weights loader decides what a "weight" is (quantised or not) -------------------------
    def get_weights(self, prefix: str) -> Any:
        return self.weights_loader.get_weights(self, prefix)

    def get_weights_col_packed_qkv(self, prefix: str, num_heads: int, num_key_value_heads: int) -> Any:
        return self.get_weights_col_packed(prefix, [num_heads, num_key_value_heads, num_key_value_heads])

    def get_weights_col_packed_gate_up(self, prefix: str) -> Any:
        return self.get_weights_col_packed(prefix, 2)

    def get_weights_col_packed(self, prefix: str, block_sizes: int | list[int]) -> Any:
        return self.weights_loader.get_weights_col_packed(self, prefix, block_sizes)

    def get_weights_col(self, prefix: str) -> Any:
        return self.weights_loader.get_weights_col(self, prefix)

    def get_multi_weights_col(self, prefixes: list[str], dim: int) -> Any:
        return self.weights_loader.get_multi_weights_col(self, prefixes, dim)

    def get_weights_row(self, prefix: str) -> Any:
        return self.weights_loader.get_weights_row(self, prefix)

    @contextmanager
    def use_loader(self, weights_loader: Any) -> Iterator[None]:
        """Use another weights loader inside the ``with`` block (TGI's MoE and quantisation code do)."""
        old_loader = self.weights_loader
        self.weights_loader = weights_loader
        try:
            yield
        finally:
            self.weights_loader = old_loader

    @property
    def loader(self) -> Any:
        return self.weights_loader

    def _shape(self, filename: str, name: str) -> list[int]:
        """A list, as safetensors' ``get_shape()`` returns, so a bad ``dim`` fails as it does in TGI."""
        return list(self._files.info(filename, name).shape)

    # -- readiness -----------------------------------------------------------------------------
    def _served(self, name: str) -> None:
        if self._readiness.arrive(name) and self._rank == 0:
            elapsed = time.perf_counter() - self._start
            emit(f"fastload-tgi: rank 0 ready: {self._readiness.progress.total_layers} layer groups, "
                 f"{self.bytes_read / 1e9:.2f} GB read in {elapsed:.2f} s")


def _weak(method: Callable[[str], None]) -> Callable[[str], None]:
    """A callback that does not keep its object alive: handles must not form a cycle with FastWeights,
    or dropping it (as TGI does) would leave its files open until the next cyclic GC."""
    ref = weakref.WeakMethod(method)

    def call(name: str) -> None:
        target = ref()
        if target is not None:
            target(name)

    return call
