"""Two vLLM nodes on one machine (``multinode.py``: vLLM's own ``--nnodes`` support over loopback,
each node a process tree with its own environment and its own copy of the checkpoint, so that
each has its own pages in the page cache as two machines would): every parameter on every rank
equals vLLM's default loader's, greedy tokens equal, each node reads early only what its ranks
hold, and a checkpoint fault on one node ends the start on both with nothing left running."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_fastload.bench.cache import evict

from .conftest import assert_subsets
from .multinode import PP_COMPILATION, run_two_nodes
from .scenario import PROMPTS
from .test_vllm_loader import SPLIT_LAYOUTS, assert_ok, summaries

pytestmark = pytest.mark.vllm

#: "fastload: early reads: N checkpoint files (A of B GB: S of the checkpoint, L of its layers; WHO)"
NODE_READS = re.compile(r"fastload: early reads: \d+ checkpoint files \([\d.]+ of [\d.]+ GB: ([\d.]+) of the "
                        r"checkpoint, ([\d.]+) of its layers; (node \d of 2 holds .*?)\) into the page cache")
#: "...% of it in the page cache as the load began (N% of the bytes this rank reads)"
OWN_CACHED = re.compile(r"fastload rank (\d+)/\d+: .*?in the page cache as the load began \((\d+)% of the bytes")


def node_copies(src: Path, root: Path, broken: str | None = None) -> tuple[Path, Path]:
    """One copy of the checkpoint per node (two machines would each have their own pages of it),
    out of the page cache; in node 1's, tensor ``broken`` is rewritten as int32."""
    copies = []
    for node in (0, 1):
        dst = root / f"node{node}"
        shutil.copytree(src, dst)
        copies.append(dst)
    if broken is not None:
        shard = copies[1] / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][broken]
        tensors = load_file(shard)
        tensors[broken] = torch.zeros(tensors[broken].shape, dtype=torch.int32)
        save_file(tensors, shard, metadata={"format": "pt"})
    evict(sorted(str(p) for c in copies for p in c.glob("*.safetensors")))
    return copies[0], copies[1]


def test_pipeline_stages_on_two_nodes(checkpoints, scenarios, tmp_path):
    """PP=2 over two nodes: each node reads early the layers of its stage (and the embeddings or
    the head), its rank then finds what it reads in the page cache, every parameter equals the
    default loader's and the greedy tokens are the same as on one node."""
    models = node_copies(checkpoints["llama-gqa"], tmp_path)
    run = run_two_nodes(tmp_path, "pp", models, "fastload", pp=2, compilation=PP_COMPILATION)
    ref = scenarios.get("llama-gqa", checkpoints["llama-gqa"], "safetensors", 1)
    assert_ok(ref)
    assert_ok({**run.head, "log": run.logs[0]})
    assert_subsets(run.head["digests"], ref["digests"][0])
    assert run.head["tokens"] == ref["tokens"]
    assert run.head["logprobs"] == ref["logprobs"]

    for node, log in enumerate(run.logs):
        found = NODE_READS.findall(log)
        assert len(found) == 1, log[-3000:]
        share, layers, who = found[0]
        assert float(layers) <= 0.55, who  # its stage, the embeddings and head aside
        assert float(share) <= 0.65, who
        stage = "layers 0 of 2, the embeddings" if node == 0 else "layers 1 of 2, the head"
        assert who == f"node {node} of 2 holds {stage}"
        assert re.search(r"fastload: early reads: files released after [\d.]+ s, 1 of 1 loads done", log), log[-3000:]
        ranks = summaries(log)
        assert list(ranks) == [node], log[-3000:]
        assert 0.3 < float(ranks[node][4]) < 0.7  # the rank read its stage
        own = {int(r): int(p) for r, p in OWN_CACHED.findall(log)}
        assert own[node] >= 90, f"rank {node} found {own[node]}% of its bytes in the page cache"
    assert run.left_behind == []  # node 1, a headless server, ended when stopped, with all its processes


