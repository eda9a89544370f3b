"""What ``vllm_fastload`` exports: the entry points, records that cannot change under their
holder, and the errors."""

from __future__ import annotations

import dataclasses
import inspect

import pydantic

import vllm_fastload

#: Exported objects that are not records: the open checkpoint, the hooks an adapter subclasses,
#: the iterator ``iter_tensors`` returns, and ``open``.
NOT_RECORDS = {"FastCheckpoint", "ReadHooks", "TensorStream", "open"}


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
    assert all(hasattr(vllm_fastload, name) for name in exported)
