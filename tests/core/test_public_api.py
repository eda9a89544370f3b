"""What ``vllm_fastload`` exports: the entry points, records that cannot change under their
holder, and the errors."""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing

import pydantic
import torch

import vllm_fastload
from vllm_fastload.frozen import FrozenMap

#: Exported objects that are not records: the open checkpoint, the hooks an adapter subclasses,
#: the iterator ``iter_tensors`` returns, and ``open``.
NOT_RECORDS = {"FastCheckpoint", "ReadHooks", "TensorStream", "open", "read_header", "read_index", "is_remote",
               "resolve", "LayerTracker", "Countdown"}


def _frozen(obj: object) -> bool:
    if inspect.isclass(obj) and issubclass(obj, pydantic.BaseModel):
        return bool(obj.model_config.get("frozen"))
    return dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen


def test_every_exported_record_is_immutable() -> None:
    exported = {name: getattr(vllm_fastload, name) for name in vllm_fastload.__all__}
    errors = {name for name, obj in exported.items() if inspect.isclass(obj) and issubclass(obj, Exception)}
    records = set(exported) - errors - NOT_RECORDS
    assert {"Plan", "LoadStats", "TensorRequest", "FastloadConfig"} <= records
    assert sorted(name for name in records if not _frozen(exported[name])) == []


def test_the_exports_are_what_open_read_into_and_an_adapter_need() -> None:
    exported = set(vllm_fastload.__all__)
    assert {"open", "FastCheckpoint", "FastloadConfig", "TensorRequest", "LoadStats", "TensorStream",
            "ReadHooks", "Plan", "LayerGroup", "PlannedTensor", "LayerEvent", "TensorInfo",
            "CheckpointError"} <= exported
    assert "Checkpoint" not in exported  # the files behind an open checkpoint are its own
    assert {"LoadReport", "LayerTracker", "ConfigFacts", "resolve", "read_header", "SafetensorsHeader"} <= exported
    assert all(hasattr(vllm_fastload, name) for name in exported)


# -- immutable all the way down ------------------------------------------------------------------

#: Values a record must not hold anywhere: they can change under whoever holds the record.
MUTABLE = (list, dict, set, bytearray)
_MUTABLE_TYPES = {list, dict, set, bytearray, typing.List, typing.Dict, typing.Set,  # noqa: UP006
                  collections.abc.MutableMapping, collections.abc.MutableSequence, collections.abc.MutableSet}


def _frozen_record(cls: type) -> bool:
    if issubclass(cls, pydantic.BaseModel):
        return bool(cls.model_config.get("frozen"))
    return dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def _field_types(cls: type) -> dict[str, object]:
    """Each field's type; its text where it names what only type checkers import."""
    try:
        hints = typing.get_type_hints(cls, include_extras=False)
    except NameError:
        hints = {}
    if issubclass(cls, pydantic.BaseModel):
        return {name: hints.get(name, f.annotation) for name, f in cls.model_fields.items()}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def mutable_in_type(tp: object) -> bool:
    """Whether a field's type admits a list, dict or set anywhere inside it."""
    if isinstance(tp, str):
        return re.search(r"\b(list|dict|set|bytearray|List|Dict|Set|Mutable\w+)\b", tp) is not None
    origin = typing.get_origin(tp)
    if tp in _MUTABLE_TYPES or origin in _MUTABLE_TYPES:
        return True
    return any(mutable_in_type(arg) for arg in typing.get_args(tp) if arg is not Ellipsis)


def mutable_fields(module_names: list[str]) -> list[str]:
    """``module.Record.field: type`` of every field of a frozen record defined in the modules whose type
    admits a list, dict or set."""
    found = []
    for name in module_names:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name and _frozen_record(cls):
                found += [f"{name}.{cls.__name__}.{field}: {tp}" for field, tp in _field_types(cls).items()
                          if mutable_in_type(tp)]
    return found


def mutable_values(value: object, where: str = "record", seen: set[int] | None = None) -> list[str]:
    """Where a list, dict or set sits inside ``value`` (records, tuples, mappings, frozensets walked;
    tensors, the caller's own, are not)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return []
    seen.add(id(value))
    if isinstance(value, MUTABLE):
        return [f"{where}: {type(value).__name__}"]
    if isinstance(value, pydantic.BaseModel):
        items = [(f".{k}", getattr(value, k)) for k in type(value).model_fields]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, collections.abc.Mapping):
        items = [(f"[{k!r}]", v) for k, v in value.items()] + [(f" key {k!r}", k) for k in value]
    elif isinstance(value, (tuple, frozenset)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        return []
    return [found for suffix, v in items for found in mutable_values(v, where + suffix, seen)]


def _package_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(vllm_fastload.__path__, "vllm_fastload."):
        if any(part in info.name for part in (".sglang_plugin", ".vllm_plugin", "sitecustomize", "__main__")):
            continue  # the adapters need their engine to import (and define no records); checked below
        names.append(info.name)
    return names


def test_no_frozen_record_of_the_package_has_a_list_dict_or_set_field() -> None:
    modules = _package_modules()
    assert "vllm_fastload.plan" in modules and "vllm_fastload.report" in modules
    assert mutable_fields(modules) == []


def test_the_records_an_open_checkpoint_and_a_load_hand_out_hold_nothing_mutable(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"model.layers.0.w": torch.randn(6, 8), "model.embed.weight": torch.randn(4, 8)},
              str(tmp_path / "model.safetensors"))
    events: list[vllm_fastload.LayerEvent] = []
    config = vllm_fastload.FastloadConfig.build({"on_layer_ready": [events.append], "cpus": [0],
                                                  "remote": {"store_options": {"region": "x"}}, "progress": False})
    with vllm_fastload.open(tmp_path, config=config) as ckpt:
        plan = ckpt.plan([vllm_fastload.TensorRequest("model.layers.0.w", dim=1, start=2, length=4),
                          "model.embed.weight"])
        stats = ckpt.read_into({name: torch.empty(ckpt.info(name).shape) for name in ckpt.keys()})
        header = vllm_fastload.read_header(tmp_path / "model.safetensors")
        records = {"config": ckpt.config, "plan": plan, "stats": stats, "header": header, "events": tuple(events),
                   "info": ckpt.info("model.embed.weight")}
    report = vllm_fastload.LoadReport(rank=0, world=1, planned=True, phases={"read": 1.0}, paths={"whole": 2})
    records["report"] = report
    assert events and all(mutable_values(r, name) == [] for name, r in records.items()), \
        [found for name, r in records.items() for found in mutable_values(r, name)]
    assert report.as_dict()["phases"] == {"read": 1.0} and report.as_dict()["paths"] == {"whole": 2}


def test_the_checks_catch_a_list_in_a_frozen_record() -> None:
    @dataclasses.dataclass(frozen=True)
    class Leaky:
        names: list[str]
        nested: tuple[typing.Mapping[str, dict[str, int]], ...] = ()

    assert mutable_in_type(_field_types(Leaky)["names"]) and mutable_in_type(_field_types(Leaky)["nested"])
    assert not mutable_in_type(tuple[int, ...]) and not mutable_in_type(typing.Mapping[str, frozenset[int]])
    assert mutable_values(Leaky(["a"]), "leaky") == ["leaky.names: list"]
    assert mutable_values(Leaky((), (FrozenMap({"k": {"n": 1}}),)), "leaky") == ["leaky.nested[0]['k']: dict"]