def test_tensor_parallel_moe_on_two_nodes_through_the_server(checkpoints, scenarios, tmp_path):
    """TP=2 over two nodes, an MoE checkpoint, the OpenAI server on node 0: the same weights on
    both ranks as the default loader's at TP=2 on one node, the same greedy tokens."""
    models = node_copies(checkpoints["mixtral"], tmp_path)
    run = run_two_nodes(tmp_path, "tp", models, "fastload", tp=2, server_prompts=PROMPTS)
    ref = scenarios.get("mixtral", checkpoints["mixtral"], "safetensors", 2)
    assert_ok(ref)
    assert "error" not in run.head, f"{run.head['error']}\n{run.logs[0][-4000:]}\n{run.logs[1][-4000:]}"
    assert sorted(run.digests) == [0, 1]
    for rank in (0, 1):
        want = ref["digests"][rank]
        assert run.digests[rank].keys() == want.keys()
        assert [n for n in want if run.digests[rank][n] != want[n]] == [], f"rank {rank}"
    assert run.head["tokens"] == ref["tokens"]
    for node, log in enumerate(run.logs):
        _share, _layers, who = NODE_READS.findall(log)[0]
        # (The estimated halves of this checkpoint's small tensors lie closer together than the
        # gap below which ranges are read as one: the node reads nearly all of it early.)
        assert who == f"node {node} of 2 holds layers 0-1 of 2, the embeddings, the head, tensor-parallel " \
                      f"ranks {node} of 2 (rows estimated by tensor names)"
        assert list(summaries(log)) == [node]
        assert {int(r): int(p) for r, p in OWN_CACHED.findall(log)}[node] >= 90
    assert run.left_behind == []


def test_a_checkpoint_fault_on_one_node_ends_the_start_on_both(checkpoints, tmp_path):
    """TP=2 with expert parallelism over two nodes, an expert only node 1's rank holds broken in
    node 1's copy (a tensor of the wrong dtype): node 1's rank stops with the CheckpointError naming
    file and tensor, node 1 ends, node 0's start ends, and nothing of either node is left running.
    Each node had read early the experts vLLM places on its rank."""
    arch, tp, llm_kwargs = SPLIT_LAYOUTS["expert-parallel"]
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"  # expert 3 of 4: rank 1's
    models = node_copies(checkpoints[arch], tmp_path, broken=name)
    started = time.monotonic()
    run = run_two_nodes(tmp_path, "fault", models, "fastload", tp=tp, llm_kwargs=llm_kwargs,
                        flags=["--enable-expert-parallel"], timeout=400, node1_wait_s=60)
    took = time.monotonic() - started
    assert "error" in run.head and "digests" not in run.head, "vLLM started on a broken checkpoint"
    shard = json.loads((models[1] / "model.safetensors.index.json").read_text())["weight_map"][name]
    assert re.search(rf"CheckpointError: checkpoint dtype I32 does not match parameter \S+ \(bfloat16\) "
                     rf"\(file '{re.escape(str(models[1] / shard))}', tensor '{re.escape(name)}'\)", run.logs[1]), \
        run.logs[1][-3000:]
    for node, log in enumerate(run.logs):
        assert NODE_READS.findall(log)[0][2].endswith(f"experts {2 * node}-{2 * node + 1} of 4"), log[-3000:]
    assert run.node1_exit is not None, "node 1 kept running after its rank failed"
    assert run.left_behind == []
    assert took < 400


