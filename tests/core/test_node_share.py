"""A node's share of a checkpoint (``early.node_share``), and early reads of that share only
(``early.decide`` with a layout, ``early.child`` with byte ranges), on checkpoints written
here: the ranges hold every byte of what the node's ranks hold and nothing of what they do not."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from vllm_fastload import policy
from vllm_fastload.bench.cache import evict
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.early import decide as early
from vllm_fastload.early import marks
from vllm_fastload.early.node_share import NodeLayout, RankHolding, coalesce, expert_of, node_share, split_dim
from vllm_fastload.layers import EMBEDDINGS, LAYER, layer_key
from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint

from .test_early_reads import _cached_share

#: Four layers, tensors large enough that one layer is several read-ahead gaps long.
DENSE = ModelSpec(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=1000)
MOE = ModelSpec(arch="mixtral", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=1000, experts=4)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", DENSE, files=2)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", MOE, files=2)


def _open(path: Path) -> tuple[dict, dict[str, int]]:
    ckpt = Checkpoint.discover(path)
    try:
        return dict(ckpt.tensors), {name: sf.header.data_offset for name, sf in ckpt.files.items()}
    finally:
        ckpt.close()


def _stage(node: int, stages: int = 2, layers: int = 4, **kw) -> RankHolding:
    per = layers // stages
    return RankHolding(layers=range(node * per, (node + 1) * per), embeddings=node == 0, head=node == stages - 1, **kw)


def _covered(ranges, file: str, start: int, end: int) -> int:
    """Bytes of ``[start, end)`` of ``file`` inside the ranges."""
    return sum(max(0, min(end, e) - max(start, s)) for r in ranges if r.path == file for s, e in r.spans)


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint's files, for a test to change or evict."""
    copy = tmp_path / "ckpt"
    copy.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _cold_copy(checkpoint: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy out of the page cache, and its files (skips where eviction does not work)."""
    copy = _copy(checkpoint, tmp_path)
    files = sorted(str(p) for p in copy.glob("*.safetensors"))
    os.sync()
    evict(files)
    if _cached_share(Path(files[0])) > 0.5:
        pytest.skip("this filesystem keeps files cached after POSIX_FADV_DONTNEED (tmpfs?)")
    return copy, files


def test_pipeline_stages_read_their_layers_and_the_embeddings_or_the_head(dense: Path):
    tensors, headers = _open(dense)
    shares = []
    for node in (0, 1):
        layout = NodeLayout(node=node, nodes=2, ranks=(_stage(node),), layers_total=4)
        share = node_share(tensors, headers, layout, gap=0)
        shares.append(share)
        for name, info in tensors.items():
            key = layer_key(name)
            held = (key.stage == LAYER and key.index // 2 == node) or (key.stage == EMBEDDINGS and node == 0) or \
                (key.stage not in (LAYER, EMBEDDINGS) and node == 1)
            assert _covered(share.ranges, info.file, info.start, info.end) == (info.nbytes if held else 0), name
        for file, offset in headers.items():  # every header, which each rank reads to plan
            assert _covered(share.ranges, file, 0, offset) == offset
        assert share.layer_share == pytest.approx(0.5, abs=0.01)
        assert share.read < 0.62 * share.total
    assert layout.describe() == "node 1 of 2 holds layers 2-3 of 4, the head"
    assert shares[0].held + shares[1].held == shares[0].total  # together, every byte once


def test_the_last_stage_reads_tied_embeddings_and_vllm_partitions_are_followed(dense: Path):
    tensors, headers = _open(dense)
    embed = tensors["model.embed_tokens.weight"]
    last = RankHolding(layers=range(3, 4), embeddings=False, head=True)  # VLLM_PP_LAYER_PARTITION=3,1
    tied = NodeLayout(node=1, nodes=2, ranks=(last,), layers_total=4, tied_embeddings=True)
    share = node_share(tensors, headers, tied, gap=0)
    assert _covered(share.ranges, embed.file, embed.start, embed.end) == embed.nbytes
    assert share.layer_share == pytest.approx(0.25, abs=0.01)
    assert tied.describe() == "node 1 of 2 holds layers 3 of 4, the embeddings, the head"
    untied = node_share(tensors, headers, NodeLayout(node=1, nodes=2, ranks=(last,), layers_total=4), gap=0)
    assert _covered(untied.ranges, embed.file, embed.start, embed.end) == 0


def test_tensor_parallel_ranks_across_nodes_read_estimated_rows(dense: Path):
    """TP=2 across two nodes: column-parallel weights split by rows (by name), the rest whole; the
    two nodes' shares together are every byte, and a node holding both ranks reads everything."""
    tensors, headers = _open(dense)
    shares = [node_share(tensors, headers, NodeLayout(node=n, nodes=2, layers_total=4, ranks=(
        RankHolding(layers=range(4), embeddings=True, head=True, tp_rank=n, tp_size=2),)), gap=0) for n in (0, 1)]
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    half = q.nbytes // 2
    assert split_dim(q.name, 2) == 0 and split_dim(down.name, 2) == 1
    assert _covered(shares[0].ranges, q.file, q.start, q.start + half) == half
    assert _covered(shares[0].ranges, q.file, q.start + half, q.end) == 0
    assert _covered(shares[1].ranges, q.file, q.start + half, q.end) == half
    for share in shares:  # a row-parallel slice interleaves with the other node's: read whole
        assert _covered(share.ranges, down.file, down.start, down.end) == down.nbytes
        assert 0.55 < share.layer_share < 0.8
    both = NodeLayout(node=0, nodes=2, layers_total=4, ranks=tuple(
        RankHolding(layers=range(4), embeddings=True, head=True, tp_rank=r, tp_size=2) for r in (0, 1)))
    assert node_share(tensors, headers, both, gap=0).held == shares[0].total
    assert "tensor-parallel ranks 1 of 2 (rows estimated by tensor names)" in NodeLayout(
        node=1, nodes=2, layers_total=4, ranks=(RankHolding(range(4), True, True, tp_rank=1, tp_size=2),)).describe()


def test_a_vocabulary_is_split_padded_as_the_engines_split_it(dense: Path):
    """Vocabulary 1000 at TP=2: the engines pad it to 1024 and give rank 0 rows [0, 512) and rank 1
    rows [512, 1000) (not 500 each); a weight that is not a vocabulary is split evenly."""
    tensors, headers = _open(dense)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        info = tensors[name]
        row = info.nbytes // info.shape[0]
        cut = info.start + 512 * row
        for rank in (0, 1):
            layout = NodeLayout(node=rank, nodes=2, layers_total=4, ranks=(
                RankHolding(layers=range(4), embeddings=True, head=True, tp_rank=rank, tp_size=2),))
            share = node_share(tensors, headers, layout, gap=0)
            mine, other = ((info.start, cut), (cut, info.end)) if rank == 0 else ((cut, info.end), (info.start, cut))
            assert _covered(share.ranges, info.file, *mine) == mine[1] - mine[0], (name, rank)
            assert _covered(share.ranges, info.file, *other) == 0, (name, rank)
    unpadded = NodeLayout(node=0, nodes=2, layers_total=4, vocab_padding=1, ranks=(
        RankHolding(layers=range(4), embeddings=True, head=True, tp_rank=0, tp_size=2),))
    embed = tensors["model.embed_tokens.weight"]
    half = embed.nbytes // 2
    assert _covered(node_share(tensors, headers, unpadded, gap=0).ranges, embed.file, embed.start, embed.end) == half


def test_expert_parallel_nodes_read_their_experts_whole(moe: Path):
    tensors, headers = _open(moe)
    layouts = [NodeLayout(node=n, nodes=2, layers_total=2, experts_total=4, ranks=(
        RankHolding(layers=range(2), embeddings=True, head=True, tp_rank=n, tp_size=2,
                    experts=frozenset({2 * n, 2 * n + 1})),)) for n in (0, 1)]
    for node, layout in enumerate(layouts):
        share = node_share(tensors, headers, layout, gap=0)
        for name, info in tensors.items():
            expert = expert_of(name)
            if expert is not None:
                want = info.nbytes if expert // 2 == node else 0
                assert _covered(share.ranges, info.file, info.start, info.end) == want, name
    assert layouts[1].describe().endswith("experts 2-3 of 4")
    assert expert_of("model.layers.1.mlp.shared_experts.gate_proj.weight") is None


def test_nearby_ranges_are_read_as_one(dense: Path):
    tensors, headers = _open(dense)
    layout = NodeLayout(node=0, nodes=2, layers_total=4, ranks=(  # row halves: gaps of half a tensor
        RankHolding(layers=range(4), embeddings=True, head=True, tp_rank=0, tp_size=2),))
    exact = node_share(tensors, headers, layout, gap=0)
    merged = node_share(tensors, headers, layout, gap=policy.EARLY_READS_GAP)
    assert sum(len(r.spans) for r in merged.ranges) < sum(len(r.spans) for r in exact.ranges)
    assert merged.read >= exact.read and merged.held == exact.held
    for r in merged.ranges:
        assert all(b[0] - a[1] > policy.EARLY_READS_GAP for a, b in zip(r.spans, r.spans[1:]))
    assert coalesce([(10, 20), (0, 5), (25, 30), (18, 19), (40, 40)], 5) == ((0, 30),)
    assert coalesce([(0, 5), (11, 12)], 5) == ((0, 5), (11, 12))


def test_early_reads_read_the_node_share_and_say_so(dense: Path, tmp_path: Path, monkeypatch, caplog):
    """The engine-independent start with a two-node layout: the log line gives the share and why,
    the node's tensors are in the page cache afterwards and the other stage's are not."""
    copy, files = _cold_copy(dense, tmp_path)
    for key in (early.STARTED_ENV, marks.MARKS_ENV, "FASTLOAD_EARLY_READS"):
        monkeypatch.delenv(key, raising=False)
    layout = NodeLayout(node=1, nodes=2, ranks=(_stage(1),), layers_total=4)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        early.start("test", lambda: early.EarlyStart(path=str(copy), extra={}, local_ranks=1, nodes=2, layout=layout))
        try:
            share = early.node_share_of(files, layout)
            _wait_for(caplog, "files in the page cache after")
        finally:
            marks.load_begins()
            marks.load_ends()
        _wait_for(caplog, "files released after")
    line = re.search(r"early reads: 2 checkpoint files \([\d.]+ of [\d.]+ GB: ([\d.]+) of the checkpoint, ([\d.]+) "
                     r"of its layers; node 1 of 2 holds layers 2-3 of 4, the head\) into the page cache", caplog.text)
    assert line, caplog.text
    size = sum(os.path.getsize(f) for f in files)
    assert float(line.group(1)) == pytest.approx(share.read / size, abs=1e-3)
    assert float(line.group(2)) == pytest.approx(0.5, abs=0.01)
    tensors, _ = _open(copy)
    for name in ("model.layers.3.mlp.up_proj.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"):
        info = tensors[name]
        fd = os.open(info.file, os.O_RDONLY)
        try:
            from vllm_fastload.readers.pagecache import cached_share

            cached = cached_share(fd, info.start, info.end)
        finally:
            os.close(fd)
        assert cached == (0.0 if ".layers.0." in name else 1.0), name
    monkeypatch.delenv(early.STARTED_ENV, raising=False)


def test_a_rank_counts_the_cached_bytes_of_its_own_rows(dense: Path, tmp_path: Path):
    """What a rank's line reports as found in the page cache (``FastCheckpoint.cached_share`` of
    its requests) samples the rows it reads, not the whole tensors they are cut from: with only a
    node's half of a column-parallel weight cached, that half is all cached, the tensor half."""
    import vllm_fastload
    from vllm_fastload.plan import TensorRequest

    copy, _ = _cold_copy(dense, tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"  # [1024, 256] bf16: 256 KiB, 64 pages a half
    with vllm_fastload.open(copy, config={"progress": False, "early_reads": "never"}) as ckpt:
        info = ckpt.tensors[name]
        half = info.shape[0] // 2
        fd = os.open(info.file, os.O_RDONLY)
        try:
            os.pread(fd, info.nbytes // 2, info.start)  # rank 0's rows, as its node's early reads read them
        finally:
            os.close(fd)
        mine, theirs = (TensorRequest(name, dim=0, start=s, length=half) for s in (0, half))
        assert ckpt.cached_share([mine]) == 1.0
        assert ckpt.cached_share([theirs]) <= 1 / policy.PAGE_SAMPLES  # the one page it shares with rank 0's rows
        assert ckpt.cached_share([name]) == pytest.approx(0.5, abs=0.07)
        # weighted by bytes: rank 0's half (cached) against a whole tensor twice its size (not)
        assert ckpt.cached_share([mine, "model.layers.3.mlp.up_proj.weight"]) == pytest.approx(1 / 3, abs=0.05)
        columns = TensorRequest(name, dim=1, start=0, length=info.shape[1] // 2)  # every row: half of them cached
        assert ckpt.cached_share([columns]) == pytest.approx(0.5, abs=0.1)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_file_cut_short_is_an_error_line_at_once(dense: Path, tmp_path: Path, monkeypatch, caplog, nodes: int):
    """A file cut short, found as early reads look at the checkpoint (on one node, or on node 1 of
    two): an error line naming the file and the tensor, nothing read early, and nothing raised
    (the load may not read that file: the model picks its files); a checkpoint whose files hold one
    tensor twice (the model's own file patterns may pick among them) and one that is not there are
    no errors."""
    copy = _copy(dense, tmp_path)
    shard = sorted(copy.glob("*.safetensors"))[-1]
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    layout = NodeLayout(node=1, nodes=2, ranks=(_stage(1),), layers_total=4) if nodes == 2 else None

    def start(path: Path) -> list[logging.LogRecord]:
        for key in (early.STARTED_ENV, marks.MARKS_ENV, "FASTLOAD_EARLY_READS"):
            monkeypatch.delenv(key, raising=False)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm_fastload"):
            early.start("test", lambda: early.EarlyStart(path=str(path), extra={}, local_ranks=1, nodes=nodes,
                                                         layout=layout))
        return [r for r in caplog.records if r.levelno >= logging.WARNING]

    (record,) = start(copy)
    message = record.getMessage()
    assert record.levelno == logging.ERROR
    assert message.startswith("fastload: early reads: a checkpoint file cannot be read (TruncatedFileError: "), message
    assert f"file '{shard}'" in message and "tensor '" in message and "a rank whose load reads that file" in message
    assert "into the page cache" not in caplog.text  # nothing was started

    twice = _copy(dense, tmp_path / "twice")
    (twice / "model.safetensors.index.json").unlink(missing_ok=True)
    first = sorted(twice.glob("*.safetensors"))[0]
    (twice / "extra.safetensors").write_bytes(first.read_bytes())
    assert start(twice) == [] and "IndexMismatchError" in caplog.text  # the reason it read nothing, at info
    assert start(tmp_path / "gone") == []
    monkeypatch.delenv(early.STARTED_ENV, raising=False)


def test_one_node_reads_every_file_as_before():
    assert policy.early_scope(nodes=1, layout_known=True) is policy.EarlyScope.EVERY_FILE
    assert policy.early_scope(nodes=2, layout_known=True) is policy.EarlyScope.NODE
    assert policy.early_scope(nodes=2, layout_known=False) is policy.EarlyScope.UNKNOWN_LAYOUT


def test_several_nodes_with_an_unknown_layout_read_every_file_and_say_why(dense: Path, monkeypatch, caplog):
    for key in (early.STARTED_ENV, marks.MARKS_ENV):
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm_fastload"):
        early.start("test", lambda: early.EarlyStart(path=str(dense), extra={}, local_ranks=1, nodes=2))
        try:
            _wait_for(caplog, "files in the page cache after")
        finally:
            marks.load_begins()
            marks.load_ends()
        _wait_for(caplog, "files released after")
    assert re.search(r"early reads: 2 checkpoint files \([\d.]+ GB\) into the page cache while test starts; every "
                     r"file: the start spans several nodes, but what this node's ranks hold is unknown", caplog.text)
    assert "2 of 2 files in the page cache after" in caplog.text and "the ranges of them" not in caplog.text
    monkeypatch.delenv(early.STARTED_ENV, raising=False)


def _wait_for(caplog, text: str, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while text not in caplog.text:
        assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout} s:\n{caplog.text}"
        time.sleep(0.05)
