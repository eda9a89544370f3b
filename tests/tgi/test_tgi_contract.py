"""FastWeights gives TGI's results, bit for bit, for every world size 1..4 and every rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tgi_helpers import ALL_SPECS, FILE_A, FILE_B, WORLDS, FakeGroup, same, write

from tgi_patch import FastWeights

TWO_D = [n for n, (shape, _) in ALL_SPECS.items() if len(shape) == 2]
ANY_D = [n for n, (shape, _) in ALL_SPECS.items() if len(shape) >= 1]


@pytest.mark.parametrize(("world", "rank"), WORLDS)
def test_get_tensor_every_tensor(make_weights, oracle, assert_same, world, rank):
    w, o = make_weights(world, rank), oracle(world, rank)
    for name in ALL_SPECS:
        assert_same(w.get_tensor(name), o.get_tensor(name))
        assert_same(w.get_tensor(name, to_dtype=False), o.get_tensor(name, to_dtype=False))


@pytest.mark.parametrize(("world", "rank"), WORLDS)
def test_get_partial_sharded_dim0_and_dim1(make_weights, oracle, assert_same, world, rank):
    w, o = make_weights(world, rank), oracle(world, rank)
    for name in ANY_D:
        assert_same(w.get_partial_sharded(name, 0), o.get_partial_sharded(name, 0))
        assert_same(w.get_partial_sharded(name, 0, to_dtype=False), o.get_partial_sharded(name, 0, to_dtype=False))
    for name in [*TWO_D, "model.layers.1.mlp.experts"]:
        assert_same(w.get_partial_sharded(name, 1), o.get_partial_sharded(name, 1))


def test_ceil_blocks_short_and_empty_last_block(make_weights):
    # 5 rows on 4 ranks: blocks of 2 -> [0,2) [2,4) [4,5) and an empty 4th block.
    rows = [make_weights(4, r).get_partial_sharded("model.layers.0.mlp.qweight", 0).shape[0] for r in range(4)]
    assert rows == [2, 2, 1, 0]
    # 13 columns on 3 ranks: blocks of 5 -> 5, 5, 3.
    cols = [make_weights(3, r).get_partial_sharded("model.layers.0.self_attn.o_proj.weight", 1).shape[1]
            for r in range(3)]
    assert cols == [5, 5, 3]


@pytest.mark.parametrize(("world", "rank"), WORLDS)
def test_get_sharded_divisible_or_assertion(make_weights, oracle, assert_same, world, rank):
    w, o = make_weights(world, rank), oracle(world, rank)
    for name in TWO_D:
        for dim in (0, 1):
            size = ALL_SPECS[name][0][dim]
            if size % world == 0:
                assert_same(w.get_sharded(name, dim), o.get_partial_sharded(name, dim))
            else:
                with pytest.raises(AssertionError, match=f"The choosen size {size} is not compatible with "
                                                         f"sharding on {world} shards"):
                    w.get_sharded(name, dim)


@pytest.mark.parametrize(("world", "rank"), WORLDS)
@pytest.mark.parametrize(("name", "dim", "blocks"), [
    ("model.layers.0.self_attn.qkv_proj.weight", 0, [4, 1, 1]),   # fused qkv, H=32 rows, KV=8 rows
    ("model.layers.0.self_attn.qkv_proj.weight", 0, 3),
    ("model.layers.0.mlp.gate_up_proj.weight", 0, 2),
    ("model.layers.1.mlp.wide", 1, 2),                          # int64, dim 1
    ("model.layers.1.mlp.wide", 1, [1, 2]),
    ("model.layers.1.mlp.q8", 1, [1, 1]),
])
def test_get_packed_sharded(make_weights, oracle, assert_same, world, rank, name, dim, blocks):
    w, o = make_weights(world, rank), oracle(world, rank)
    total = ALL_SPECS[name][0][dim]
    sizes = [total // sum(blocks) * b for b in blocks] if isinstance(blocks, list) else [total // blocks] * blocks
    if all(s % world == 0 for s in sizes):
        assert_same(w.get_packed_sharded(name, dim, blocks), o.get_packed_sharded(name, dim, blocks))
        assert_same(w.get_packed_sharded(name, dim, blocks, to_dtype=False),
                    o.get_packed_sharded(name, dim, blocks, to_dtype=False))
    else:
        with pytest.raises(AssertionError, match=f"Prepacked tensor cannot be sharded across {world} shards"):
            w.get_packed_sharded(name, dim, blocks)


def test_packed_block_size_errors(make_weights):
    w = make_weights()
    with pytest.raises(AssertionError, match=r"Cannot split 48 in proportional blocks: \[5, 1, 1\]"):
        w.get_packed_sharded("model.layers.0.self_attn.qkv_proj.weight", 0, [5, 1, 1])
    with pytest.raises(AssertionError, match="Prepacked is not divisible by 5"):
        w.get_packed_sharded("model.layers.0.self_attn.qkv_proj.weight", 0, 5)
    with pytest.raises(NotImplementedError, match="only dim=0 or dim=1"):
        w.get_packed_sharded("model.layers.1.mlp.experts", 2, 5)


def test_cast_rules(make_weights):
    """Which dtypes each method casts, including get_partial_sharded's int64 quirk."""
    w = make_weights(2, 1, dtype=torch.float16)
    kept = {"model.layers.1.mlp.down_proj.weight": torch.float8_e4m3fn, "model.layers.0.mlp.qweight": torch.int32,
            "model.layers.1.mlp.q8": torch.int8, "model.layers.1.mlp.q16": torch.int16}
    for name, dtype in kept.items():
        assert w.get_tensor(name).dtype == dtype
        assert w.get_partial_sharded(name, 0).dtype == dtype
    assert w.get_tensor("model.layers.1.mlp.wide").dtype == torch.int64
    assert w.get_partial_sharded("model.layers.1.mlp.wide", 0).dtype == torch.float16  # TGI's quirk
    assert w.get_sharded("model.layers.1.mlp.wide", 0).dtype == torch.float16
    assert w.get_packed_sharded("model.layers.1.mlp.wide", 1, 2).dtype == torch.int64
    for name in ("model.layers.1.mlp.u8", "model.layers.1.mlp.mask", "lm_head.weight", "model.layers.1.mlp.half"):
        assert w.get_tensor(name).dtype == torch.float16
        assert w.get_tensor(name, to_dtype=False).dtype == ALL_SPECS[name][1]
    assert w.get_tensor("model.layers.1.mlp.down_proj.weight_scale", to_dtype=False).shape == ()


