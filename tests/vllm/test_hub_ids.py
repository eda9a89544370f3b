"""``LLM(model="org/name", load_format="fastload")``: a Hugging Face Hub id, with the weights in the
local Hugging Face cache (blobs, snapshot symlinks, ``refs/main``), as most users start vLLM.

The Hub cannot be reached from the test machines, so "online" means a stand-in on loopback
(``tests/hub.py``, ``StandInHub``) that answers the part of the Hub's API vLLM and
``huggingface_hub`` use, through ``HF_ENDPOINT``. Offline is ``HF_HUB_OFFLINE=1`` (vLLM then
resolves the id to the snapshot directory itself). Every start is compared, parameter by parameter
on every rank, with vLLM's default loader on the same weights; early reads must run from the
cached snapshot; where the Hub has a newer revision than the cache, that revision is what loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.hub import Revision, StandInHub, repo_folder, write_cache
from vllm_fastload.tools.checkpoints import write_checkpoint

from .conftest import ARCHITECTURES
from .test_vllm_loader import assert_ok, summaries

pytestmark = pytest.mark.vllm

REPO = "fastload-test/tiny-gqa"
ARCH = "llama-gqa"  # its default-loader runs are shared with test_vllm_loader


@pytest.fixture(scope="module")
def revisions(checkpoints, tmp_path_factory) -> tuple[Revision, Revision]:
    """The cached revision (the suite's llama-gqa checkpoint) and a newer one with other weights."""
    newer = write_checkpoint(tmp_path_factory.mktemp("hub") / "v2", ARCHITECTURES[ARCH][0], files=2, seed=1)
    return Revision.of_directory(checkpoints[ARCH]), Revision.of_directory(newer)


def same_weights(fast: dict, ref: dict) -> None:
    assert_ok(fast)
    assert_ok(ref)
    assert len(fast["digests"]) == len(ref["digests"])
    for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"])):
        assert got.keys() == want.keys()
        assert not [n for n in want if got[n] != want[n]], f"rank {rank} differs from the default loader"
    assert fast["tokens"] == ref["tokens"]


def early_reads_of(log: str) -> re.Match | None:
    return re.search(r"fastload: early reads: (\d+) checkpoint files \([\d.]+ GB\)( of (\S+) \(its cached "
                     r"snapshot (\w+)\))? into the page cache", log)


def test_offline_hub_id_loads_from_the_cache(revisions, checkpoints, scenarios, tmp_path):
    """Offline, vLLM hands the cached snapshot's directory over. (Each rank resolves a hub id on its
    own: the online start below is the TP=2 one.)"""
    cached, _ = revisions
    tp = 1
    write_cache(tmp_path / "cache", REPO, cached)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    fast = scenarios.get(f"hub-offline-tp{tp}", REPO, "fastload", tp, env=env)
    same_weights(fast, scenarios.get(ARCH, checkpoints[ARCH], "safetensors", tp))
    early = early_reads_of(fast["log"])
    assert early and int(early.group(1)) == 2, fast["log"][-3000:]  # vLLM handed over the snapshot directory
    assert sorted(summaries(fast["log"])) == list(range(tp))


def test_online_hub_id_reads_its_cached_snapshot_early(revisions, checkpoints, scenarios, tmp_path):
    """The Hub's head is the cached revision: early reads start on the cached snapshot while vLLM
    starts (no network at config time), and no weight file is downloaded."""
    cached, _ = revisions
    tp = 2
    write_cache(tmp_path / "cache", REPO, cached)
    with StandInHub(REPO, [cached]) as hub:
        fast = scenarios.get("hub-online-tp2", REPO, "fastload", tp, env=hub.env(tmp_path / "cache"))
    same_weights(fast, scenarios.get(ARCH, checkpoints[ARCH], "safetensors", tp))
    early = early_reads_of(fast["log"])
    assert early and early.group(3) == REPO and cached.commit.startswith(early.group(4)), fast["log"][-3000:]
    assert not [p for p in hub.downloads() if p.endswith(".safetensors")], hub.requests
    assert any("/api/models/" in p for _, p in hub.requests)  # it was online: vLLM asked the stand-in
    cached_share = re.findall(r"; (\d+)% of it in the page cache as the load began", fast["log"])
    assert len(cached_share) == tp


def test_online_hub_id_loads_the_newer_revision(revisions, tmp_path, scenarios):
    """The cache holds an older revision than the Hub's head: vLLM's config step fetches the newer
    revision's config.json (its snapshot then lacks the weights, so one line says there are no early
    reads, and no later process of the start tries again), vLLM's download step fetches the newer
    weights, and the load reads those exactly."""
    cached, newer = revisions
    tp = 1
    write_cache(tmp_path / "cache", REPO, cached)
    with StandInHub(REPO, [cached, newer]) as hub:
        assert hub.refs["main"] == newer.commit
        fast = scenarios.get("hub-newer-tp1", REPO, "fastload", tp, env=hub.env(tmp_path / "cache"))
    ref = scenarios.get("hub-newer-ref", newer.files["config.json"].parent, "safetensors", tp)
    same_weights(fast, ref)
    assert early_reads_of(fast["log"]) is None
    decided = re.findall(r"fastload: (?:no )?early reads[^\n]*", fast["log"])
    assert len(decided) == 1 and f"the cached snapshot of {REPO} at revision main lacks weight files" in decided[0], \
        decided or fast["log"][-3000:]
    downloaded = sorted(Path(p).name for p in hub.downloads() if p.endswith(".safetensors"))
    assert downloaded == sorted(n for n in newer.files if n.endswith(".safetensors")), hub.requests
    assert all(f"/resolve/{newer.commit}/" in p for p in hub.downloads() if p.endswith(".safetensors"))
    snapshot = repo_folder(tmp_path / "cache", REPO) / "snapshots" / newer.commit
    assert snapshot.is_dir() and (repo_folder(tmp_path / "cache", REPO) / "refs" / "main").read_text() == newer.commit
    # The older revision's weights differ: loading it would have failed the comparison above.
    old = scenarios.get(ARCH, cached.files["config.json"].parent, "safetensors", tp)
    assert_ok(old)
    assert old["digests"] != ref["digests"]


def test_a_hub_id_missing_from_the_cache_says_why_there_are_no_early_reads(tmp_path):
    """Where the cache lacks the snapshot, early reads do not apply, and one line says why (vLLM
    then downloads as it always does)."""

    from vllm_fastload.early.decide import files_to_read
    from vllm_fastload.sources.hub import NotCachedError, cached_snapshot

    with pytest.raises(NotCachedError, match=REPO):
        cached_snapshot(REPO, cache_dir=tmp_path / "empty")
    with pytest.raises(NotCachedError):
        files_to_read(REPO, {}, download_dir=str(tmp_path / "empty"))
    assert files_to_read(REPO, {"early_reads": "never"}, download_dir=str(tmp_path / "empty")) == []
    assert files_to_read("s3://bucket/model", {}) == []
