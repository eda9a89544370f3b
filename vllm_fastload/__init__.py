"""vllm-fastload: fast, exact, per-rank checkpoint loading for vLLM, SGLang and TGI.

``__all__`` is what a user of ``open()`` and ``read_into()`` and the author of an engine adapter
need: the entry points, the records they hand out and take (all immutable), and the errors.
Importing this package never imports vLLM or SGLang (their loaders live in
``vllm_fastload.vllm_plugin`` and ``vllm_fastload.sglang_plugin`` and are loaded by the engines
through their plugin entry points).
"""

from vllm_fastload.api import FastCheckpoint, ReadHooks, TensorStream, open
from vllm_fastload.config import ConfigError, FastloadConfig
from vllm_fastload.errors import (
    AccessDeniedError,
    CheckpointError,
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
from vllm_fastload.events import LayerEvent
from vllm_fastload.executor import LoadStats
from vllm_fastload.format import TensorInfo
from vllm_fastload.plan import LayerGroup, Plan, PlannedTensor, TensorRequest

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "CheckpointError",
    "ConfigError",
    "FastCheckpoint",
    "FastloadConfig",
    "FileChangedError",
    "HeaderError",
    "IndexMismatchError",
    "InvalidRequestError",
    "LayerEvent",
    "LayerGroup",
    "LoadStats",
    "MissingFileError",
    "OutsideCheckpointError",
    "Plan",
    "PlanError",
    "PlannedTensor",
    "ReadError",
    "ReadHooks",
    "StalledReadError",
    "StoreUnavailableError",
    "TensorInfo",
    "TensorMetadataError",
    "TensorNotFoundError",
    "TensorRequest",
    "TensorStream",
    "TruncatedFileError",
    "open",
]
