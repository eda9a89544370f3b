"""The strict safetensors parser and checkpoint discovery, with safetensors itself as the oracle."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vllm_fastload
from vllm_fastload.checkpoint import read_safetensors_file
from vllm_fastload.errors import (
    CheckpointError,
    FileChangedError,
    HeaderError,
    IndexMismatchError,
    MissingFileError,
    ReadError,
    TensorMetadataError,
    TensorNotFoundError,
    TruncatedFileError,
)
from vllm_fastload.format import MAX_HEADER_BYTES
from vllm_fastload.tools.checkpoints import write_checkpoint

from ._util import (
    ALL_DTYPES,
    SAFE_OPEN_CANNOT_LOAD,
    assert_bitexact,
    entry,
    open_ckpt,
    open_fds,
    random_tensor,
    save,
    write_raw,
)

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (3, 0), (0, 4, 5), (2, 1, 1, 3)]


def check_error(exc: BaseException, cls: type, file, tensor: str | None = None) -> None:
    """Exact class, a CheckpointError, and a message naming the file (and the tensor)."""
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    assert isinstance(exc, CheckpointError)
    assert type(exc).__module__ == "vllm_fastload.errors"
    message = str(exc)
    assert os.fspath(file) in message, message
    assert exc.file == os.fspath(file)
    if tensor is not None:
        assert repr(tensor) in message, message
        assert exc.tensor == tensor


def open_error(path, cls: type, file=None, tensor: str | None = None) -> CheckpointError:
    """Opening ``path`` (directly and through the parser) fails with ``cls`` naming file/tensor."""
    with pytest.raises(CheckpointError) as info:
        vllm_fastload.open(path, config={"progress": False})
    check_error(info.value, cls, file if file is not None else path, tensor)
    return info.value


# -- round trips -------------------------------------------------------------------------------


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for i, dtype in enumerate(ALL_DTYPES):
        for j, shape in enumerate(SHAPES):
            tensors[f"t.{str(dtype).removeprefix('torch.')}.{j}"] = random_tensor(shape, dtype, seed=100 * i + j)
    return tensors


def test_every_dtype_and_shape_round_trips(tmp_path: Path):
    tensors = all_dtype_tensors()
    metadata = {"format": "pt", "note": "ünïcode ✓"}
    path = save(tmp_path / "all.safetensors", tensors, metadata)
    with open_ckpt(path) as ckpt, safe_open(str(path), "pt") as oracle:
        assert ckpt.keys() == sorted(tensors)
        assert ckpt.metadata() == metadata == oracle.metadata()
        for name, want in tensors.items():
            info = ckpt.info(name)
            assert info.shape == tuple(want.shape)
            assert info.nbytes == want.numel() * want.element_size()
            got = ckpt.get_tensor(name)
            assert_bitexact(got, want, name)
            if want.dtype not in SAFE_OPEN_CANNOT_LOAD:
                assert_bitexact(got, oracle.get_tensor(name), name)
        seen = {}
        for key, t in ckpt.iter_tensors():
            seen[key] = t.clone()
        assert sorted(seen) == sorted(tensors)
        for name, want in tensors.items():
            assert_bitexact(seen[name], want, name)


def test_dtype_strings_match_safetensors_header(tmp_path: Path):
    tensors = {f"x{i}": random_tensor((2, 3), d, i) for i, d in enumerate(ALL_DTYPES)}
    path = save(tmp_path / "d.safetensors", tensors)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    sf = read_safetensors_file(path)
    try:
        assert sf.header.data_offset == 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            info = sf.header.tensors[name]
            assert info.dtype == e["dtype"]
            assert list(info.shape) == e["shape"]
            assert (info.start - sf.header.data_offset, info.end - sf.header.data_offset) == tuple(e["data_offsets"])
    finally:
        sf.close()


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2")
def test_f4_packed_tensor(tmp_path: Path):
    # safetensors writes float4_e2m1fn_x2 as "F4" with the logical (doubled) last dim.
    packed = torch.randint(0, 256, (3, 4), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = save(tmp_path / "f4.safetensors", {"w": packed})
    with open_ckpt(path) as ckpt:
        assert ckpt.info("w").dtype == "F4"
        assert ckpt.info("w").shape == (3, 8)
        assert_bitexact(ckpt.get_tensor("w"), packed)
        assert_bitexact(ckpt.get_slice("w", 0, 1, 2), packed[1:3])


def test_metadata_only_file_and_empty_metadata(tmp_path: Path):
    path = save(tmp_path / "m.safetensors", {}, {"k": "v"})
    with open_ckpt(path) as ckpt:
        assert ckpt.keys() == []
        assert ckpt.metadata() == {"k": "v"}
        assert list(ckpt.iter_tensors()) == []
    path2 = write_raw(tmp_path / "n.safetensors", {"__metadata__": None, "a": entry("U8", [2], 0, 2)}, b"\x01\x02")
    with open_ckpt(path2) as ckpt:
        assert ckpt.metadata() == {}
        assert ckpt.get_tensor("a").tolist() == [1, 2]


def test_hand_written_header_with_padding_is_accepted(tmp_path: Path):
    header = json.dumps({"b": entry("F32", [1], 4, 8), "a": entry("F32", [1], 0, 4)}) + "    "
    path = write_raw(tmp_path / "p.safetensors", header, struct.pack("<ff", 1.5, -2.0))
    with open_ckpt(path) as ckpt:
        assert ckpt.get_tensor("a").item() == 1.5
        assert ckpt.get_tensor("b").item() == -2.0


# -- header errors ---------------------------------------------------------------------------


def test_header_length_beyond_file(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"a": entry("U8", [1], 0, 1)}, b"\0", header_len=4000)
    open_error(path, HeaderError)


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1])
def test_absurd_header_length(tmp_path: Path, length: int):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}")
    exc = open_error(path, HeaderError)
    assert str(length) in str(exc)


def test_empty_file(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"")
    open_error(path, HeaderError)


@pytest.mark.parametrize("size", [1, 7])
def test_file_shorter_than_length_prefix(tmp_path: Path, size: int):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x02" * size)
    open_error(path, HeaderError)


@pytest.mark.parametrize("header", ['{"a": ', '{"a": {"dtype": "F32",}}', "{" + "[" * 5000 + "]" * 5000 + "}",
                                    '{"a": 1, "a": 2}'])
def test_invalid_json(tmp_path: Path, header: str):
    path = write_raw(tmp_path / "x.safetensors", header)
    open_error(path, HeaderError)


def test_invalid_utf8(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", b'{"\xff\xfe": {}}')
    exc = open_error(path, HeaderError)
    assert "UTF-8" in str(exc)


@pytest.mark.parametrize("header", ["[]", "[1, 2]", '"text"', "42", "null", "   "])
def test_header_not_an_object(tmp_path: Path, header: str):
    path = write_raw(tmp_path / "x.safetensors", header)
    open_error(path, HeaderError)


@pytest.mark.parametrize("metadata", [[1], {"k": 1}, "text"])
def test_bad_metadata(tmp_path: Path, metadata):
    path = write_raw(tmp_path / "x.safetensors", {"__metadata__": metadata})
    open_error(path, HeaderError)


@pytest.mark.parametrize("bad_entry", [
    "not an object",
    {"dtype": "F32", "shape": [1]},                                  # no data_offsets
    {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]},
    {"dtype": 7, "shape": [1], "data_offsets": [0, 4]},
])
def test_malformed_entry_names_tensor(tmp_path: Path, bad_entry):
    path = write_raw(tmp_path / "x.safetensors", {"weird.tensor": bad_entry}, b"\0" * 4)
    open_error(path, TensorMetadataError, tensor="weird.tensor")


def test_unknown_dtype(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"w": entry("F128", [1], 0, 16)}, b"\0" * 16)
    exc = open_error(path, TensorMetadataError, tensor="w")
    assert "F128" in str(exc)


def test_shape_and_size_mismatch(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"w": entry("F32", [2, 2], 0, 12)}, b"\0" * 12)
    exc = open_error(path, TensorMetadataError, tensor="w")
    assert "16" in str(exc) and "12" in str(exc)


@pytest.mark.parametrize("offsets", [(-4, 4), (8, 4), (-8, -4)])
def test_negative_or_reversed_offsets(tmp_path: Path, offsets):
    path = write_raw(tmp_path / "x.safetensors", {"w": entry("F32", [1], *offsets)}, b"\0" * 8)
    open_error(path, TensorMetadataError, tensor="w")


def test_overlapping_offsets(tmp_path: Path):
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0" * 12)
    exc = open_error(path, TensorMetadataError, tensor="b")
    assert "'a'" in str(exc)


def test_gap_between_tensors(tmp_path: Path):
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0" * 20)
    exc = open_error(path, TensorMetadataError, tensor="b")
    assert "gap" in str(exc)


def test_gap_before_first_tensor(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"a": entry("F32", [1], 4, 8)}, b"\0" * 8)
    open_error(path, TensorMetadataError, tensor="a")


def test_trailing_bytes(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"a": entry("F32", [2], 0, 8)}, b"\0" * 9)
    exc = open_error(path, HeaderError)
    assert "9" in str(exc) and "8" in str(exc)


def test_truncated_body(tmp_path: Path):
    good = save(tmp_path / "good.safetensors", {"a": torch.ones(4), "b": torch.ones(100)})
    data = good.read_bytes()
    path = tmp_path / "x.safetensors"
    path.write_bytes(data[:-10])
    exc = open_error(path, TruncatedFileError)
    # The tensor that reaches past the end is named ("b" is written after "a": same dtype, by name).
    assert exc.tensor == "b" and "'b'" in str(exc)


def test_tensor_not_found_names_checkpoint_and_tensor(tmp_path: Path):
    path = save(tmp_path / "x.safetensors", {"a": torch.ones(1)})
    with open_ckpt(path) as ckpt:
        for call in (lambda: ckpt.get_tensor("nope"), lambda: ckpt.get_slice("nope", 0, 0, 1),
                     lambda: list(ckpt.iter_tensors(["nope"])), lambda: ckpt.info("nope"),
                     lambda: ckpt.read_into({"nope": torch.empty(1)})):
            with pytest.raises(TensorNotFoundError) as info:
                call()
            check_error(info.value, TensorNotFoundError, path, "nope")
            assert isinstance(info.value, KeyError)  # safetensors raises a KeyError-like error too
            assert not str(info.value).startswith('"')  # not KeyError's quoted repr


# -- multi-file checkpoints and discovery ---------------------------------------------------


def two_shards(root: Path, *, index: bool | dict = True) -> dict[str, torch.Tensor]:
    root.mkdir(exist_ok=True)
    a = {"model.layers.0.w": random_tensor((4, 4), torch.float16, 1), "model.embed.weight": torch.arange(6.0)}
    b = {"model.layers.1.w": random_tensor((2, 8), torch.bfloat16, 2), "lm_head.weight": torch.ones(3, 2)}
    save(root / "model-00001-of-00002.safetensors", a)
    save(root / "model-00002-of-00002.safetensors", b)
    if index:
        weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
        weight_map.update({k: "model-00002-of-00002.safetensors" for k in b})
        if isinstance(index, dict):
            weight_map.update(index)
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {**a, **b}


@pytest.mark.parametrize("index", [True, False])
def test_directory_discovery(tmp_path: Path, index: bool):
    tensors = two_shards(tmp_path / "ck", index=index)
    with open_ckpt(tmp_path / "ck") as ckpt:
        assert ckpt.keys() == sorted(tensors)
        assert len(ckpt.files) == 2
        for name, want in tensors.items():
            assert_bitexact(ckpt.get_tensor(name), want, name)


def test_single_file_and_named_index(tmp_path: Path):
    tensors = two_shards(tmp_path / "ck", index=False)
    single = tmp_path / "ck" / "model-00002-of-00002.safetensors"
    with open_ckpt(single) as ckpt:
        assert ckpt.keys() == ["lm_head.weight", "model.layers.1.w"]
    # A lone index under another name is used too (e.g. diffusers' *.safetensors.index.json).
    weight_map = {"model.layers.1.w": "model-00002-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "ck" / "unet.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_ckpt(tmp_path / "ck") as ckpt:
        assert ckpt.keys() == sorted(weight_map)
        assert_bitexact(ckpt.get_tensor("lm_head.weight"), tensors["lm_head.weight"])


def test_write_checkpoint_with_and_without_index(tmp_path: Path):
    with_index = write_checkpoint(tmp_path / "a", "tiny-llama", files=3)
    without = write_checkpoint(tmp_path / "b", "tiny-llama", files=3, index=False)
    weight_map = json.loads((with_index / "model.safetensors.index.json").read_text())["weight_map"]
    with open_ckpt(with_index) as a, open_ckpt(without) as b:
        assert a.keys() == b.keys() == sorted(weight_map)
        assert len(a.files) == 3
        for name, file in weight_map.items():
            assert Path(a.info(name).file).name == file
        name = "model.layers.1.mlp.down_proj.weight"
        assert_bitexact(a.get_tensor(name), b.get_tensor(name))


def test_missing_path(tmp_path: Path):
    open_error(tmp_path / "nowhere", MissingFileError)


def test_directory_without_safetensors(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    open_error(tmp_path / "empty", MissingFileError)


def test_index_names_missing_file(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root, index={"extra.weight": "model-00003-of-00003.safetensors"})
    open_error(root, MissingFileError, file=root / "model-00003-of-00003.safetensors", tensor="extra.weight")


def test_index_maps_tensor_to_file_without_it(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root, index={"ghost.weight": "model-00001-of-00002.safetensors"})
    open_error(root, IndexMismatchError, file=root / "model-00001-of-00002.safetensors", tensor="ghost.weight")


def test_index_maps_tensor_to_the_wrong_file(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root, index={"lm_head.weight": "model-00001-of-00002.safetensors"})
    exc = open_error(root, IndexMismatchError, file=root / "model-00002-of-00002.safetensors",
                     tensor="lm_head.weight")
    assert "model-00001-of-00002.safetensors" in str(exc)


@pytest.mark.parametrize("index", [True, False])
def test_same_tensor_in_two_files(tmp_path: Path, index: bool):
    root = tmp_path / "ck"
    two_shards(root, index=index)
    # Shard 2 also holds shard 1's tensor.
    save(root / "model-00002-of-00002.safetensors",
         {"model.layers.1.w": torch.ones(2), "model.embed.weight": torch.ones(6)})
    if index:
        weight_map = {"model.layers.0.w": "model-00001-of-00002.safetensors",
                      "model.embed.weight": "model-00001-of-00002.safetensors",
                      "model.layers.1.w": "model-00002-of-00002.safetensors"}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    exc = open_error(root, IndexMismatchError, file=root / "model-00002-of-00002.safetensors",
                     tensor="model.embed.weight")
    assert str(root / "model-00001-of-00002.safetensors") in str(exc)


@pytest.mark.parametrize("content", ["not json", '{"weight_map": 3}', '{"weight_map": {"a": 1}}', "[]"])
def test_bad_index_file(tmp_path: Path, content: str):
    root = tmp_path / "ck"
    two_shards(root, index=False)
    (root / "model.safetensors.index.json").write_text(content)
    open_error(root, HeaderError, file=root / "model.safetensors.index.json")


def test_unreadable_shard_directory_in_place_of_file(tmp_path: Path):
    # The tests run as root, so chmod 000 cannot make a file unreadable here; a directory
    # where a shard should be (and a dangling symlink, below) are what we can reproduce.
    root = tmp_path / "ck"
    two_shards(root, index=False)
    bogus = root / "model-00003-of-00003.safetensors"
    bogus.mkdir()
    open_error(root, MissingFileError, file=bogus)
    with pytest.raises(MissingFileError) as info:
        read_safetensors_file(bogus)
    check_error(info.value, MissingFileError, bogus)


def test_unreadable_shard_dangling_symlink(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root, index=False)
    link = root / "model-00003-of-00003.safetensors"
    link.symlink_to(tmp_path / "gone.safetensors")
    open_error(root, MissingFileError, file=link)


def test_index_entry_that_is_a_directory(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root, index={"x": "subdir.safetensors"})
    (root / "subdir.safetensors").mkdir()
    open_error(root, MissingFileError, file=root / "subdir.safetensors", tensor="x")


@pytest.mark.parametrize("index", [True, False])
def test_failed_open_leaks_no_descriptors(tmp_path: Path, index: bool):
    root = tmp_path / "ck"
    two_shards(root, index={"ghost": "model-00001-of-00002.safetensors"} if index else False)
    if not index:
        save(root / "model-00003-of-00003.safetensors", {"lm_head.weight": torch.ones(1)})
    before = open_fds()
    for _ in range(5):
        with pytest.raises(IndexMismatchError):
            vllm_fastload.open(root, config={"progress": False})
    assert open_fds() == before


def test_close_releases_descriptors(tmp_path: Path):
    root = tmp_path / "ck"
    two_shards(root)
    before = open_fds()
    ckpt = open_ckpt(root, {"threads": 2})
    assert open_fds() == before + 2
    ckpt.get_tensor("lm_head.weight")
    ckpt.close()
    assert open_fds() == before


# -- files that change under us --------------------------------------------------------------


def many_tensors_file(path: Path, n: int = 16) -> dict[str, torch.Tensor]:
    tensors = {f"model.layers.{i}.w": random_tensor((32, 32), torch.float32, i) for i in range(n)}
    save(path, tensors)
    return tensors


SMALL = {"read_size": 4096, "aggregate_size": 4096, "memory_budget": 1 << 20, "threads": 2}


def test_append_after_open_is_detected(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    many_tensors_file(path)
    with open_ckpt(path, SMALL) as ckpt:
        with path.open("ab") as f:
            f.write(b"\0" * 16)
        with pytest.raises(FileChangedError) as info:
            list(ckpt.iter_tensors())
        check_error(info.value, FileChangedError, path)
        with pytest.raises(FileChangedError):
            ckpt.get_tensor("model.layers.0.w")


def test_mtime_change_after_open_is_detected(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    many_tensors_file(path)
    with open_ckpt(path, SMALL) as ckpt:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        with pytest.raises(FileChangedError) as info:
            ckpt.get_tensor("model.layers.3.w")
        check_error(info.value, FileChangedError, path)
        assert "mtime" in str(info.value)


def test_change_during_iteration_is_detected(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    tensors = many_tensors_file(path, n=24)
    with open_ckpt(path, SMALL) as ckpt:
        it = ckpt.iter_tensors()
        key, first = next(it)
        assert_bitexact(first, tensors[key])
        consumed = 1
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(FileChangedError) as info:
            for _ in it:
                consumed += 1
        check_error(info.value, FileChangedError, path)
        assert consumed < len(tensors)


def test_check_file_changes_can_be_disabled(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    tensors = many_tensors_file(path)
    with open_ckpt(path, dict(SMALL, check_file_changes=False)) as ckpt:
        with path.open("ab") as f:
            f.write(b"\0" * 16)
        got = {k: t.clone() for k, t in ckpt.iter_tensors()}
    for name, want in tensors.items():
        assert_bitexact(got[name], want, name)


@pytest.mark.parametrize("check", [True, False])
def test_truncation_after_open(tmp_path: Path, check: bool):
    path = tmp_path / "m.safetensors"
    many_tensors_file(path)
    with open_ckpt(path, dict(SMALL, check_file_changes=check)) as ckpt:
        last = max(ckpt.keys(), key=lambda k: ckpt.info(k).start)
        cut = ckpt.info(last).start + 1000  # inside the last tensor
        os.truncate(path, cut)
        with pytest.raises((ReadError, FileChangedError)) as info:
            ckpt.get_tensor(last)
        # get_tensor reads straight into its result: the short read itself is reported.
        check_error(info.value, ReadError, path)
        assert "offset" in str(info.value) and str(cut) in str(info.value)
        with pytest.raises((ReadError, FileChangedError)) as info:
            list(ckpt.iter_tensors())
        check_error(info.value, type(info.value), path)
        if isinstance(info.value, ReadError):
            assert "offset" in str(info.value)


def test_adding_a_file_after_open(tmp_path: Path):
    """TGI adds files (speculator heads) to an open checkpoint's routing table."""
    root = tmp_path / "ck"
    tensors = two_shards(root)
    extra = save(tmp_path / "medusa.safetensors", {"medusa.0.weight": torch.arange(4.0)})
    clash = save(tmp_path / "clash.safetensors", {"lm_head.weight": torch.zeros(3, 2)})
    with open_ckpt(root) as ckpt:
        sf = ckpt.add_file(extra)
        assert ckpt.add_file(str(extra)) is sf
        assert_bitexact(ckpt.get_tensor("medusa.0.weight"), torch.arange(4.0))
        before = open_fds()
        with pytest.raises(IndexMismatchError) as info:
            ckpt.add_file(clash)
        check_error(info.value, IndexMismatchError, clash, "lm_head.weight")
        assert open_fds() == before
        assert_bitexact(ckpt.get_tensor("lm_head.weight"), tensors["lm_head.weight"])