@pytest.mark.parametrize("vocab", [500, 1000, 20011, 32000, 128256, 151936])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_node_share_splits_a_vocabulary_as_vllm_does(vocab, tp):
    """Each tensor-parallel rank's rows of the embeddings and the head in a node's share are the
    rows vLLM's ``VocabParallelEmbedding`` gives that rank (its own padding and partition functions)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        pad_vocab_size,
        vocab_range_from_global_vocab_size,
    )

    from vllm_fastload.early.node_share import NodeLayout, RankHolding, node_share
    from vllm_fastload.format import TensorInfo
    from vllm_fastload.vllm_plugin.early import _vocab_padding

    row = 64 * 2
    tensors = {name: TensorInfo(name, "f", "BF16", (vocab, 64), start, start + vocab * row)
               for name, start in (("model.embed_tokens.weight", 100), ("lm_head.weight", 100 + vocab * row))}
    for rank in range(tp):
        layout = NodeLayout(node=rank, nodes=tp, layers_total=0, vocab_padding=_vocab_padding(), ranks=(
            RankHolding(layers=range(0), embeddings=True, head=True, tp_rank=rank, tp_size=tp),))
        share = node_share(tensors, {"f": 100}, layout, gap=0)
        first, last = vocab_range_from_global_vocab_size(pad_vocab_size(vocab), rank, tp)
        want = [(0, 100)] + [(info.start + first * row, info.start + min(last, vocab) * row)
                             for info in tensors.values() if first < vocab]
        assert [span for r in share.ranges for span in r.spans] == [s for s in _merged(want)], (rank, share.ranges)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


@pytest.mark.parametrize(("args", "node", "partition", "want"), [
    ({"pipeline_parallel_size": 2}, 0, None, "node 0 of 2 holds layers 0-1 of 4, the embeddings"),
    ({"pipeline_parallel_size": 2}, 1, "3,1", "node 1 of 2 holds layers 3 of 4, the head"),
    ({"tensor_parallel_size": 2}, 1, None, "node 1 of 2 holds layers 0-3 of 4, the embeddings, the head, "
                                           "tensor-parallel ranks 1 of 2 (rows estimated by tensor names)"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 1, None, "node 1 of 2 holds layers 2-3 of 4, the head"),
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, 1, None, "experts 2-3 of 4"),
])
def test_node_layout_from_vllms_config(args, node, partition, want, checkpoints, tmp_path, monkeypatch):
    """What the vLLM adapter reads off the config a node builds (vLLM's own ``EngineArgs``, no
    start): vLLM's rank order, its layer partition (``VLLM_PP_LAYER_PARTITION`` honoured) and expert
    map; a one-node start has no layout and reads every file as before."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fastload.early import decide as core_early
    from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint
    from vllm_fastload.vllm_plugin.early import _settings

    spec = ModelSpec(arch="mixtral" if "enable_expert_parallel" in args else "llama", layers=4)
    model = write_checkpoint(tmp_path / "ckpt", spec, files=1, index=False)
    monkeypatch.setenv(core_early.STARTED_ENV, str(model))  # building the configs below reads nothing early
    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    common = {"model": str(model), "load_format": "fastload", "max_model_len": 128, "enforce_eager": True,
              "dtype": "bfloat16", "skip_tokenizer_init": True, **args}
    config = EngineArgs(**common, nnodes=2, node_rank=node, master_addr="127.0.0.1", master_port=29500
                        ).create_engine_config()
    start = _settings(config)
    assert start.nodes == 2 and start.layout is not None
    assert want in start.layout.describe()
    assert start.local_ranks == len(start.layout.ranks)
    assert start.layout.vocab_padding == 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
    one = _settings(EngineArgs(**common).create_engine_config())
    assert one.nodes == 1 and one.layout is None