def test_get_tensor_shard_floor_blocks_and_always_casts(make_weights):
    var = torch.arange(7 * 5, dtype=torch.int32).reshape(7, 5)
    for world in range(1, 5):
        for rank in range(world):
            w = make_weights(world, rank)
            block = 7 // world
            assert same(w.get_tensor_shard(var, 0), var[rank * block:(rank + 1) * block].to(torch.float16))
            block = 5 // world
            assert same(w.get_tensor_shard(var, 1), var[:, rank * block:(rank + 1) * block].to(torch.float16))
    with pytest.raises(NotImplementedError):
        make_weights().get_tensor_shard(torch.zeros(2, 2, 2), 2)


def test_dims_other_than_0_and_1(make_weights):
    w = make_weights(2, 0)
    with pytest.raises(NotImplementedError, match="Let's make that generic when needed"):
        w.get_partial_sharded("model.layers.1.mlp.experts", 2)
    with pytest.raises(NotImplementedError):
        w.get_partial_sharded("model.layers.1.mlp.experts", -1)
    with pytest.raises(IndexError):  # get_shape()[1] of a 1-D tensor, as in TGI
        w.get_partial_sharded("model.norm.weight", 1)
    with pytest.raises(AssertionError):  # size 5 along dim 2 does not divide by 2: asserted before the dim check
        w.get_sharded("model.layers.1.mlp.experts", 2)


def test_names_has_tensor_shape_and_unknown(make_weights):
    w = make_weights()
    assert w.has_tensor("lm_head.weight") and not w.has_tensor("nope")
    assert w.get_shape("model.layers.1.mlp.experts") == [3, 4, 5]
    assert isinstance(w.get_shape("lm_head.weight"), list)
    assert w.get_filename("lm_head.weight") == (str(w.routing["lm_head.weight"]), "lm_head.weight")
    for call in (lambda: w.get_tensor("nope"), lambda: w.get_sharded("nope", 0), lambda: w.get_shape("nope"),
                 lambda: w.get_packed_sharded("nope", 0, 2), lambda: w._get_slice("nope")):
        with pytest.raises(RuntimeError, match="weight nope does not exist"):
            call()


def test_routing_attributes(make_weights, ckpt):
    w = make_weights(3, 2, prefix="model")
    assert set(w.routing) == set(ALL_SPECS)
    assert all(w.routing[n] == ckpt[0] for n in FILE_A) and all(w.routing[n] == ckpt[1] for n in FILE_B)
    assert (w.prefix, w.aliases, w.device, w.dtype) == ("model", {}, "cpu", torch.float16)
    assert (w.process_group.size(), w.process_group.rank()) == (3, 2)


