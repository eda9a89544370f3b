"""``FastloadConfig``: every knob in one validated object.

Users write it as a dict (vLLM's ``--model-loader-extra-config``), as ``FASTLOAD_*``
environment variables, or in Python. Unknown keys and bad values fail loudly and name the
field, because a typo that silently falls back to a default is the worst kind of tuning bug.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_fastload.errors import ConfigError
from vllm_fastload.sources.config import RemoteConfig

ENV_PREFIX = "FASTLOAD_"
#: Variables with our prefix that are switches, not config fields.
_NON_CONFIG_ENV = {"FASTLOAD_TGI", "FASTLOAD_BENCH_DIR", "FASTLOAD_BENCH_CACHE", "FASTLOAD_BENCH_ENDPOINTS",
                   "FASTLOAD_TEST_EVENTS"}

LayerCallback = Callable[..., Any]


def default_threads() -> int:
    """One reader thread per usable CPU, at least 4 and at most 16.

    Measured on a 2-core VM: into fresh huge-page memory, 2 threads 7.9 GB/s, 4 threads 6.6 GB/s,
    8 threads 2.7 GB/s (page-fault contention); a cold-cache vLLM load of 1.67 GB took 3.2 s with
    2 threads, 2.9 s with 4 and 2.8 s with 8. Four is the compromise; big machines get one per core.
    """
    return max(4, min(16, usable_cpus()))


def usable_cpus() -> int:
    """CPUs this process may run on (vLLM-CPU binds each worker to its own cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


class FastloadConfig(BaseModel):
    """How fastload reads a checkpoint. All fields are optional."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    backend: Literal["auto", "host", "cuda", "kvikio"] = Field(
        "auto", description="Reader: 'host' (threaded pread into host memory), 'cuda' (pinned "
        "staging + async copies), 'kvikio' (cuFile/GDS), or 'auto' (best for the target device).")
    threads: int = Field(default_factory=lambda: default_threads(), ge=1, le=256,
                         description="Reader threads issuing reads in parallel; default: the CPUs this "
                         "process may run on, between 4 and 16.")
    read_size: ByteSize = Field(ByteSize(8 << 20), description="Largest single read call; bigger "
                                "reads are split and spread over the threads.")
    aggregate_size: ByteSize = Field(ByteSize(64 << 20), description="Largest aggregated read "
                                     "(adjacent tensors coalesced into one buffer).")
    memory_budget: ByteSize = Field(ByteSize(1 << 30), description="Most bytes of read buffers "
                                    "(host, pinned or device staging) held at once.")
    strided_min_skip: ByteSize | None = Field(None, description="A slice along dim>0 is read row by "
                                              "row when at least this many bytes per row are skipped; "
                                              "otherwise the enclosing rows are read. None: the backend's default.")
    on_layer_ready: list[str | LayerCallback] = Field(
        default_factory=list, description="Callables or 'module:function' strings called with each LayerEvent.")
    progress: bool = Field(True, description="Show a tqdm progress bar (rank 0 only in multi-rank use).")
    log_layers: bool = Field(False, description="Log one DEBUG line per completed layer.")
    check_file_changes: bool = Field(True, description="Fail if a file's size or mtime changes during the load.")
    direct_io: Literal["auto", "always", "never"] = Field(
        "auto", description="host backend: O_DIRECT for contiguous ranges not in the page cache "
        "('auto'), for every contiguous range ('always'), or never (buffered reads with read-ahead "
        "advice). Where a filesystem refuses O_DIRECT, fastload reads through the page cache.")
    hugepages: bool = Field(True, description="Ask for transparent huge pages on host buffers "
                            "(fresh memory is ~6x faster to fill that way).")
    remote: RemoteConfig = Field(default_factory=RemoteConfig, description="Object store settings for "
                                 "s3://, gs://, az:// and http(s):// checkpoints (see sources.config).")

    @field_validator("on_layer_ready", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if callable(value):
            return [value]
        return value

    @field_validator("on_layer_ready")
    @classmethod
    def _check_callbacks(cls, value: list) -> list:
        for item in value:
            if isinstance(item, str) and (":" not in item or item.startswith(":") or item.endswith(":")):
                raise ValueError(f"{item!r} is not of the form 'package.module:function'")
        return value

    @field_validator("read_size")
    @classmethod
    def _read_size_floor(cls, value: int) -> int:
        if value < 4096:
            raise ValueError("read_size must be at least 4096 bytes")
        return value

    @model_validator(mode="after")
    def _sizes_fit(self) -> FastloadConfig:
        if 2 * self.aggregate_size > self.memory_budget:
            raise ValueError(f"memory_budget ({self.memory_budget.human_readable()}) must hold two aggregated "
                             f"reads of aggregate_size ({self.aggregate_size.human_readable()}): one being "
                             "consumed while the next is read")
        if self.read_size > self.aggregate_size:
            raise ValueError(f"read_size ({self.read_size.human_readable()}) must not exceed "
                             f"aggregate_size ({self.aggregate_size.human_readable()})")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FastloadConfig:
        """Values from ``FASTLOAD_<FIELD>`` variables, then ``overrides`` on top."""
        values = _env_values(os.environ if environ is None else environ)
        values.update(overrides)
        return cls.build(values)

    @classmethod
    def build(cls, values: Mapping[str, Any] | FastloadConfig | None = None) -> FastloadConfig:
        """Validate a dict (e.g. vLLM's extra config) into a config, with one clear error."""
        if isinstance(values, FastloadConfig):
            return values
        try:
            return cls(**dict(values or {}))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors())
            known = ", ".join(cls.model_fields)
            raise ConfigError(f"invalid fastload configuration: {problems} (known fields: {known})") from None


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _NON_CONFIG_ENV:
            continue
        field = key[len(ENV_PREFIX):].lower()
        if field not in FastloadConfig.model_fields:
            raise ConfigError(f"unknown environment variable {key} (fastload reads "
                              f"{', '.join(ENV_PREFIX + f.upper() for f in FastloadConfig.model_fields)})")
        values[field] = _parse_env_value(raw)
    return values


def _parse_env_value(raw: str) -> Any:
    """Env values are strings; accept JSON scalars/lists too (``8``, ``true``, ``null``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
