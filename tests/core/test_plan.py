"""The plan: byte ranges per request, the strided/enclosing cost rule, coalescing, layer order."""

from __future__ import annotations

import itertools
import random
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_fastload
from vllm_fastload import TensorRequest, policy
from vllm_fastload.layers import EMBEDDINGS, FINAL, LAYER, LayerKey, layer_key
from vllm_fastload.plan import BUFFER_ALIGN, Plan, Rows
from vllm_fastload.tools.checkpoints import PRESETS, tensor_shapes, write_checkpoint

from ._util import assert_bitexact, open_ckpt, random_tensor, save


@pytest.fixture
def one_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "model.layers.0.a": random_tensor((8, 16), torch.float32, 1),     # rows of 64 bytes
        "model.layers.0.b": random_tensor((8, 16), torch.float32, 2),
        "model.layers.0.c": random_tensor((4, 6, 10), torch.bfloat16, 3),
        "model.layers.0.d": random_tensor((1, 16), torch.float32, 4),
    }
    save(tmp_path / "m.safetensors", tensors)
    return tmp_path, tensors


def planned(ckpt, req: TensorRequest, **config):
    return ckpt.plan([req]).tensors[0]


def test_dim0_slice_is_one_contiguous_range(one_file):
    root, _ = one_file
    with open_ckpt(root) as ckpt:
        info = ckpt.info("model.layers.0.a")
        t = planned(ckpt, TensorRequest("model.layers.0.a", 0, 2, 5))
        assert t.strategy == "contiguous"
        assert t.ranges == ((info.start + 2 * 64, 5 * 64),)
        assert t.shape == (5, 16) and t.needed_bytes == t.read_bytes == 320
        whole = planned(ckpt, TensorRequest("model.layers.0.a"))
        assert whole.strategy == "whole" and whole.ranges == ((info.start, info.nbytes),)
        # A later dim whose outer dims are all 1, or a full-size slice, is contiguous too.
        d = ckpt.info("model.layers.0.d")
        assert planned(ckpt, TensorRequest("model.layers.0.d", 1, 3, 4)).ranges == ((d.start + 12, 16),)
        assert planned(ckpt, TensorRequest("model.layers.0.a", 1, 0, 16)).ranges == ((info.start, info.nbytes),)
        assert planned(ckpt, TensorRequest("model.layers.0.a", 0, 3, 0)).ranges == ()


@pytest.mark.parametrize(("skip", "strategy"), [(0, "strided"), (31, "strided"), (32, "strided"),
                                                (33, "enclosing"), (1 << 40, "enclosing")])
def test_dim1_slice_follows_the_cost_rule(one_file, skip: int, strategy: str):
    # Shape (8, 16) f32: a row is 64 bytes; [4, 12) along dim 1 needs 32 and skips 32 per row.
    root, tensors = one_file
    info_name = "model.layers.0.a"
    with open_ckpt(root, {"strided_min_skip": skip}) as ckpt:
        info = ckpt.info(info_name)
        req = TensorRequest(info_name, 1, 4, 8)
        t = planned(ckpt, req)
        assert t.strategy == strategy
        assert t.needed_bytes == 8 * 32
        if strategy == "strided":
            assert t.ranges == [(info.start + 16 + i * 64, 32) for i in range(8)]
            assert t.read_bytes == t.needed_bytes
        else:
            assert t.ranges == ((info.start + 16, 7 * 64 + 32),)
            assert t.view_strides == (16, 1)
        stream = ckpt.iter_tensors([req])
        ((_, view),) = [(k, v.clone()) for k, v in stream]
        assert_bitexact(view, tensors[info_name][:, 4:12])
        assert stream.stats.bytes_read == t.read_bytes


@given(offset=st.integers(0, 1 << 40), seg=st.integers(1, 1 << 20), gap=st.integers(0, 1 << 20),
       count=st.integers(0, 50), index=st.integers(-60, 60), start=st.integers(-60, 60),
       stop=st.integers(-60, 60), step=st.sampled_from([1, 2, 3, -1]))