def test_alias_and_prefix_resolution_order(make_weights, oracle, assert_same):
    """name, then aliases of name, then prefix.name, then aliases of prefix.name."""
    aliases = {"tied.weight": ["missing.weight", "model.embed_tokens.weight"],
               "norm.weight": ["lm_head.weight"],
               "model.final.weight": ["model.norm.weight"]}
    w, o = make_weights(prefix="model", aliases=aliases), oracle()
    assert w.get_filename("tied.weight")[1] == "model.embed_tokens.weight"
    assert w.get_filename("norm.weight")[1] == "lm_head.weight"        # bare name's alias beats prefix
    assert w.get_filename("layers.1.mlp.q8")[1] == "model.layers.1.mlp.q8"
    assert w.get_filename("final.weight")[1] == "model.norm.weight"     # alias of the prefixed name
    assert w.get_filename("lm_head.weight")[1] == "lm_head.weight"      # bare name first
    assert_same(w.get_tensor("tied.weight"), o.get_tensor("model.embed_tokens.weight"))
    assert_same(w.get_sharded("layers.0.mlp.gate_up_proj.weight", 0), o.get_partial_sharded(
        "model.layers.0.mlp.gate_up_proj.weight", 0))
    assert w.has_tensor("final.weight") and not w.has_tensor("missing.weight")


def test_duplicate_key_across_files_is_runtime_error(make_weights, ckpt, tmp_path):
    dup = tmp_path / "dup.safetensors"
    write(dup, {"lm_head.weight": ((2, 2), torch.float32)}, 7)
    message = f"Key lm_head.weight was found in multiple files: {dup} and {ckpt[1]}"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        make_weights(filenames=[*ckpt, dup])
    with pytest.raises(RuntimeError, match="was found in multiple files"):
        make_weights(filenames=[ckpt[0], ckpt[0]])


def test_routing_added_after_construction(make_weights, tmp_path, assert_same):
    """Medusa / MLP speculators add entries for files the constructor never saw."""
    w = make_weights(2, 1)
    spec = tmp_path / "speculator.safetensors"
    tensors = write(spec, {"speculator.emb.0.weight": ((10, 4), torch.bfloat16),
                           "speculator.head.0.weight": ((3, 8), torch.float32)}, 50)
    w.routing["speculator.emb.0.weight"] = str(spec)
    w.routing["speculator.head.0.weight"] = spec  # a Path works too
    assert w.has_tensor("speculator.emb.0.weight")
    assert_same(w.get_tensor("speculator.emb.0.weight"), tensors["speculator.emb.0.weight"].to(torch.float16))
    assert_same(w.get_sharded("speculator.emb.0.weight", 0),
                tensors["speculator.emb.0.weight"][5:10].to(torch.float16))
    assert_same(w.get_sharded("speculator.head.0.weight", 1), tensors["speculator.head.0.weight"][:, 4:8].half())
    assert w.get_shape("speculator.head.0.weight") == [3, 8]


def test_reads_only_the_bytes_of_the_shard(make_weights):
    w = make_weights(4, 1, config={"strided_min_skip": 1})
    before = w.bytes_read
    w.get_partial_sharded("model.layers.0.self_attn.qkv_proj.weight", 0)   # 12 of 48 rows of 5 f32
    assert w.bytes_read - before == 12 * 5 * 4
    before = w.bytes_read
    w.get_partial_sharded("model.layers.0.self_attn.o_proj.weight", 1)     # 4 of 13 columns, 6 rows, f32
    assert w.bytes_read - before == 6 * 4 * 4
    before = w.bytes_read
    w.get_packed_sharded("model.layers.0.self_attn.qkv_proj.weight", 0, [4, 1, 1])  # 8 + 2 + 2 rows
    assert w.bytes_read - before == 12 * 5 * 4


# -- _get_slice: the object quantised loaders index themselves ------------------------------------
SLICE_KEYS = [slice(2, 5), slice(-3, None), slice(6, 99), slice(9, 3), slice(None, None, 2), 1, -1,
              (slice(None), slice(2, 4)), (slice(None), slice(-2, None)), (slice(1, 3), slice(0, 5, 2)),
              (Ellipsis, slice(1, 2)), Ellipsis, (slice(None), 3), (2, 3)]


