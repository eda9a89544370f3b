"""vllm-fastload: fast, exact, per-rank checkpoint loading for vLLM, SGLang and TGI.

The package root is the one door to the engine-independent core: what a user of ``open()`` and
``read_into()`` needs, and what an engine adapter needs to load a rank (the adapters import the core
only from here and from ``vllm_fastload.model``; a test holds them to it). ``__all__`` lists it:

- opening a checkpoint (a directory, files, an object-store URI): ``open``, ``FastCheckpoint``,
  ``read_header``, ``read_index``, ``is_remote``;
- reading: ``FastCheckpoint.read_into`` with ``ReadHooks``, ``iter_tensors`` (a ``TensorStream``);
- the configuration: ``FastloadConfig``, and ``resolve`` with ``ConfigFacts`` for the defaults that
  depend on where a load runs;
- the events: ``LayerEvent``, ``LayerTracker`` (readiness counted as tensors arrive), ``Countdown``;
- the records handed out and taken (all immutable, all the way down) and the errors.

Names are imported on first use (PEP 562): importing the package imports nothing beyond the
standard library. Every vLLM and SGLang process imports it to register the plugin, and the
early-reads process, a bare interpreter, imports the package's standard-library-only modules
(``vllm_fastload.machine``, ``vllm_fastload.early.child``) through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Where each public name is defined (a module of the package).
_HOME = {
    "FastCheckpoint": "api", "ReadHooks": "api", "TensorStream": "api", "open": "api",
    "ConfigError": "errors", "ConfigFacts": "config", "FastloadConfig": "config", "RemoteConfig": "config",
    "resolve": "config",
    "Countdown": "events", "LayerEvent": "events", "LayerTracker": "events",
    "LoadStats": "executor", "LoadReport": "report",
    "SafetensorsHeader": "format", "TensorInfo": "format", "read_header": "checkpoint", "read_index": "checkpoint",
    "LayerGroup": "plan", "Plan": "plan", "PlannedTensor": "plan", "TensorRequest": "plan",
    "is_remote": "sources",
    **{name: "errors" for name in (
        "AccessDeniedError", "CheckpointError", "FileChangedError", "HeaderError", "IndexMismatchError",
        "InvalidRequestError", "MissingFileError", "OutsideCheckpointError", "PlanError", "ReadError",
        "StalledReadError", "StoreUnavailableError", "TensorMetadataError", "TensorNotFoundError",
        "TruncatedFileError")},
}

if TYPE_CHECKING:
    from vllm_fastload.api import FastCheckpoint, ReadHooks, TensorStream, open
    from vllm_fastload.checkpoint import read_header, read_index
    from vllm_fastload.config import ConfigFacts, FastloadConfig, RemoteConfig, resolve
    from vllm_fastload.errors import (
        AccessDeniedError,
        CheckpointError,
        ConfigError,
        FileChangedError,
        HeaderError,
        IndexMismatchError,
        InvalidRequestError,
        MissingFileError,
        OutsideCheckpointError,
        PlanError,
        ReadError,
        StalledReadError,
        StoreUnavailableError,
        TensorMetadataError,
        TensorNotFoundError,
        TruncatedFileError,
    )
    from vllm_fastload.events import Countdown, LayerEvent, LayerTracker
    from vllm_fastload.executor import LoadStats
    from vllm_fastload.format import SafetensorsHeader, TensorInfo
    from vllm_fastload.plan import LayerGroup, Plan, PlannedTensor, TensorRequest
    from vllm_fastload.report import LoadReport
    from vllm_fastload.sources import is_remote

__all__ = [
    "AccessDeniedError",
    "CheckpointError",
    "ConfigError",
    "ConfigFacts",
    "Countdown",
    "FastCheckpoint",
    "FastloadConfig",
    "FileChangedError",
    "HeaderError",
    "IndexMismatchError",
    "InvalidRequestError",
    "LayerEvent",
    "LayerGroup",
    "LayerTracker",
    "LoadReport",
    "LoadStats",
    "MissingFileError",
    "OutsideCheckpointError",
    "Plan",
    "PlanError",
    "PlannedTensor",
    "ReadError",
    "ReadHooks",
    "RemoteConfig",
    "SafetensorsHeader",
    "StalledReadError",
    "StoreUnavailableError",
    "TensorInfo",
    "TensorMetadataError",
    "TensorNotFoundError",
    "TensorRequest",
    "TensorStream",
    "TruncatedFileError",
    "is_remote",
    "open",
    "read_header",
    "read_index",
    "resolve",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
