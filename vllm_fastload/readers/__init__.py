"""Reader backends behind one interface, and the choice between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_fastload import policy
from vllm_fastload.config import FastloadConfig
from vllm_fastload.policy import Backend
from vllm_fastload.readers.base import Call, FileWindow, Pending, ReadCall, Reader, RowsCall
from vllm_fastload.readers.host import HostReader

__all__ = ["Call", "FileWindow", "HostReader", "Pending", "ReadCall", "Reader", "ReaderTraits", "RowsCall",
           "make_reader", "reader_traits"]


@dataclass(frozen=True)
class ReaderTraits:
    """What a plan needs to know of the reader before any reader exists: which backend, on which
    device (a CUDA device by its index), and whether it takes a slice's rows as such."""

    backend: Backend
    device: torch.device
    reads_rows: bool


def reader_traits(config: FastloadConfig, device: torch.device | str, *, remote: bool = False) -> ReaderTraits:
    """The backend for ``device`` (``policy.backend``; kvikio is imported only where GDS matters)
    and its traits; ``remote``: the checkpoint is in an object store."""
    device = torch.device(device)
    index: int | None = device.index  # (None: the current device; torch's stubs say int)
    if device.type == "cuda" and index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def gds_live() -> bool:
        from vllm_fastload.readers.kvikio import gds_available

        return gds_available()

    backend = policy.backend(config.backend, str(device), remote=remote, gds_live=gds_live)
    return ReaderTraits(backend, device, _reader_class(backend).reads_rows)


def make_reader(config: FastloadConfig, traits: ReaderTraits) -> Reader:
    """The reader ``traits`` describe, with ``config``'s settings (no thread starts before its first read)."""
    reader = _reader_class(traits.backend)(config, traits.device)
    reader.decisions.note("backend", traits.backend, setting=config.backend, device=traits.device)
    return reader


def _reader_class(backend: Backend) -> type[Reader]:
    if backend == "host":
        return HostReader
    if backend == "cuda":
        from vllm_fastload.readers.cuda import CudaReader

        return CudaReader
    from vllm_fastload.readers.kvikio import KvikioReader

    return KvikioReader