@settings(max_examples=200, deadline=None)
def test_row_ranges_are_the_list_they_stand_for(offset, seg, gap, count, index, start, stop, step):
    """A plan keeps a slice's segments as a lazy sequence: it must behave as the list it replaces."""
    rows = Rows(offset, seg, seg + gap, count)
    lazy, listed = rows.ranges(), [(offset + i * (seg + gap), seg) for i in range(count)]
    assert len(lazy) == len(listed) and list(lazy) == listed and bool(lazy) == bool(listed)
    assert lazy == listed and listed == lazy
    assert lazy[start:stop:step] == listed[start:stop:step]
    if -count <= index < count:
        assert lazy[index] == listed[index]
    else:
        with pytest.raises(IndexError):
            lazy[index]
    assert lazy != [*listed, (0, 1)] and lazy != "not ranges"
    with pytest.raises(TypeError):
        lazy[1.0]


def test_default_cost_rule_comes_from_the_backend(one_file):
    root, _ = one_file
    with open_ckpt(root) as ckpt:
        # The host reader moves a slice's rows without landing its gaps where the caller sees
        # them (see host.read_rows), so its plans are exact: never the enclosing rows.
        assert ckpt.strided_min_skip == policy.reader_strided_min_skip(ckpt.reader.name) == 0
        assert planned(ckpt, TensorRequest("model.layers.0.a", 1, 4, 8)).strategy == "strided"
    with open_ckpt(root, {"strided_min_skip": "1KiB"}) as ckpt:
        assert ckpt.strided_min_skip == 1024


def test_3d_middle_dim_slice(one_file):
    root, tensors = one_file
    name = "model.layers.0.c"   # (4, 6, 10) bf16: inner row 20 bytes, dim-1 row 120 bytes
    with open_ckpt(root, {"strided_min_skip": 0}) as ckpt:
        info = ckpt.info(name)
        t = planned(ckpt, TensorRequest(name, 1, 2, 3))
        assert t.strategy == "strided"
        assert t.ranges == [(info.start + i * 120 + 40, 60) for i in range(4)]
        assert_bitexact(ckpt.get_slice(name, 1, 2, 3), tensors[name][:, 2:5])
        t = planned(ckpt, TensorRequest(name, 2, 9, 1))
        assert t.ranges == [(info.start + i * 20 + 18, 2) for i in range(24)]


def test_adjacent_tensors_coalesce_into_one_read(one_file):
    root, tensors = one_file
    names = ["model.layers.0.a", "model.layers.0.b", "model.layers.0.c", "model.layers.0.d"]
    with open_ckpt(root) as ckpt:
        plan = ckpt.plan(names)
        assert len(plan.chunks) == 1
        (chunk,) = plan.chunks
        assert len(chunk.ops) == 1
        first = min(ckpt.info(n).start for n in names)
        last = max(ckpt.info(n).end for n in names)
        assert (chunk.ops[0].file_offset, chunk.ops[0].length) == (first, last - first)
        # Tail rows of one tensor + head rows of the next are contiguous in the file: one read too.
        order = sorted(["model.layers.0.a", "model.layers.0.b"], key=lambda n: ckpt.info(n).start)
        plan = ckpt.plan([TensorRequest(order[0], 0, 5, 3), TensorRequest(order[1], 0, 0, 2)])
        (chunk,) = plan.chunks
        assert len(chunk.ops) == 1 and chunk.ops[0].length == 5 * 64
        got = {k: v.clone() for k, v in ckpt.iter_tensors(
            [TensorRequest(order[0], 0, 5, 3), TensorRequest(order[1], 0, 0, 2)])}
        assert_bitexact(got[order[0]], tensors[order[0]][5:])
        assert_bitexact(got[order[1]], tensors[order[1]][:2])


