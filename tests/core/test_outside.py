"""A checkpoint cannot make the loader read outside itself.

An index entry that leaves the checkpoint's directory (``..``, an absolute path, another store's
URI) is refused with an ``OutsideCheckpointError`` naming the index and the entry, before any file
is opened; what is opened is watched through Python's audit events (``os.open`` raises ``open``),
not assumed. A file that sits in the directory is the checkpoint's own wherever it points (the
Hugging Face cache links each snapshot file into ``../../blobs/``), and an entry is resolved
lexically, so the kernel never walks a ``..`` through a symlinked directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vllm_fastload
from vllm_fastload.errors import CheckpointError, OutsideCheckpointError

from ._util import assert_bitexact, open_ckpt, random_tensor, save

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only while a test asks


@pytest.fixture
def opened() -> list[str]:
    """The paths this process opens (``os.open``, ``open``) while the test runs."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def checkpoint(root: Path, entry_for_head: str | None = None) -> dict[str, torch.Tensor]:
    """Two shards and an index; ``entry_for_head`` replaces the index's entry for ``lm_head.weight``."""
    root.mkdir(parents=True, exist_ok=True)
    a = {"model.embed.weight": random_tensor((6, 4), torch.bfloat16, 1)}
    b = {"lm_head.weight": random_tensor((3, 4), torch.float16, 2)}
    save(root / SHARD1, a)
    save(root / SHARD2, b)
    weight_map = {"model.embed.weight": SHARD1, "lm_head.weight": SHARD2 if entry_for_head is None else entry_for_head}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {**a, **b}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid safetensors file outside the checkpoint, holding the tensor the index redirects."""
    path = tmp_path / "elsewhere" / "model.safetensors"
    path.parent.mkdir()
    save(path, {"lm_head.weight": torch.full((3, 4), 7.0, dtype=torch.float16)})
    return path


def touched(opened: list[str], target: Path) -> list[str]:
    real = os.path.realpath(target)
    return [p for p in opened if os.path.realpath(p) == real or "elsewhere" in p]


@pytest.mark.parametrize("entry", [
    "../elsewhere/model.safetensors",
    "sub/../../elsewhere/model.safetensors",
    "ABSOLUTE",
    "s3://other-bucket/model.safetensors",
    "file:///ABSOLUTE",
])
def test_an_entry_leaving_the_directory_is_refused_unopened(tmp_path: Path, outside: Path, opened: list[str],
                                                            entry: str) -> None:
    entry = entry.replace("/ABSOLUTE", str(outside)).replace("ABSOLUTE", str(outside))
    root = tmp_path / "ck"
    checkpoint(root, entry)
    with pytest.raises(OutsideCheckpointError) as info:
        vllm_fastload.open(root, config={"progress": False})
    exc = info.value
    assert isinstance(exc, CheckpointError)
    assert exc.file == str(root / "model.safetensors.index.json")
    assert exc.tensor == "lm_head.weight"
    assert repr(entry) in str(exc)
    assert touched(opened, outside) == []
    assert not any(p.endswith(".safetensors") for p in opened), opened  # refused before any shard is opened


def test_entries_are_resolved_lexically(tmp_path: Path, opened: list[str]) -> None:
    # "link/../x" through a symlinked directory would reach the link target's parent in the
    # kernel; fastload opens the checkpoint's own "x" instead.
    root = tmp_path / "ck"
    decoy_dir = tmp_path / "decoy" / "deeper"
    decoy_dir.mkdir(parents=True)
    save(tmp_path / "decoy" / SHARD2, {"lm_head.weight": torch.zeros(3, 4, dtype=torch.float16)})
    want = checkpoint(root, f"link/../{SHARD2}")
    (root / "link").symlink_to(decoy_dir)
    with open_ckpt(root) as ckpt:
        assert ckpt.info("lm_head.weight").file == str(root / SHARD2)
        for name, tensor in want.items():
            assert_bitexact(ckpt.get_tensor(name), tensor, name)
    assert touched(opened, tmp_path / "decoy" / SHARD2) == []
    # "./x" is the same file as "x".
    checkpoint(root, f"./{SHARD2}")
    with open_ckpt(root) as ckpt:
        assert ckpt.info("lm_head.weight").file == str(root / SHARD2)


def test_hugging_face_cache_symlinks_are_the_checkpoints_files(tmp_path: Path) -> None:
    """A snapshot's files are symlinks to ``../../blobs/<hash>``: they are the checkpoint's own."""
    repo = tmp_path / "models--org--name"
    staged = tmp_path / "staged"
    want = checkpoint(staged)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(staged.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    with open_ckpt(snapshot) as ckpt:
        assert sorted(ckpt.files) == [str(snapshot / SHARD1), str(snapshot / SHARD2)]
        for name, tensor in want.items():
            assert_bitexact(ckpt.get_tensor(name), tensor, name)
        assert_bitexact(ckpt.get_tensor("lm_head.weight"), load_file(snapshot / SHARD2)["lm_head.weight"])


@pytest.mark.parametrize("entry", ["", "a/..", "."])
def test_an_entry_that_names_no_file_is_refused(tmp_path: Path, entry: str) -> None:
    root = tmp_path / "ck"
    checkpoint(root, entry)
    with pytest.raises(OutsideCheckpointError) as info:
        vllm_fastload.open(root, config={"progress": False})
    assert info.value.tensor == "lm_head.weight"