@pytest.mark.parametrize(("dp", "local", "start", "tp", "want"), [
    (2, 1, 0, 1, "node 0 of 2 holds layers 0-3 of 4, the embeddings, the head, data-parallel ranks 0 of 2, "
                 "experts 0-1 of 4"),
    (2, 1, 1, 1, "node 1 of 2 holds layers 0-3 of 4, the embeddings, the head, data-parallel ranks 1 of 2, "
                 "experts 2-3 of 4"),
    (2, 1, 1, 2, "data-parallel ranks 1 of 2, experts 2-3 of 4"),  # expert ranks 2 and 3 of 4
    (4, 2, 2, 1, "node 1 of 2 holds layers 0-3 of 4, the embeddings, the head, data-parallel ranks 2-3 of 4, "
                 "experts 2-3 of 4"),
])
def test_node_layout_of_experts_over_data_parallel_nodes(dp, local, start, tp, want, tmp_path, monkeypatch):
    """A data-parallel start with expert parallelism over two nodes (the head's config, and a
    ``--headless --data-parallel-start-rank`` node's, built by vLLM's own ``EngineArgs``): each node
    holds the experts of its own data-parallel ranks, by vLLM's expert ranks (``dp_rank * tp +
    tp_rank`` of ``dp * tp``), and everything else; its early reads are those bytes, and the two
    nodes' shares together are the checkpoint. A dense model, or every data-parallel rank on one
    node, reads every file as before."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fastload.early import decide as core_early
    from vllm_fastload.early.decide import _with_replicas, node_share_of
    from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint
    from vllm_fastload.vllm_plugin.early import _settings

    # (tensors larger than early reads' coalescing gap, so that a rank's blocks are read apart)
    moe = write_checkpoint(tmp_path / "moe", ModelSpec(arch="mixtral", layers=4, hidden=512, intermediate=1024, heads=8,
                                                       kv_heads=4, vocab=4000), files=2)
    dense = write_checkpoint(tmp_path / "dense", ModelSpec(arch="llama", layers=4), files=1, index=False)
    monkeypatch.setenv(core_early.STARTED_ENV, str(moe))  # building the configs below reads nothing early

    def settings(model: Path, local: int, start: int):
        args = EngineArgs(model=str(model), load_format="fastload", max_model_len=128, enforce_eager=True,
                          dtype="bfloat16", skip_tokenizer_init=True, tensor_parallel_size=tp,
                          enable_expert_parallel=model == moe, data_parallel_size=dp, data_parallel_size_local=local,
                          data_parallel_start_rank=start or None, data_parallel_address="127.0.0.1")
        return _settings(args.create_engine_config(headless=start > 0))

    start_settings = settings(moe, local, start)
    assert start_settings.nodes == 2 and start_settings.layout is not None
    assert want in start_settings.layout.describe()
    assert start_settings.local_ranks == len(start_settings.layout.ranks) == local * tp

    files = sorted(str(f) for f in moe.glob("*.safetensors"))
    layouts = [settings(moe, local, first).layout for first in (0, local)]
    assert all(layout is not None for layout in layouts)
    # With dp_exchange (here on a local disk: 'always') each rank reads a block of the rows of
    # what its group holds alike, and the node reads early those blocks of its ranks.
    on_disk = [_with_replicas(layout, {}, files) for layout in layouts]
    exchanged = [_with_replicas(layout, {"dp_exchange": "always"}, files) for layout in layouts]
    assert [x.alike_in_blocks for x in on_disk] == [False, False] and all(x.alike_in_blocks for x in exchanged)
    for chosen in (on_disk, exchanged):
        shares = [node_share_of(files, layout) for layout in chosen]
        for share in shares:
            # what its ranks hold, and the gaps of up to 128 KiB read with it (policy.EARLY_READS_GAP: a
            # larger share of this small checkpoint's tensors than of a real one's)
            headers = sum(r.spans[0][1] for r in share.ranges)
            assert share.held < share.total and share.read <= (share.held + headers) * 1.1, share
        covered = {r.path: list(r.spans) for r in shares[0].ranges}
        for r in shares[1].ranges:
            covered[r.path] = _merged(sorted(covered[r.path] + list(r.spans)))
        assert all(spans == [(0, Path(path).stat().st_size)] for path, spans in covered.items()), covered
        if chosen is on_disk:
            alone = [share.read for share in shares]
    # together the nodes read the checkpoint about once (and the gaps), each less than without the blocks
    total = sum(Path(f).stat().st_size for f in files)
    assert all(share.read < read for share, read in zip(shares, alone))
    assert sum(share.read for share in shares) <= total * 1.1, ([s.read for s in shares], total)

    assert settings(dense, local, start).layout is None  # dense: every data-parallel rank holds everything
    assert settings(moe, dp, 0).layout is None  # every data-parallel rank on this node
