"""``FastloadConfig``: every knob in one validated object.

Users write it as a dict (vLLM's ``--model-loader-extra-config``), as ``FASTLOAD_*``
environment variables, or in Python. Unknown keys and bad values fail loudly and name the
field (and the variable it came from), because a typo that silently falls back to a default
is the worst kind of tuning bug.

The environment is read by pydantic-settings: ``FASTLOAD_<FIELD>`` for every field and
``FASTLOAD_REMOTE__<FIELD>`` for the nested object store settings. On top of what
pydantic-settings does by itself, ``FastloadEnv`` keeps the project's own rules: every
``FASTLOAD_*`` variable must mean something (a typo is an error listing the known names;
``FASTLOAD_TGI`` and ``FASTLOAD_DEV_*``, the scripts' and tests' own, are not config), a value
is JSON if it parses as JSON and text otherwise (``8``, ``false``, ``null``, ``64MiB``,
``a.b:c,d:e``), and ``.env`` files are not read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, get_origin

from pydantic import BaseModel, ByteSize, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from vllm_fastload import policy
from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.errors import ConfigError as ConfigError  # re-exported: the config's own error
from vllm_fastload.policy import BackendSetting, Mode

ENV_PREFIX = "FASTLOAD_"
#: Separates a nested field in a variable's name: ``FASTLOAD_REMOTE__TIMEOUT_S=10``.
ENV_NESTED = "__"
#: Variables with our prefix that are not config: the TGI patch's on-switch, and everything under
#: ``DEV_PREFIX``, which belongs to the project's own scripts, tests and benchmarks.
SWITCHES = frozenset({"FASTLOAD_TGI"})
DEV_PREFIX = "FASTLOAD_DEV_"


def is_config_variable(name: str) -> bool:
    """Whether the loader reads environment variable ``name`` as a config field (and refuses it if unknown)."""
    return name.startswith(ENV_PREFIX) and name not in SWITCHES and not name.startswith(DEV_PREFIX)


LayerCallback = Callable[..., Any]


def default_threads() -> int:
    """Reader threads when none are configured, for the CPUs this thread may use (``policy.default_threads``)."""
    return policy.default_threads(usable_cpus())


def usable_cpus() -> int:
    """CPUs the calling thread may run on (vLLM-CPU binds each worker to its own cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def reader_cpu_count(config: FastloadConfig) -> int:
    """CPUs a reader's threads may run on: ``config.cpus``, else the calling thread's."""
    return len(config.cpus) if config.cpus else usable_cpus()


class FastloadConfig(BaseSettings):
    """How fastload reads a checkpoint. All fields are optional.

    ``FastloadConfig(**values)`` and ``FastloadConfig.from_env(**values)`` read the ``FASTLOAD_*``
    environment and put ``values`` on top (a nested ``remote`` dict is merged key by key), as
    the vLLM loader does with ``--model-loader-extra-config``. ``FastloadConfig.build(values)``
    takes exactly ``values``: a config handed to ``vllm_fastload.open`` or TGI's ``FastWeights``
    is used as it is, whatever the environment says.
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
    cpus: list[int] | None = Field(None, description="CPUs the reader's threads run on (e.g. [0, 1]); None: "
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
    on_layer_ready: list[str | LayerCallback] = Field(
        default_factory=list, description="Callables or 'module:function' strings called with each LayerEvent.")
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
            return []
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if callable(value):
            return [value]
        return value

    @field_validator("on_layer_ready")
    @classmethod
    def _check_callbacks(cls, value: list[Any]) -> list[Any]:
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
    def _known_cpus(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        count = os.cpu_count() or 1
        unknown = sorted({c for c in value if not 0 <= c < count})
        if not value or unknown:
            raise ValueError(f"cpus must list CPUs of this machine (0 to {count - 1}), got {value}")
        return sorted(set(value))

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FastloadConfig:
        """Values from ``FASTLOAD_*`` variables (of ``environ``, default this process's), then ``overrides``
        on top; a bad value is a ``ConfigError`` naming the field and the variable it came from."""
        environ = os.environ if environ is None else environ
        names = {name.upper(): name for name in environ if name.startswith(ENV_PREFIX)}
        return cls._validated(overrides, environ, lambda loc: _variable_for(loc, overrides, names))

    @classmethod
    def build(cls, values: Mapping[str, Any] | FastloadConfig | None = None) -> FastloadConfig:
        """Validate exactly ``values`` (e.g. vLLM's extra config; no environment), with one clear error."""
        if isinstance(values, FastloadConfig):
            return values
        return cls._validated(dict(values or {}), {}, lambda loc: None)

    @classmethod
    def _validated(cls, values: Mapping[str, Any], environ: Mapping[str, str],
                   variable_for: Callable[[tuple[int | str, ...]], str | None]) -> FastloadConfig:
        # pydantic-settings takes keyword arguments that start with "_" as its own options
        # (``_cli_parse_args`` would parse sys.argv): from a dict they are unknown keys like any other.
        private = sorted(key for key in values if isinstance(key, str) and key.startswith("_"))
        if private:
            raise ConfigError(f"invalid fastload configuration: {private[0]}: Extra inputs are not permitted "
                              f"(known fields: {', '.join(cls.model_fields)})")
        token = _ENVIRON.set(environ)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(_message(cls, exc, variable_for)) from None
        finally:
            _ENVIRON.reset(token)


#: The environment ``FastloadEnv`` reads when none is given: ``from_env``'s (``{}`` for ``build``), else ``os.environ``.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("fastload_environ", default=None)


class FastloadEnv(EnvSettingsSource):
    """pydantic-settings' environment source with fastload's rules (see the module docstring).

    Only variables that start with ``FASTLOAD_`` (in capitals, like every variable we document)
    are seen, minus those that are not config (``is_config_variable``); the rest of the name is
    case-blind, as field names are lower case.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> None:
        super().__init__(settings_cls)
        if environ is None:
            environ = _ENVIRON.get()
        if environ is None:
            environ = os.environ
        #: The variables as the user wrote them, for checking their names.
        self.variables = {name: value for name, value in environ.items() if is_config_variable(name)}
        # What pydantic-settings matches against ``FASTLOAD_`` + field name (+ ``__`` + nested field name).
        self.env_vars = {ENV_PREFIX + name[len(ENV_PREFIX):].lower(): value for name, value in self.variables.items()}

    def __call__(self) -> dict[str, Any]:
        for name in sorted(self.variables):
            _check_name(name, self.settings_cls)
        return super().__call__()

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool) -> Any:
        if isinstance(value, str):  # FASTLOAD_<FIELD> is set
            value = _json_or_text(value)
            if isinstance(value, dict):  # a JSON object, which FASTLOAD_<FIELD>__<KEY> variables refine
                return _merged(value, self.explode_env_vars(field_name, field, self.env_vars))
            return value
        return super().prepare_field_value(field_name, field, value, value_is_complex)  # nested variables only

    def explode_env_vars(self, field_name: str, field: FieldInfo, env_vars: Mapping[str, str | None]) -> dict[str, Any]:
        return _decode_leaves(field.annotation, super().explode_env_vars(field_name, field, env_vars))

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        # Not JSON: the text itself, which validation then refuses with a message that names the field
        # and never repeats the value (it may be a credential).
        return _json_or_text(value)


def _json_or_text(raw: str) -> Any:
    """Env values are strings; accept JSON too (``8``, ``true``, ``null``, ``["a:b"]``, ``{"timeout_s": 10}``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _decode_leaves(annotation: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Give ``FASTLOAD_REMOTE__TIMEOUT_S=10`` the same value syntax as a top-level variable; the entries
    of a dict field (``store_options``: credentials) stay the text they were."""
    if not _is_model(annotation):
        return values
    out: dict[str, Any] = {}
    for key, value in values.items():
        field = annotation.model_fields.get(key)
        if field is not None and isinstance(value, dict):
            out[key] = _decode_leaves(field.annotation, value)
        elif field is not None and isinstance(value, str) and get_origin(field.annotation) is not dict:
            out[key] = _json_or_text(value)
        else:
            out[key] = value
    return out


def _merged(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, Mapping) else value
    return out


def _check_name(name: str, model: type[BaseModel]) -> None:
    """An unknown ``FASTLOAD_*`` variable is an error that lists the names fastload reads there."""
    parts = name[len(ENV_PREFIX):].lower().split(ENV_NESTED)
    prefix = ENV_PREFIX
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            known = ", ".join(prefix + f.upper() for f in fields)
            nested = "; fields of a nested object as FASTLOAD_<FIELD>__<NAME>" if depth == 0 else ""
            raise ConfigError(f"unknown environment variable {name} (fastload reads {known}{nested})")
        annotation = fields[part].annotation
        rest = parts[depth + 1:]
        if not rest:
            return
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model, prefix = annotation, f"{prefix}{part.upper()}{ENV_NESTED}"
            continue
        if get_origin(annotation) is dict and len(rest) == 1 and rest[0]:
            return  # one entry of a dict field, e.g. FASTLOAD_REMOTE__STORE_OPTIONS__ALLOW_HTTP
        raise ConfigError(f"unknown environment variable {name} ({prefix}{part.upper()} has no nested fields)")


def _variable_for(loc: tuple[int | str, ...], overrides: Mapping[str, Any], names: Mapping[str, str]) -> str | None:
    """The variable a bad value at ``loc`` came from, unless the caller's ``overrides`` gave it."""
    node: Any = overrides
    for part in loc:
        if not isinstance(node, Mapping):
            return None  # inside an explicit object (e.g. a RemoteConfig)
        if part not in node:
            break
        node = node[part]
    else:
        return None
    for depth in range(len(loc), 0, -1):
        name = names.get(ENV_PREFIX + ENV_NESTED.join(str(p).upper() for p in loc[:depth]))
        if name is not None:
            return name
    return None


def _message(cls: type[BaseModel], exc: ValidationError,
             variable_for: Callable[[tuple[int | str, ...]], str | None]) -> str:
    """One line for every problem: field (and variable), pydantic's message; never the value itself."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        variable = variable_for(err["loc"]) if err["loc"] else None
        problems.append(f"{where}{f' (from {variable})' if variable else ''}: {err['msg']}")
    return f"invalid fastload configuration: {'; '.join(problems)} (known fields: {', '.join(cls.model_fields)})"
