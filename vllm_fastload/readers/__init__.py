"""Reader backends behind one interface, and the choice between them."""

from __future__ import annotations

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.readers.base import Pending, ReadCall, Reader
from vllm_fastload.readers.host import HostReader

__all__ = ["HostReader", "Pending", "ReadCall", "Reader", "make_reader", "select_backend"]


def select_backend(config: FastloadConfig, device: torch.device, *, remote: bool = False) -> str:
    """``auto``: host memory -> host; GPU -> kvikio only with real GDS, else pinned staging.

    kvikio without GDS runs in POSIX compatibility mode, which is what our cuda backend does
    too, except that ours overlaps disk and PCIe; so auto picks kvikio only when GDS is live.
    kvikio reads local paths only: objects (``remote``) go through cuda's pinned staging.
    """
    if device.type == "cpu":
        if config.backend not in ("auto", "host"):
            raise ValueError(f"backend {config.backend!r} needs a CUDA device; device is {device}")
        return "host"
    if device.type != "cuda":
        raise ValueError(f"unsupported device {device}; fastload reads into 'cpu' or 'cuda' memory")
    if config.backend == "host":
        raise ValueError("backend 'host' reads into host memory; use device='cpu' or backend 'cuda'")
    if config.backend == "kvikio" and remote:
        raise ValueError("backend 'kvikio' reads local files only; an object store checkpoint is read with "
                         "backend 'cuda' (or 'auto')")
    if config.backend != "auto":
        return config.backend
    if remote:
        return "cuda"
    from vllm_fastload.readers.kvikio import gds_available

    return "kvikio" if gds_available() else "cuda"


def make_reader(config: FastloadConfig, device: torch.device | str, *, remote: bool = False) -> Reader:
    """The reader for ``device`` (``remote``: the checkpoint is in an object store)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = select_backend(config, device, remote=remote)
    if backend == "host":
        return HostReader(config, device)
    if backend == "cuda":
        from vllm_fastload.readers.cuda import CudaReader

        return CudaReader(config, device)
    from vllm_fastload.readers.kvikio import KvikioReader

    return KvikioReader(config, device)