def test_files_and_groups_never_share_a_chunk(tmp_path: Path):
    save(tmp_path / "a.safetensors", {"model.layers.0.x": torch.ones(4), "model.layers.1.x": torch.ones(4)})
    save(tmp_path / "b.safetensors", {"model.layers.0.y": torch.ones(4)})
    with open_ckpt(tmp_path) as ckpt:
        plan = ckpt.plan()
        assert [g.key.layer for g in plan.groups] == [0, 1]
        assert [len(g.chunks) for g in plan.groups] == [2, 1]
        for g in plan.groups:
            for c in g.chunks:
                assert {ct.tensor.info.file for ct in c.tensors} == {c.file}


def test_padding_counts_towards_the_aggregate_size(tmp_path: Path):
    # Five dim-0 slices of 800 bytes, none contiguous with the next: the buffer needs
    # alignment padding between them, and with it they no longer fit in one 4 KiB chunk.
    tensors = {f"model.layers.0.t{i}": random_tensor((11, 20), torch.float32, i) for i in range(5)}
    save(tmp_path / "m.safetensors", tensors)
    reqs = [TensorRequest(n, 0, 0, 10) for n in tensors]
    with open_ckpt(tmp_path, {"read_size": 4096, "aggregate_size": 4096, "memory_budget": 8192}) as ckpt:
        plan = ckpt.plan(reqs)
        assert sum(t.read_bytes for t in plan.tensors) == 4000
        assert all(c.nbytes <= 4096 for c in plan.chunks)
        assert len(plan.chunks) == 2
        got = {k: v.clone() for k, v in ckpt.iter_tensors(reqs)}
        for n in tensors:
            assert_bitexact(got[n], tensors[n][:10])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), aggregate=st.sampled_from([4096, 5000, 8192, 1 << 20]), skip=st.sampled_from([0, 100, 1 << 40]))
def test_chunk_invariants(data, aggregate: int, skip: int):
    """Every chunk: within aggregate_size unless it holds one tensor; reads map file bytes to the
    buffer positions the tensors are viewed at; positions aligned to the dtype."""
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64]
    n = data.draw(st.integers(1, 12))
    tensors = {}
    for i in range(n):
        shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        tensors[f"model.layers.{data.draw(st.integers(0, 2))}.t{i}"] = random_tensor(
            shape, data.draw(st.sampled_from(dtypes)), i)
    reqs = []
    for name, t in tensors.items():
        if data.draw(st.booleans()):
            reqs.append(TensorRequest(name))
        else:
            dim = data.draw(st.integers(0, t.dim() - 1))
            start = data.draw(st.integers(0, t.shape[dim] - 1))
            length = data.draw(st.integers(0, t.shape[dim] - start))
            reqs.append(TensorRequest(name, dim, start, length))
    with tempfile.TemporaryDirectory() as tmp:
        save(Path(tmp) / "m.safetensors", tensors)
        config = {"read_size": 4096, "aggregate_size": aggregate, "memory_budget": 2 * aggregate,
                  "strided_min_skip": skip}
        with open_ckpt(tmp, config) as ckpt:
            plan = ckpt.plan(reqs)
            check_chunks(plan, aggregate)
            stream = ckpt.iter_tensors(reqs)
            got = {k: v.clone() for k, v in stream}
            assert stream.stats.bytes_read == plan.read_bytes
            assert stream.stats.chunks == len(plan.chunks)
    for r in reqs:
        want = tensors[r.name] if r.dim is None else tensors[r.name].narrow(r.dim, r.start, r.length)
        assert_bitexact(got[r.name], want, r.name)


