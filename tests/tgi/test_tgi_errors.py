"""Bad input: TGI's exception types for TGI-level mistakes, the core's CheckpointError (naming file
and tensor) for broken files and configuration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tgi_helpers import FakeGroup, write

from tgi_patch import FastWeights
from vllm_fastload import (
    CheckpointError,
    ConfigError,
    FileChangedError,
    HeaderError,
    IndexMismatchError,
    MissingFileError,
    ReadError,
    TensorNotFoundError,
    TruncatedFileError,
)

SPECS = {"model.layers.0.a": ((8, 8), torch.float32), "model.layers.0.b": ((4, 4), torch.bfloat16)}


def build(path: Path) -> FastWeights:
    return FastWeights([path], "cpu", torch.float32, FakeGroup(0, 1), None, config={"progress": False})


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(TruncatedFileError) as err:
        build(path)
    assert str(path) in str(err.value) and "model.layers.0.b" in str(err.value)


def test_garbage_header_names_file(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b"not json at all!!!!!" + b"\0" * 8)
    with pytest.raises(HeaderError, match="not a JSON object") as err:
        build(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(MissingFileError) as err:
        build(tmp_path / "absent.safetensors")
    assert "absent.safetensors" in str(err.value)


def test_file_truncated_after_construction_fails_on_read(tmp_path):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    w = build(path)
    try:
        os.truncate(path, 100)
        with pytest.raises(CheckpointError) as err:
            w.get_tensor("model.layers.0.a")
        assert isinstance(err.value, FileChangedError | ReadError)
        assert str(path) in str(err.value)
    finally:
        w.close()


def test_unknown_name_is_runtime_error_like_tgi(tmp_path):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    w = build(path)
    try:
        with pytest.raises(RuntimeError, match=r"^weight model\.layers\.0\.c does not exist$") as err:
            w.get_tensor("model.layers.0.c")
        assert type(err.value) is RuntimeError
    finally:
        w.close()


def test_routing_to_a_file_without_the_tensor(tmp_path):
    path, other = tmp_path / "t.safetensors", tmp_path / "o.safetensors"
    write(path, SPECS, 0)
    write(other, {"spec.x": ((2,), torch.float32)}, 1)
    w = build(path)
    try:
        w.routing["spec.y"] = str(other)
        with pytest.raises(TensorNotFoundError) as err:
            w.get_tensor("spec.y")
        assert str(other) in str(err.value) and "spec.y" in str(err.value)
        w.routing["spec.z"] = str(tmp_path / "nowhere.safetensors")
        with pytest.raises(MissingFileError, match=r"nowhere\.safetensors"):
            w.get_sharded("spec.z", 0)
    finally:
        w.close()


def test_late_file_repeating_a_routed_name(tmp_path):
    path, other = tmp_path / "t.safetensors", tmp_path / "o.safetensors"
    write(path, SPECS, 0)
    write(other, {"model.layers.0.a": ((8, 8), torch.float32)}, 1)
    w = build(path)
    try:
        w.routing["model.layers.0.a"] = str(other)
        with pytest.raises(IndexMismatchError) as err:
            w.get_tensor("model.layers.0.a")
        assert str(path) in str(err.value) and str(other) in str(err.value)
    finally:
        w.close()


def test_bad_config_fails_at_construction(tmp_path, monkeypatch):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    with pytest.raises(ConfigError, match="threads"):
        FastWeights([path], "cpu", torch.float32, FakeGroup(0, 1), None, config={"threads": 0})
    with pytest.raises(ConfigError, match="backend must be 'auto' or 'host'"):
        FastWeights([path], "cpu", torch.float32, FakeGroup(0, 1), None, config={"backend": "cuda"})
    monkeypatch.setenv("FASTLOAD_THREADZ", "4")
    with pytest.raises(ConfigError, match="FASTLOAD_THREADZ"):
        FastWeights([path], "cpu", torch.float32, FakeGroup(0, 1), None)


def test_close_then_read_fails_cleanly(tmp_path):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    w = build(path)
    w.close()
    with pytest.raises(ValueError, match="is closed"):
        w.get_tensor("model.layers.0.a")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_outlives_close(tmp_path):
    path = tmp_path / "t.safetensors"
    write(path, SPECS, 0)
    before = _open_fds()
    w = build(path)
    w.get_tensor("model.layers.0.a")
    w.get_sharded("model.layers.0.b", 1)
    w.close()
    assert _open_fds() == before
    before = _open_fds()
    w = build(path)
    w._get_slice("model.layers.0.b")[1:2]
    del w  # TGI simply drops its Weights: the finalizer closes the files (no reference cycle)
    assert _open_fds() == before