@pytest.mark.parametrize("key", SLICE_KEYS, ids=repr)
def test_get_slice_indexing_matches_safetensors(make_weights, oracle, assert_same, key):
    w, o = make_weights(), oracle()
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.qweight",
                 "model.layers.1.mlp.down_proj.weight"):
        assert_same(w._get_slice(name)[key], o.slice(name)[key])
    s = w._get_slice("model.layers.1.mlp.wide")
    assert s.get_shape() == [4, 12] and s.get_dtype() == "I64"
    assert w._get_slice("model.layers.1.mlp.down_proj.weight").get_dtype() == "F8_E4M3"


@pytest.mark.parametrize(("key", "error"), [
    (slice(None, None, -1), ValueError), (slice(None, None, 0), ValueError), (9, IndexError), (-9, IndexError),
    ((1, 2, 3), IndexError)], ids=repr)
def test_get_slice_index_errors_match_safetensors(make_weights, oracle, key, error):
    w, o = make_weights(), oracle()
    name = "model.layers.0.mlp.qweight"  # shape (5, 9)
    with pytest.raises(error):
        o.slice(name)[key]
    with pytest.raises(error):
        w._get_slice(name)[key]


def test_get_slice_other_index_kinds_fall_back_to_torch(make_weights, oracle, assert_same):
    w, o = make_weights(), oracle()
    name = "model.layers.0.mlp.qweight"
    assert_same(w._get_slice(name)[[0, 3]], o.slice(name)[[0, 3]])
    assert_same(w._get_slice(name)[None], o.slice(name)[None])
    for key in [(Ellipsis, Ellipsis), (Ellipsis, 1, Ellipsis), (slice(None), Ellipsis, Ellipsis, 1)]:
        assert_same(w._get_slice(name)[key], o.slice(name)[key])


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_get_slice_indexing_property(ckpt, data):
    from safetensors import safe_open

    name = data.draw(st.sampled_from(["model.layers.1.mlp.experts", "model.layers.0.mlp.gate_up_proj.weight",
                                      "model.layers.0.mlp.g_idx"]))
    shape = ALL_SPECS[name][0]
    bound = st.integers(-20, 20) | st.none()
    item = st.builds(slice, bound, bound, st.integers(1, 3) | st.none()) | st.integers(-20, 20) | st.just(Ellipsis)
    key = tuple(data.draw(st.lists(item, min_size=1, max_size=len(shape) + 1)))
    want_error = None
    try:
        want = safe_open(str(ckpt[0] if name in FILE_A else ckpt[1]), "pt").get_slice(name)[key]
    except Exception as exc:  # the error type is what we compare
        want_error = type(exc)
    w = FastWeights(ckpt, "cpu", torch.float32, FakeGroup(0, 1), None, config={"progress": False})
    try:
        if want_error is not None:
            with pytest.raises(want_error):
                w._get_slice(name)[key]
        else:
            assert same(w._get_slice(name)[key], want)
    finally:
        w.close()


def test_get_handle_is_a_safe_open_lookalike(make_weights, oracle, assert_same, ckpt):
    w, o = make_weights(), oracle()
    filename, name = w.get_filename("model.layers.1.mlp.half")
    h = w._get_handle(filename)
    assert h is w._get_handle(filename)
    assert h.keys() == sorted(FILE_B)
    assert_same(h.get_tensor(name), o.get_tensor(name, to_dtype=False))
    assert_same(h.get_slice(name)[1:3], o.slice(name)[1:3])


# -- loaders: every get_weights* goes to weights_loader with the same arguments ---------------------
class RecordingLoader:
    def __init__(self) -> None:
        self.calls = []

    def _record(self, *args):
        self.calls.append(args)
        return args

    def get_weights(self, weights, prefix):
        return self._record("get_weights", weights, prefix)

    def get_weights_col_packed(self, weights, prefix, block_sizes):
        return self._record("get_weights_col_packed", weights, prefix, block_sizes)

    def get_weights_col(self, weights, prefix):
        return self._record("get_weights_col", weights, prefix)

    def get_multi_weights_col(self, weights, prefixes, dim):
        return self._record("get_multi_weights_col", weights, prefixes, dim)

    def get_weights_row(self, weights, prefix):
        return self._record("get_weights_row", weights, prefix)


def test_get_weights_delegation(make_weights):
    loader = RecordingLoader()
    w = make_weights(loader=loader)
    assert w.get_weights("p") == ("get_weights", w, "p")
    assert w.get_weights_col("p") == ("get_weights_col", w, "p")
    assert w.get_multi_weights_col(["a", "b"], 0) == ("get_multi_weights_col", w, ["a", "b"], 0)
    assert w.get_weights_row("p") == ("get_weights_row", w, "p")
    assert w.get_weights_col_packed("p", [2, 1]) == ("get_weights_col_packed", w, "p", [2, 1])
    assert w.get_weights_col_packed_qkv("p", 32, 8) == ("get_weights_col_packed", w, "p", [32, 8, 8])
    assert w.get_weights_col_packed_gate_up("p") == ("get_weights_col_packed", w, "p", 2)
    assert len(loader.calls) == 7