def check_chunks(plan: Plan, aggregate: int) -> None:
    for chunk in plan.chunks:
        if len(chunk.tensors) > 1:
            assert chunk.nbytes <= aggregate, (chunk.nbytes, aggregate)
        # buffer intervals of the read ops do not overlap and stay inside the buffer
        spans = sorted((op.buf_offset, op.buf_offset + op.length) for op in chunk.ops)
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert end <= begin
        assert all(end <= chunk.nbytes for _, end in spans)
        for t, pos in ((ct.tensor, ct.buf_offset) for ct in chunk.tensors):
            itemsize = max(1, t.info.bits // 8)
            assert pos % itemsize == 0
            assert pos + t.read_bytes <= chunk.nbytes
            cursor = pos
            if t.rows is not None and not t.rows.gaps:
                # a slice read row by row: one op carries all its rows, packed at the tensor's position
                assert any(op.rows == t.rows and op.buf_offset == pos and op.length == t.read_bytes
                           for op in chunk.ops)
                continue
            for offset, length in t.ranges:
                # some op copies exactly these file bytes to exactly this buffer position
                assert any(op.file_offset <= offset and offset + length <= op.file_offset + op.length
                           and op.buf_offset + (offset - op.file_offset) == cursor for op in chunk.ops)
                cursor += length
            if t.ranges and pos % BUFFER_ALIGN:
                # unaligned only when it continues the previous read in the file
                assert any(op.file_offset < t.ranges[0][0] < op.file_offset + op.length for op in chunk.ops)


# -- layer grouping ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "key"), [
    ("model.embed_tokens.weight", LayerKey(EMBEDDINGS)),
    ("transformer.wte.weight", LayerKey(EMBEDDINGS)),
    ("transformer.wpe.weight", LayerKey(EMBEDDINGS)),
    ("bert.embeddings.word_embeddings.weight", LayerKey(EMBEDDINGS)),
    ("model.layers.0.self_attn.q_proj.weight", LayerKey(LAYER, 0)),
    ("model.layers.10.mlp.down_proj.weight", LayerKey(LAYER, 10)),
    ("transformer.h.7.attn.c_attn.weight", LayerKey(LAYER, 7)),
    ("h.3.ln_1.weight", LayerKey(LAYER, 3)),
    ("blocks.12.attn.qkv.weight", LayerKey(LAYER, 12)),
    ("encoder.layer.5.attention.self.query.weight", LayerKey(LAYER, 5)),
    ("model.layers.3.mlp.experts.7.w1", LayerKey(LAYER, 3)),
    ("model.layers.3.block_sparse_moe.experts.11.w2.weight", LayerKey(LAYER, 3)),
    ("model.norm.weight", LayerKey(FINAL)),
    ("transformer.ln_f.weight", LayerKey(FINAL)),
    ("lm_head.weight", LayerKey(FINAL)),
    ("encoder.layer_norm.weight", LayerKey(FINAL)),
])
def test_layer_key(name: str, key: LayerKey):
    assert layer_key(name) == key
    assert key.layer == (key.index if key.stage == LAYER else None)


@pytest.mark.parametrize("style", ["model.layers.{}", "transformer.h.{}", "blocks.{}", "encoder.layer.{}"])
def test_layer_groups_come_in_forward_order(tmp_path: Path, style: str):
    n = 12
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for i in range(n):
        names += [f"{style.format(i)}.attn.weight", f"{style.format(i)}.mlp.weight"]
    names.append(f"{style.format(3)}.mlp.experts.7.w1")
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    save(tmp_path / "m.safetensors", {name: torch.full((2,), float(i)) for i, name in enumerate(shuffled)})
    with open_ckpt(tmp_path) as ckpt:
        plan = ckpt.plan()
        assert [g.key.name for g in plan.groups] == ["embeddings", *[f"layer {i}" for i in range(n)], "final"]
        assert [g.key.layer for g in plan.groups] == [None, *range(n), None]
        assert {t.key for t in plan.groups[-1].tensors} == {"lm_head.weight", "model.norm.weight"}
        assert {t.key for t in plan.groups[4].tensors} == {f"{style.format(3)}.attn.weight",
                                                           f"{style.format(3)}.mlp.weight",
                                                           f"{style.format(3)}.mlp.experts.7.w1"}
        order = [k for k, _ in ckpt.iter_tensors()]
        stage = [layer_key(k) for k in order]
        assert stage == sorted(stage)
        # "layers.10" after "layers.9", not after "layers.1"
        assert order.index(f"{style.format(10)}.attn.weight") > order.index(f"{style.format(9)}.mlp.weight")



