"""The bridge to the core: TGI names a tensor by (file, name); the core reads by name.

TGI's routing is a plain dict that model code extends after construction (speculator
heads), so files are parsed on first use with ``Checkpoint.file_for``. All reads land in
host memory as owned tensors in the checkpoint's dtype; FastWeights then applies TGI's
cast and device moves in TGI's order, so the results are the ones TGI computes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from vllm_fastload.api import FastCheckpoint
from vllm_fastload.checkpoint import Checkpoint, read_safetensors_file
from vllm_fastload.config import ConfigError, FastloadConfig
from vllm_fastload.errors import IndexMismatchError, TensorNotFoundError
from vllm_fastload.format import SafetensorsFile, TensorInfo
from vllm_fastload.plan import TensorRequest, plan_tensor
from vllm_fastload.tensors import torch_dtype, torch_shape


def file_key(filename: str | os.PathLike[str]) -> str:
    """One spelling per file, so a routing entry given as str or Path finds the same parsed file."""
    return os.path.abspath(os.fspath(filename))


def _host_checkpoint(checkpoint: Checkpoint, config: FastloadConfig) -> FastCheckpoint:
    """The core over the Checkpoint we assemble from TGI's routing.

    The core's progress bar and layer callbacks are off: one TGI call is one tiny plan, so
    readiness is tracked per FastWeights instead (see ``readiness``).
    """
    quiet = config.model_copy(update={"on_layer_ready": [], "progress": False, "log_layers": False})
    return FastCheckpoint(checkpoint, "cpu", quiet, show_progress=False)


class CheckpointFiles:
    """Parsed headers and open descriptors of every file a FastWeights has routed to."""

    def __init__(self, config: FastloadConfig) -> None:
        if config.backend not in ("auto", "host"):
            raise ConfigError(f"tgi_patch reads into host memory and lets TGI move tensors to the GPU; "
                              f"backend must be 'auto' or 'host', not {config.backend!r}")
        self.checkpoint = Checkpoint([], source="TGI weights routing")
        self._config = config.model_copy(update={"backend": "host"})
        # Over the (still empty) routing checkpoint; reads need no file until one is routed to.
        self._core = _host_checkpoint(self.checkpoint, self._config)
        self.bytes_read = 0

    @staticmethod
    def parse(filename: str | os.PathLike[str]) -> SafetensorsFile:
        """Parse one file without adding it (the caller checks for duplicate names first)."""
        return read_safetensors_file(file_key(filename))

    def add(self, sf: SafetensorsFile) -> None:
        self.checkpoint.add_file(sf)

    def file(self, filename: str | os.PathLike[str]) -> SafetensorsFile:
        return self.checkpoint.file_for(file_key(filename))

    def info(self, filename: str | os.PathLike[str], name: str) -> TensorInfo:
        """The tensor ``name`` in ``filename`` itself (not merely some file holding that name)."""
        sf = self.file(filename)
        info = sf.tensors.get(name)
        if info is None:
            raise TensorNotFoundError(f"the weights routing maps this tensor to this file, but the file does not "
                                      f"hold it ({len(sf.tensors)} tensors in the file)", file=sf.path, tensor=name)
        if self.checkpoint.tensors.get(name) is not info:
            other = self.checkpoint.tensors[name].file
            raise IndexMismatchError(f"tensor is in two routed files: {other} and {sf.path}", file=sf.path,
                                     tensor=name)
        return info

    def read(self, filename: str | os.PathLike[str], name: str, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        """The whole tensor, or ``[start, start + length)`` along ``dim``: only those bytes are read,
        into a tensor of the checkpoint's dtype."""
        info = self.info(filename, name)
        request = TensorRequest(info.name, dim, start, length)
        shaped = plan_tensor(info, request, strided_min_skip=0)  # the result's shape (and the slice checked)
        out = torch.empty(torch_shape(shaped), dtype=torch_dtype(shaped))
        self._read({request: out})
        return out

    def read_blocks(self, filename: str | os.PathLike[str], name: str, dim: int,
                    ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Several ``[start, stop)`` ranges along ``dim`` (0 or 1), concatenated, read in one plan.

        Each range is read straight into its place in the result (dim 0) or copied there
        from the read buffer (dim 1), so there is no ``torch.cat`` copy.
        """
        info = self.info(filename, name)
        whole = plan_tensor(info, TensorRequest(info.name), strided_min_skip=0)
        shape = list(torch_shape(whole))
        shape[dim] = sum(stop - start for start, stop in ranges)
        out = torch.empty(shape, dtype=torch_dtype(whole))
        targets: dict[TensorRequest, torch.Tensor] = {}
        pos = 0
        for i, (start, stop) in enumerate(ranges):
            request = TensorRequest(info.name, dim, start, stop - start, key=f"{info.name}#block{i}")
            targets[request] = out.narrow(dim, pos, stop - start)
            pos += stop - start
        if targets:
            self._read(targets)
        return out

    def _read(self, targets: dict[TensorRequest, torch.Tensor]) -> None:
        """One plan read into ``targets``, its bytes counted; quietly (readiness is tracked per
        FastWeights, see ``readiness``)."""
        self.bytes_read += self._core.read_into(targets, layer_events=False).bytes_read

    def close(self) -> None:
        self._core.close()  # closes the checkpoint's files too; later reads say "is closed"