class DefaultLikeLoader:
    """TGI's DefaultWeightsLoader, unquantised: what a Llama load calls."""

    def get_weights(self, weights, prefix):
        return weights.get_tensor(f"{prefix}.weight")

    def get_weights_col_packed(self, weights, prefix, block_sizes):
        return weights.get_packed_sharded(f"{prefix}.weight", dim=0, block_sizes=block_sizes)

    def get_multi_weights_col(self, weights, prefixes, dim):
        return torch.cat([weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes], dim=dim)

    def get_weights_row(self, weights, prefix):
        return weights.get_sharded(f"{prefix}.weight", dim=1)


def test_default_like_loader_end_to_end(make_weights, oracle, assert_same):
    w, o = make_weights(2, 1, loader=DefaultLikeLoader()), oracle(2, 1)
    want = torch.cat([o.get_partial_sharded(f"model.layers.{i}.self_attn.q_proj.weight", 0) for i in (0, 1)])
    assert_same(w.get_multi_weights_col(["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"], 0),
                want)
    assert_same(w.get_weights_col_packed_qkv("model.layers.0.self_attn.qkv_proj", 4, 1),
                o.get_packed_sharded("model.layers.0.self_attn.qkv_proj.weight", 0, [4, 1, 1]))
    assert_same(w.get_weights_col_packed_gate_up("model.layers.0.mlp.gate_up_proj"),
                o.get_packed_sharded("model.layers.0.mlp.gate_up_proj.weight", 0, 2))
    with pytest.raises(AssertionError):  # o_proj has 13 columns: not divisible by 2
        w.get_weights_row("model.layers.0.self_attn.o_proj")


def test_use_loader_and_loader_property(make_weights):
    first, second = RecordingLoader(), RecordingLoader()
    w = make_weights(loader=first)
    assert w.loader is first
    with w.use_loader(second):
        assert w.loader is second and w.weights_loader is second
        w.get_weights("x")
    assert w.loader is first and second.calls and not first.calls
    with pytest.raises(KeyError), w.use_loader(second):
        raise KeyError("boom")
    assert w.loader is first
    with pytest.raises(AttributeError):
        w.loader = second


def test_device_and_dtype_moves_match_tgi_order(make_weights, ckpt):
    """get_packed_sharded moves then casts; others cast then move: on CPU both land identically."""
    w = make_weights(dtype=torch.bfloat16)
    assert w.get_packed_sharded("model.layers.0.mlp.gate_up_proj.weight", 0, 2).device.type == "cpu"
    assert w.get_tensor("lm_head.weight", to_device=False).dtype == torch.bfloat16
    assert w.get_partial_sharded("model.layers.1.mlp.half", 0, to_device=False).dtype == torch.bfloat16


def test_empty_tensor(make_weights, oracle, assert_same):
    w, o = make_weights(3, 2), oracle(3, 2)
    assert_same(w.get_tensor("model.layers.1.mlp.empty"), o.get_tensor("model.layers.1.mlp.empty"))
    assert_same(w.get_partial_sharded("model.layers.1.mlp.empty", 1), o.get_partial_sharded(
        "model.layers.1.mlp.empty", 1))


def test_filenames_may_be_str_or_path(ckpt):
    w = FastWeights([str(ckpt[0]), Path(ckpt[1])], "cpu", torch.float32, FakeGroup(0, 1), None,
                    config={"progress": False})
    try:
        assert w.routing["lm_head.weight"] == Path(ckpt[1]) and w.routing["model.norm.weight"] == Path(ckpt[1])
        assert w.routing["model.embed_tokens.weight"] == str(ckpt[0])
        assert w.get_tensor("lm_head.weight").dtype == torch.float32
    finally:
        w.close()


def test_no_files_at_construction_then_routing_added(tmp_path):
    spec = tmp_path / "only.safetensors"
    tensors = write(spec, {"head.weight": ((6, 2), torch.float32)}, 9)
    w = FastWeights([], "cpu", torch.bfloat16, FakeGroup(1, 3), None, config={"progress": False})
    try:
        assert w.routing == {} and not w.has_tensor("head.weight")
        w.routing["head.weight"] = str(spec)
        assert same(w.get_sharded("head.weight", 0), tensors["head.weight"][2:4].to(torch.bfloat16))
    finally:
        w.close()
