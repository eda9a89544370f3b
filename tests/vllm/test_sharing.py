"""Whether a rank offers to share row reads with its tensor-parallel group (``rank._Sharing``, as
``policy.row_sharing`` decides), on a real local disk, cold and warm; and that ranks agree, or all
decline, without one left waiting. (The network-filesystem case runs on a real sshfs mount in tests/netfs.)"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import vllm_fastload
from vllm_fastload import policy
from vllm_fastload.bench.cache import evict
from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import TensorInfo
from vllm_fastload.model import exchange
from vllm_fastload.model import rank as rank_module
from vllm_fastload.model.rank import _Sharing
from vllm_fastload.plan import TensorRequest
from vllm_fastload.tools.checkpoints import write_checkpoint

from .layers import ThreadCollectives

ROW_SLICES = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")


def _open(where: Path, **settings) -> tuple[vllm_fastload.FastCheckpoint, dict]:
    config = FastloadConfig(progress=False, **settings)
    ckpt = vllm_fastload.open(where, config=config)
    infos = {name: ckpt.info(name) for name in ckpt.keys()}
    targets = {TensorRequest(name, dim=1, start=0, length=infos[name].shape[1] // 2): None for name in ROW_SLICES}
    targets[TensorRequest("model.norm.weight")] = None  # not a row slice: its pages are not asked about
    return ckpt, targets


def offer(where: Path, *, evicted: bool = False, **settings) -> bool:
    ckpt, targets = _open(where, **settings)
    with ckpt:
        if evicted:  # after opening: reading the headers must not warm what is judged
            evict(list(ckpt.files))
        sharing = _Sharing(None)
        sharing.decide(ckpt)
        return sharing.offer(targets)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sharing") / "ckpt", "tiny-llama", files=2)


def test_local_files_are_read_by_each_rank_cold_or_warm_unless_told_to_share(checkpoint: Path):
    """``auto`` shares on object stores only: on a local disk each rank reading its own columns
    was faster, cold and warm (docs/benchmarks.md)."""
    for evicted in (True, False):
        if not evicted:
            for path in checkpoint.glob("*.safetensors"):
                path.read_bytes()
        assert offer(checkpoint, evicted=evicted) is False
        assert offer(checkpoint, evicted=evicted, row_exchange="always") is True
        assert offer(checkpoint, evicted=evicted, row_exchange="never") is False
        assert offer(checkpoint, evicted=evicted, row_exchange="always", plan_per_rank=False) is False


def _agree_on_threads(world: int, offers: list) -> list:
    """Each rank's ``exchange.agree`` result (or its exception), with ranks running as threads."""
    collectives = ThreadCollectives(world)
    results: list = [None] * world
    infos = {"w": TensorInfo("w", "f", "BF16", (4, 8), 0, 64)}

    def run(rank: int) -> None:
        targets = {TensorRequest("w", dim=1, start=rank * 4, length=4): torch.empty(4, 4)}
        try:
            results[rank] = exchange.agree(collectives.for_rank(rank), targets if offers[rank] else None, infos)
        except BaseException as exc:  # reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in the agreement"
    return results


def test_ranks_share_only_if_every_rank_offers():
    together = _agree_on_threads(2, [True, True])
    assert all(isinstance(r, exchange.RowExchange) and set(r.shared) == {"w"} for r in together)
    assert _agree_on_threads(2, [True, False]) == [None, None]


def test_a_rank_whose_decision_fails_still_agrees(checkpoint: Path, monkeypatch):
    """``offer`` raising on one rank must not leave the other rank waiting in the agreement: that
    rank declines, logs why, and both go on without sharing."""
    collectives = ThreadCollectives(2)
    results: list = [None, None]
    decide = policy.row_sharing

    def broken(**facts):
        if threading.current_thread().name == "rank-1":
            raise OSError("no decision")
        return decide(**facts)

    monkeypatch.setattr(policy, "row_sharing", broken)
    warnings: list[str] = []
    monkeypatch.setattr(rank_module.logger, "warning", lambda msg, *args: warnings.append(msg % args))

    def run(r: int) -> None:
        ckpt, targets = _open(checkpoint, row_exchange="always")
        with ckpt:
            sharing = _Sharing(collectives.for_rank(r))
            sharing.decide(ckpt)
            results[r] = sharing.agree(targets)
            results[r] = (results[r], sharing.agree(targets))  # agreeing twice is a no-op

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in the agreement"
    assert results == [(None, None), (None, None)]
    assert warnings == ["fastload: not sharing row reads with the other ranks: no decision"]


def test_the_decision_is_logged_once_per_load_with_its_facts(checkpoint: Path):
    """At debug level, one line per outcome per load, naming the facts it was made from. (Caught on
    the package's logger itself: where the vLLM plugin registered in this process, its lines go to
    vLLM's handlers, not the root's.)"""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    tree = logging.getLogger("vllm_fastload")
    level = tree.level
    tree.addHandler(handler)
    tree.setLevel(logging.DEBUG)
    ckpt, targets = _open(checkpoint)
    try:
        with ckpt:
            sharing = _Sharing(None)
            sharing.decide(ckpt)
            assert sharing.offer(targets) is sharing.offer(targets) is False
    finally:
        tree.removeHandler(handler)
        tree.setLevel(level)
    lines = [r.getMessage() for r in records if "row exchange" in r.getMessage()]
    assert lines == ["fastload: row exchange: not offered: files, where each rank reads its own columns "
                     "(setting=auto, remote=False)"]
