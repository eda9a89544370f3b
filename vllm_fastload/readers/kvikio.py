"""``kvikio``: ``CuFile.pread`` straight into device memory (GPUDirect Storage where the system has it).

kvikio is imported only when this backend is chosen: it pulls in the CUDA runtime and
cuFile, which cost seconds to initialise and cannot even read into host memory without
libcuda. Files are opened (and registered with cuFile) on first use only, and only the
CUDA device we load onto is made current, so no context appears on other GPUs.
kvikio handles unaligned offsets itself (with a bounce buffer), so any plan works.

Slices along a later dim (``Rows``: thousands of 4-28 KiB segments for a TP rank's row-parallel
weights) do not go to cuFile, which costs tens of microseconds a call and moves whole pages:
they are read packed into pinned slots and copied once per batch (``staging``), so the rank
reads its own bytes and not the other ranks' (from the page cache by a strided copy out of a
mapping of the file; see ``mapped``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import ReadError
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers.base import Call, Pending, RowsCall
from vllm_fastload.readers.staging import StagedReader


def import_kvikio() -> Any:
    """kvikio with its defaults module (untyped: an optional GPU dependency)."""
    import kvikio
    import kvikio.defaults

    return kvikio


def gds_status() -> dict[str, object]:
    """What kvikio would do on this machine: GPUDirect Storage, or a POSIX compatibility path.

    ``auto`` and the GPU benchmark both need the truth, and kvikio's settings alone do not
    tell it: ``KVIKIO_COMPAT_MODE`` defaults to ``AUTO`` (an ``IntEnum``, so ``bool()`` of it
    is true and ``str()`` of it is ``"2"``), and even with compat mode off, cuFile itself
    falls back to POSIX I/O when the nvidia-fs driver is absent. So GDS counts as active
    only when kvikio does not prefer its compat mode *and* the cuFile driver reports GDS.
    """
    try:
        kvikio = import_kvikio()
    except Exception as exc:  # ImportError, or libkvikio/libcufile failing to load
        return {"kvikio": None, "active": False, "why": f"kvikio is not usable: {type(exc).__name__}: {exc}"}
    status: dict[str, object] = {"kvikio": getattr(kvikio, "__version__", "?")}
    defaults = kvikio.defaults
    try:
        if hasattr(defaults, "is_compat_mode_preferred"):  # kvikio >= 24.12: OFF / ON / AUTO
            mode = defaults.get("compat_mode")
            status["compat_mode"] = getattr(mode, "name", str(mode))
            preferred = bool(defaults.is_compat_mode_preferred())
        else:  # older kvikio: a bool
            preferred = bool(defaults.compat_mode())
            status["compat_mode"] = "ON" if preferred else "OFF"
    except Exception as exc:
        return {**status, "active": False, "why": f"kvikio compat mode unreadable: {exc}"}
    status["compat_preferred"] = preferred
    if preferred:
        return {**status, "active": False, "why": "kvikio prefers its POSIX compat mode (cuFile unavailable or "
                "KVIKIO_COMPAT_MODE=ON)"}
    try:
        driver: Any = importlib.import_module("kvikio.cufile_driver")
        status["cufile_gds_available"] = bool(driver.get("is_gds_available"))
        status["cufile_allow_compat"] = bool(driver.get("allow_compat_mode"))
    except Exception as exc:
        return {**status, "active": False, "why": f"cuFile driver properties unreadable: {exc}"}
    if not status["cufile_gds_available"]:
        return {**status, "active": False, "why": "cuFile is loaded but reports no GDS (no nvidia-fs): it reads "
                "through its own POSIX compat path"}
    return {**status, "active": True, "why": "cuFile with GDS"}


def gds_available() -> bool:
    """True when kvikio is usable and reads would really go through GPUDirect Storage."""
    return bool(gds_status()["active"])


class KvikioReader(StagedReader):
    """cuFile reads of whole ranges; row slices through the pinned staging, not cuFile."""

    name = "kvikio"

    def __init__(self, config: FastloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._kvikio = import_kvikio()
        torch.cuda.set_device(device)
        defaults = self._kvikio.defaults
        try:
            if hasattr(defaults, "set"):
                defaults.set("num_threads", config.threads)
                defaults.set("task_size", int(config.read_size))
            else:
                defaults.num_threads_reset(config.threads)
                defaults.task_size_reset(int(config.read_size))
        except Exception:
            pass
        self._files: dict[str, Any] = {}

    def _cufile(self, path: str) -> Any:
        handle = self._files.get(path)
        if handle is None:
            handle = self._files[path] = self._kvikio.CuFile(path, "r")
        return handle

    def submit(self, sf: SafetensorsFile, calls: Sequence[Call]) -> Pending:
        if sf.fd is None:
            raise ReadError("backend 'kvikio' reads local files only; use backend 'cuda' for objects", file=sf.path)
        rows: list[Call] = [call for call in calls if isinstance(call, RowsCall)]
        plain = [call for call in calls if not isinstance(call, RowsCall)]
        handle = self._cufile(sf.path)
        staged = self.staging.start(self, sf, rows) if rows else []
        futures: list[Future[Any]] = []
        try:
            for offset, length, dest in plain:
                futures.append(_IOFuture(handle.pread(dest, length, offset), sf.path, offset, length))
        except BaseException:
            Pending(futures + staged).wait_quietly()  # nothing may still write once the error is out
            raise
        return Pending(futures + staged)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        super().close()


class _IOFuture(Future[int]):
    """Adapts kvikio's IOFuture to ``result()`` and checks that every byte arrived."""

    def __init__(self, inner: Any, path: str, offset: int, length: int) -> None:
        super().__init__()
        self._inner, self._path, self._offset, self._length = inner, path, offset, length

    def result(self, timeout: float | None = None) -> int:
        try:
            got = int(self._inner.get())
        except Exception as exc:
            raise ReadError(f"kvikio read of {self._length} bytes at offset {self._offset} failed: {exc}",
                            file=self._path) from exc
        if got != self._length:
            raise ReadError(f"short read at offset {self._offset}: {got} of {self._length} bytes "
                            "(file truncated?)", file=self._path)
        return got