def test_a_request_is_read_with_the_layer_group_it_names(tmp_path: Path):
    """``TensorRequest.layer`` moves a read to another group (the exchange reads the head's
    replica blocks with the embeddings); the others keep their name's group."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.attn.weight"]
    save(tmp_path / "m.safetensors", {name: torch.full((4, 2), float(i)) for i, name in enumerate(names)})
    with open_ckpt(tmp_path) as ckpt:
        plan = ckpt.plan([TensorRequest("lm_head.weight", dim=0, start=1, length=2, layer=LayerKey(EMBEDDINGS)),
                          "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.attn.weight"])
        assert [(g.key, sorted(t.key for t in g.tensors)) for g in plan.groups] == [
            (LayerKey(EMBEDDINGS), ["lm_head.weight", "model.embed_tokens.weight"]),
            (LayerKey(LAYER, 0), ["model.layers.0.attn.weight"]),
            (LayerKey(FINAL), ["model.norm.weight"])]
        got = dict(ckpt.iter_tensors([TensorRequest("lm_head.weight", dim=0, start=1, length=2,
                                                    layer=LayerKey(EMBEDDINGS))]))
        assert torch.equal(got["lm_head.weight"], torch.full((2, 2), 1.0))

# -- summary and per-rank reads ------------------------------------------------------------------------


def tp_rank_requests(spec_name: str, rank: int, tp: int) -> list[TensorRequest]:
    """What a tensor-parallel rank of a Llama needs: column-parallel rows, row-parallel columns,
    vocab-parallel embedding rows, replicated norms."""
    reqs = []
    for name, shape in tensor_shapes(PRESETS[spec_name]):
        if len(shape) == 1:
            reqs.append(TensorRequest(name))
            continue
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        size = -(-shape[dim] // tp)
        start = min(rank * size, shape[dim])
        reqs.append(TensorRequest(name, dim, start, min(size, shape[dim] - start)))
    return reqs


@pytest.mark.parametrize("skip", [0, 128])
def test_tp2_rank1_reads_about_half(tmp_path: Path, skip: int):
    root = write_checkpoint(tmp_path / "ck", "tiny-llama")
    reqs = tp_rank_requests("tiny-llama", rank=1, tp=2)
    with open_ckpt(root, {"strided_min_skip": skip}) as ckpt:
        plan = ckpt.plan(reqs)
        total = sum(ckpt.info(n).nbytes for n in ckpt.keys())
        assert plan.checkpoint_bytes == total
        assert plan.read_bytes <= 0.6 * total
        assert plan.needed_bytes <= plan.read_bytes
        stream = ckpt.iter_tensors(reqs)
        got = {k: v.clone() for k, v in stream}
        assert stream.stats.bytes_read == plan.read_bytes
        full = {n: ckpt.get_tensor(n) for n in ckpt.keys()}
    for r in reqs:
        want = full[r.name] if r.dim is None else full[r.name].narrow(r.dim, r.start, r.length)
        assert_bitexact(got[r.name], want, r.name)


def test_tp2_rank1_with_the_default_cost_rule(tmp_path: Path):
    # With the host default, the row-parallel weights' column slices (o_proj and down_proj, 2
    # layers) are read row by row: the rank reads exactly the half it needs.
    root = write_checkpoint(tmp_path / "ck", "tiny-llama")
    with open_ckpt(root) as ckpt:
        plan = ckpt.plan(tp_rank_requests("tiny-llama", rank=1, tp=2))
        assert plan.needed_bytes <= 0.55 * plan.checkpoint_bytes
        assert plan.read_bytes == plan.needed_bytes
        assert plan.strategy_counts().get("strided") == 4
    with open_ckpt(root, {"strided_min_skip": "4KiB"}) as ckpt:  # rows of 256-512 bytes read through
        plan = ckpt.plan(tp_rank_requests("tiny-llama", rank=1, tp=2))
        assert plan.read_bytes <= 0.65 * plan.checkpoint_bytes
        assert plan.strategy_counts().get("enclosing") == 4


def test_summary_mentions_totals_and_amplification(tmp_path: Path):
    root = write_checkpoint(tmp_path / "ck", "tiny-llama")
    with open_ckpt(root, {"strided_min_skip": 1 << 40}) as ckpt:
        plan = ckpt.plan(tp_rank_requests("tiny-llama", rank=1, tp=2))
        text = plan.summary()
    for file in {Path(t.info.file).name for t in plan.tensors}:
        assert file in text
    assert "embeddings" in text and "layer 0" in text and "layer 1" in text and "final" in text
    assert f"tensors: {len(plan.tensors)}" in text
    assert "enclosing" in text and "contiguous" in text
    amp = float(re.search(r"read amplification \(read / needed\): ([0-9.]+)", text).group(1))
    assert amp == pytest.approx(plan.read_bytes / plan.needed_bytes, abs=1e-3)
    assert amp > 1.0
    frac = float(re.search(r"\(([0-9.]+) of checkpoint\)", text).group(1))
    assert frac == pytest.approx(plan.read_bytes / plan.checkpoint_bytes, abs=1e-3)
    assert f"{plan.checkpoint_bytes / 1e6:,.1f} MB" in text
    assert f"aggregated reads: {len(plan.chunks)}" in text


def test_direct_destinations_get_chunks_without_buffers(one_file):
    root, tensors = one_file
    with open_ckpt(root) as ckpt:
        dest = torch.empty(8, 16)
        plan = ckpt.plan(["model.layers.0.a", "model.layers.0.b"], dests={"model.layers.0.a": dest})
        direct = [c for c in plan.chunks if c.direct]
        assert len(direct) == 1 and direct[0].tensors[0].tensor.dest is dest
        assert plan.largest_chunk == 8 * 16 * 4
        ckpt.read_into({"model.layers.0.a": dest})
        assert_bitexact(dest, tensors["model.layers.0.a"])


def test_read_into_plans_each_request_once_and_builds_one_plan(one_file, monkeypatch):
    """A load is planned once: each request resolved against the headers once, the plan built once
    (the destinations' checks and the direct reads use that resolution), and asking the
    checkpoint what it reads with starts nothing."""
    from vllm_fastload import plan as plan_module

    root, tensors = one_file
    resolved, built = [], []
    real_tensor, real_build = plan_module.plan_tensor, plan_module.build_plan
    monkeypatch.setattr(plan_module, "plan_tensor", lambda *a, **k: resolved.append(a[1]) or real_tensor(*a, **k))
    monkeypatch.setattr(plan_module, "build_plan", lambda *a, **k: built.append(1) or real_build(*a, **k))
    import vllm_fastload.api as api_module

    monkeypatch.setattr(api_module, "build_plan", plan_module.build_plan)
    with open_ckpt(root) as ckpt:
        assert ckpt.backend == "host" and ckpt.strided_min_skip == 0 and ckpt._reader is None  # nothing made yet
        targets = {TensorRequest("model.layers.0.a", 1, 4, 8): torch.empty(8, 8),
                   "model.layers.0.c": torch.empty(4, 6, 10, dtype=torch.bfloat16)}
        seen = []

        class Hooks(vllm_fastload.ReadHooks):
            def on_tensor(self, request, tensor):
                seen.append(request.result_key)

        ckpt.read_into(targets, extra=["model.layers.0.b"], hooks=Hooks())
    assert [r.result_key for r in resolved] == ["model.layers.0.a", "model.layers.0.c", "model.layers.0.b"]
    assert built == [1] and seen == ["model.layers.0.b"]
    assert_bitexact(targets[TensorRequest("model.layers.0.a", 1, 4, 8)], tensors["model.layers.0.a"][:, 4:12])
