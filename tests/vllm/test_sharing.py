"""Whether a rank offers to share row reads with its tensor-parallel group (``rank._Sharing``, as
``policy.row_sharing`` decides), decided on a real local disk, cold and warm; and that ranks agree,
or all decline, without one left waiting. (The network-filesystem case runs on a real sshfs mount in tests/netfs.)"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import vllm_fastload
from vllm_fastload import exchange, policy
from vllm_fastload.bench.machine import evict
from vllm_fastload.config import FastloadConfig
from vllm_fastload.format import TensorInfo
from vllm_fastload.model import rank as rank_module
from vllm_fastload.model.rank import _machine, _Sharing
from vllm_fastload.plan import TensorRequest
from vllm_fastload.tools.checkpoints import write_checkpoint

from .layers import ThreadCollectives

ROW_SLICES = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")


def _open(where: Path, **settings) -> tuple[vllm_fastload.FastCheckpoint, FastloadConfig, dict, dict]:
    config = FastloadConfig(progress=False, **settings)
    ckpt = vllm_fastload.open(where, config=config)
    infos = {name: ckpt.info(name) for name in ckpt.keys()}
    targets = {TensorRequest(name, dim=1, start=0, length=infos[name].shape[1] // 2): None for name in ROW_SLICES}
    targets[TensorRequest("model.norm.weight")] = None  # not a row slice: its pages are not asked about
    return ckpt, config, infos, targets


def offer(where: Path, *, evicted: bool = False, **settings) -> tuple[bool, str | None]:
    ckpt, config, infos, targets = _open(where, **settings)
    with ckpt:
        if evicted:  # after opening: reading the headers must not warm what is judged
            evict(list(ckpt.checkpoint.files))
        sharing = _Sharing(None)
        sharing.decide(config, ckpt, infos, ckpt.cached_share())  # as a rank's load measures it first
        return sharing.offer(targets)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("sharing") / "ckpt", "tiny-llama", files=2)
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    evict(files)
    with vllm_fastload.open(path, config={"progress": False}) as ckpt:
        if ckpt.cached_share(ROW_SLICES) > 0.5:
            pytest.skip("this filesystem keeps files cached after POSIX_FADV_DONTNEED (tmpfs?)")
    return path


def test_a_cold_local_disk_shares_within_the_machine_and_a_warm_one_does_not(checkpoint: Path):
    assert offer(checkpoint, evicted=True) == (True, _machine())
    assert len(_machine()) >= 8  # the boot id (or the host name), the same for every rank here
    for path in checkpoint.glob("*.safetensors"):  # warm: each rank's own copies are faster
        path.read_bytes()
    assert offer(checkpoint) == (False, _machine())
    # Explicit settings, and the cases 'auto' leaves alone, cold as well as warm.
    for evicted in (True, False):
        assert offer(checkpoint, evicted=evicted, row_exchange="always") == (True, None)
        assert offer(checkpoint, evicted=evicted, row_exchange="never") == (False, None)
        assert offer(checkpoint, evicted=evicted, plan_per_rank=False) == (False, None)
        assert offer(checkpoint, evicted=evicted, direct_io="never") == (False, None)


def test_a_warm_checkpoint_is_judged_by_its_share_at_open(checkpoint: Path, monkeypatch):
    """Where the share of the checkpoint cached as the load began leaves the row slices no room to
    be under ``policy.ROW_SHARING_COLD``, ``offer`` declines without asking about each tensor's pages; just below that
    bound, or with no share known, it asks, and what it asks decides."""
    for path in checkpoint.glob("*.safetensors"):
        path.read_bytes()
    asked: list[list[str]] = []
    real = vllm_fastload.FastCheckpoint.cached_share

    def answer(self, names=None):
        if names is not None:
            asked.append(sorted(names))
            return 0.0  # what a cold disk would say: sharing pays
        return real(self, names)

    monkeypatch.setattr(vllm_fastload.FastCheckpoint, "cached_share", answer)
    ckpt, config, infos, targets = _open(checkpoint)
    with ckpt:
        sliced = sum(infos[name].nbytes for name in ROW_SLICES) / ckpt.checkpoint.total_bytes
        bound = 1 - (1 - policy.ROW_SHARING_COLD) * sliced  # the lowest share at open that rules them out
        for share, asks in ((1.0, False), (bound + 1e-9, False), (bound - 1e-6, True), (0.0, True), (None, True)):
            asked.clear()
            sharing = _Sharing(None)
            sharing.decide(config, ckpt, infos, share)
            assert sharing.offer(targets) == (asks, _machine()), share
            assert asked == ([sorted(ROW_SLICES)] if asks else []), share


def _agree_on_threads(world: int, offers: list, scopes: list) -> list:
    """Each rank's ``exchange.agree`` result (or its exception), with ranks running as threads."""
    collectives = ThreadCollectives(world)
    results: list = [None] * world
    infos = {"w": TensorInfo("w", "f", "BF16", (4, 8), 0, 64)}

    def run(rank: int) -> None:
        targets = {TensorRequest("w", dim=1, start=rank * 4, length=4): torch.empty(4, 4)}
        try:
            results[rank] = exchange.agree(collectives.for_rank(rank), targets if offers[rank] else None, infos,
                                           scope=scopes[rank])
        except BaseException as exc:  # reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in the agreement"
    return results


def test_ranks_share_only_within_one_scope():
    together = _agree_on_threads(2, [True, True], ["machine-a", "machine-a"])
    assert all(isinstance(r, exchange.RowExchange) and set(r.shared) == {"w"} for r in together)
    assert _agree_on_threads(2, [True, True], ["machine-a", "machine-b"]) == [None, None]
    assert _agree_on_threads(2, [True, False], ["machine-a", "machine-a"]) == [None, None]


def test_a_rank_whose_decision_fails_still_agrees(checkpoint: Path, monkeypatch):
    """``offer`` raising on one rank (here ``cached_share``) must not leave the other rank
    waiting in the agreement: that rank declines, logs why, and both go on without sharing."""
    collectives = ThreadCollectives(2)
    results: list = [None, None]

    def broken(self, names):
        if threading.current_thread().name == "rank-1":
            raise OSError("mincore failed")
        return 0.0

    monkeypatch.setattr(vllm_fastload.FastCheckpoint, "cached_share", broken)
    warnings: list[str] = []
    monkeypatch.setattr(rank_module.logger, "warning", lambda msg, *args: warnings.append(msg % args))

    def run(r: int) -> None:
        ckpt, config, infos, targets = _open(checkpoint)
        with ckpt:
            sharing = _Sharing(collectives.for_rank(r))
            sharing.decide(config, ckpt, infos)
            results[r] = sharing.agree(targets)
            results[r] = (results[r], sharing.agree(targets))  # agreeing twice is a no-op

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in the agreement"
    assert results == [(None, None), (None, None)]
    assert warnings == ["fastload: not sharing row reads with the other ranks: mincore failed"]


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
    ckpt, config, infos, targets = _open(checkpoint)
    try:
        with ckpt:
            sharing = _Sharing(None)
            sharing.decide(config, ckpt, infos, 1.0)
            assert sharing.offer(targets) == sharing.offer(targets) == (False, _machine())
    finally:
        tree.removeHandler(handler)
        tree.setLevel(level)
    lines = [r.getMessage() for r in records if "row exchange" in r.getMessage()]
    assert lines == ["fastload: row exchange: not offered: no row slices known to be cold (setting=auto, "
                     "remote=False, cached=1.0, network=False, backend=host, sliced_bytes="
                     f"{sum(infos[name].nbytes for name in ROW_SLICES)})"]
