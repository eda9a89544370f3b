"""Reader backends behind one interface, and the choice between them."""

from __future__ import annotations

import torch

from vllm_fastload import policy
from vllm_fastload.config import FastloadConfig
from vllm_fastload.policy import Backend
from vllm_fastload.readers.base import Call, FileWindow, Pending, ReadCall, Reader, RowsCall
from vllm_fastload.readers.host import HostReader

__all__ = ["Call", "FileWindow", "HostReader", "Pending", "ReadCall", "Reader", "RowsCall", "make_reader",
           "select_backend"]


def select_backend(config: FastloadConfig, device: torch.device, *, remote: bool = False) -> Backend:
    """The backend for ``device`` (``policy.backend``; kvikio is imported only where GDS matters)."""

    def gds_live() -> bool:
        from vllm_fastload.readers.kvikio import gds_available

        return gds_available()

    return policy.backend(config.backend, str(device), remote=remote, gds_live=gds_live)


def make_reader(config: FastloadConfig, device: torch.device | str, *, remote: bool = False) -> Reader:
    """The reader for ``device`` (``remote``: the checkpoint is in an object store)."""
    device = torch.device(device)
    index: int | None = device.index  # (None: the current device; torch's stubs say int)
    if device.type == "cuda" and index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = select_backend(config, device, remote=remote)
    reader: Reader
    if backend == "host":
        reader = HostReader(config, device)
    elif backend == "cuda":
        from vllm_fastload.readers.cuda import CudaReader

        reader = CudaReader(config, device)
    else:
        from vllm_fastload.readers.kvikio import KvikioReader

        reader = KvikioReader(config, device)
    reader.decisions.note("backend", backend, setting=config.backend, device=device, remote=remote)
    return reader
