"""The ``FASTLOAD_*`` environment, as ``FastloadConfig`` reads it.

pydantic-settings reads ``FASTLOAD_<FIELD>`` for every field and ``FASTLOAD_REMOTE__<FIELD>`` for
the nested object store settings. ``FastloadEnv`` keeps the project's own rules on top: every
``FASTLOAD_*`` variable must mean something (a typo is an error listing the known names;
``FASTLOAD_TGI`` and ``FASTLOAD_DEV_*``, the scripts' and tests' own, are not config), a value is
JSON if it parses as JSON and text otherwise (``8``, ``false``, ``null``, ``64MiB``,
``a.b:c,d:e``), and ``.env`` files are not read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource

from vllm_fastload.errors import ConfigError

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


#: The environment ``FastloadEnv`` reads when none is given: ``from_env``'s (``{}`` for ``build``), else ``os.environ``.
ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("fastload_environ", default=None)


class FastloadEnv(EnvSettingsSource):
    """pydantic-settings' environment source with fastload's rules (see the module docstring).

    Only variables that start with ``FASTLOAD_`` (in capitals, like every variable we document)
    are seen, minus those that are not config (``is_config_variable``); the rest of the name is
    case-blind, as field names are lower case.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> None:
        super().__init__(settings_cls)
        if environ is None:
            environ = ENVIRON.get()
        if environ is None:
            environ = os.environ
        #: The variables as the user wrote them, for checking their names.
        self.variables = {name: value for name, value in environ.items() if is_config_variable(name)}
        # What pydantic-settings matches against ``FASTLOAD_`` + field name (+ ``__`` + nested field name).
        self.env_vars = {ENV_PREFIX + name[len(ENV_PREFIX):].lower(): value for name, value in self.variables.items()}

    def __call__(self) -> dict[str, Any]:
        for name in sorted(self.variables):
            check_name(name, self.settings_cls)
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
        elif field is not None and isinstance(value, str) and get_origin(field.annotation) not in (dict, Mapping):
            out[key] = _json_or_text(value)
        else:
            out[key] = value
    return out


def _merged(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, Mapping) else value
    return out


def check_name(name: str, model: type[BaseModel]) -> None:
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
        if get_origin(annotation) in (dict, Mapping) and len(rest) == 1 and rest[0]:
            return  # one entry of a dict field, e.g. FASTLOAD_REMOTE__STORE_OPTIONS__ALLOW_HTTP
        raise ConfigError(f"unknown environment variable {name} ({prefix}{part.upper()} has no nested fields)")


def variable_for(loc: tuple[int | str, ...], overrides: Mapping[str, Any], names: Mapping[str, str]) -> str | None:
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
