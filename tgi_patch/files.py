"""The bridge to the core: TGI names a tensor by (file, name); the core reads by name.

TGI's routing is a plain dict that model code extends after construction (speculator heads), so
files are added on first use (``FastCheckpoint.add_file``). All reads land in host memory as owned
tensors in the checkpoint's dtype; FastWeights then applies TGI's cast and device moves in TGI's
order, so the results are the ones TGI computes. Each read is quiet (no layer events, no bar): one
TGI call is one tiny plan, so readiness is counted per FastWeights instead (``LayerTracker``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

import vllm_fastload
from vllm_fastload import (
    ConfigError,
    FastCheckpoint,
    FastloadConfig,
    IndexMismatchError,
    SafetensorsHeader,
    TensorInfo,
    TensorNotFoundError,
    TensorRequest,
)


def file_key(filename: str | os.PathLike[str]) -> str:
    """One spelling per file, so a routing entry given as str or Path finds the same parsed file."""
    return os.path.abspath(os.fspath(filename))


class CheckpointFiles:
    """Parsed headers and open descriptors of every file a FastWeights has routed to."""

    def __init__(self, config: FastloadConfig) -> None:
        if config.backend not in ("auto", "host"):
            raise ConfigError(f"tgi_patch reads into host memory and lets TGI move tensors to the GPU; "
                              f"backend must be 'auto' or 'host', not {config.backend!r}")
        self._config = config
        # Opened with the first file (a FastWeights may start with none and be routed to files later).
        self._core: FastCheckpoint | None = None
        self._closed = False
        self.bytes_read = 0

    @staticmethod
    def parse(filename: str | os.PathLike[str]) -> SafetensorsHeader:
        """One file's header, without adding the file (the caller checks for duplicate names first)."""
        return vllm_fastload.read_header(file_key(filename))

    def open(self, filenames: Sequence[str | os.PathLike[str]]) -> None:
        """Open the files routed to at construction (read into host memory, ``backend`` auto: host)."""
        if filenames:
            self._core = FastCheckpoint([file_key(f) for f in filenames], "cpu", self._config, show_progress=False)

    @property
    def tensors(self) -> list[TensorInfo]:
        """The tensors of the files opened so far."""
        return [] if self._core is None else list(self._core.tensors.values())

    def file(self, filename: str | os.PathLike[str]) -> SafetensorsHeader:
        if self._closed:
            raise ValueError(f"the checkpoint of these weights is closed (reading {filename})")
        if self._core is None:
            self._core = FastCheckpoint([file_key(filename)], "cpu", self._config, show_progress=False)
        return self._core.add_file(file_key(filename))

    def info(self, filename: str | os.PathLike[str], name: str) -> TensorInfo:
        """The tensor ``name`` in ``filename`` itself (not merely some file holding that name)."""
        header = self.file(filename)
        info = header.tensors.get(name)
        if info is None:
            raise TensorNotFoundError(f"the weights routing maps this tensor to this file, but the file does not "
                                      f"hold it ({len(header.tensors)} tensors in the file)", file=header.path,
                                      tensor=name)
        assert self._core is not None
        if self._core.info(name) is not info:
            raise IndexMismatchError(f"tensor is in two routed files: {self._core.info(name).file} and {header.path}",
                                     file=header.path, tensor=name)
        return info

    def read(self, filename: str | os.PathLike[str], name: str, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        """The whole tensor, or ``[start, start + length)`` along ``dim``: only those bytes are read,
        into a tensor of the checkpoint's dtype."""
        info = self.info(filename, name)
        request = TensorRequest(info.name, dim, start, length)
        assert self._core is not None
        out = self._core.empty(request)  # (the slice checked against the tensor)
        self._read({request: out})
        return out

    def read_blocks(self, filename: str | os.PathLike[str], name: str, dim: int,
                    ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Several ``[start, stop)`` ranges along ``dim`` (0 or 1), concatenated, read in one plan.

        Each range is read straight into its place in the result (dim 0) or copied there
        from the read buffer (dim 1), so there is no ``torch.cat`` copy.
        """
        info = self.info(filename, name)
        assert self._core is not None
        out = self._core.empty(TensorRequest(info.name, dim, 0, sum(stop - start for start, stop in ranges)))
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
        """One plan read into ``targets``, its bytes counted; quietly (see the module docstring)."""
        assert self._core is not None
        self.bytes_read += self._core.read_into(targets, layer_events=False).bytes_read

    def close(self) -> None:
        self._closed = True
        if self._core is not None:
            self._core.close()  # closes the checkpoint's files too; later reads say "is closed"
