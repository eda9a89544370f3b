"""``bench --source s3`` pieces for real: s3rver on loopback, the counting proxies, the server's
limit, the timed local copy; and the object-storage targets.

s3rver is an npm package that ``scripts/setup-netsources.sh`` (run by ``scripts/test.sh``)
installs into ``.fastload/s3rver`` (and nodejs/npm from apt where they are missing and it may);
without it these tests skip and say how to get it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vllm_fastload
from vllm_fastload.bench import objstore
from vllm_fastload.bench import vllm as bench
from vllm_fastload.tools.checkpoints import write_checkpoint

pytest.importorskip("obstore", reason="the [remote] extra (obstore) is not installed")


def _s3rver() -> Path:
    script = objstore.s3rver_script()
    if script is None or objstore.shutil.which("node") is None:
        pytest.skip("s3rver is not installed: scripts/setup-netsources.sh installs it where node and npm exist "
                    f"(npm install --prefix {objstore.S3RVER_DIR} s3rver@{objstore.S3RVER_VERSION})")
    return script


@pytest.fixture(scope="module")
def s3bench(tmp_path_factory):
    _s3rver()
    from vllm_fastload.bench.s3bench import S3Bench

    local = write_checkpoint(tmp_path_factory.mktemp("s3b") / "ckpt", "tiny-llama", files=2)
    with S3Bench(local, ranks=2, work=tmp_path_factory.mktemp("s3b-copies")) as s3:
        yield s3


def test_ranks_are_counted_by_their_own_proxy(s3bench, monkeypatch) -> None:
    """fastload reads the URI through rank 1's proxy: that proxy counts exactly the plan's bytes."""
    assert s3bench.sample_limit() > 0 and s3bench.server_files()
    for key, value in s3bench.env(2).items():
        monkeypatch.setenv(key, value)
    assert os.environ["FASTLOAD_DEV_BENCH_ENDPOINTS"].split(",")[1] == s3bench.rank_proxies[1].url
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3bench.rank_proxies[1].url)  # what the worker hook does on rank 1
    for proxy in (s3bench.shared, *s3bench.rank_proxies):
        proxy.take()
    with vllm_fastload.open(s3bench.uri, config={"progress": False}) as ckpt:
        got = dict(ckpt.iter_tensors())
        planned = ckpt.plan().read_bytes
    served, requests = s3bench.rank_proxies[1].take()
    assert requests > 0 and served >= planned  # plus the headers
    assert s3bench.rank_proxies[0].take() == (0, 0) and s3bench.shared.take() == (0, 0)
    for path in sorted(s3bench.local.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert torch.equal(got[name], f.get_tensor(name)), name


def test_proxy_reuses_its_upstream_after_head_requests(s3bench) -> None:
    """HEAD, then GETs on the same kept-alive connections (vLLM's Run:ai streamer does this)."""
    import obstore

    store = objstore._store(s3bench.rank_proxies[0].url)
    key = next(iter(s3bench.sizes))
    s3bench.rank_proxies[0].take()
    for _ in range(3):
        assert obstore.head(store, key)["size"] == s3bench.sizes[key]
        assert len(obstore.get_range(store, key, start=0, length=100)) == 100
    assert s3bench.rank_proxies[0].take() == (300, 6)  # only GET bodies count as bytes served


def test_a_paced_proxy_sends_no_faster_than_its_link(s3bench) -> None:
    """``--store-gbps``: two concurrent GETs through one node's proxy share its link's rate."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    rate = 2e6
    key, size = max(s3bench.sizes.items(), key=lambda item: item[1])
    with objstore.CountingProxy(s3bench.server.port, "paced", rate=rate) as proxy:
        store = objstore._store(proxy.url)
        start = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            bodies = list(pool.map(lambda _: bytes(obstore.get(store, key).bytes()), range(2)))
        seconds = time.perf_counter() - start
        assert proxy.take() == (2 * size, 2)
    assert bodies[0] == bodies[1] == (s3bench.local / Path(key).name).read_bytes()
    assert seconds >= 0.9 * 2 * size / rate  # both bodies through one link
    with pytest.raises(ValueError, match="bytes per second"):
        objstore.CountingProxy(s3bench.server.port, "zero", rate=0)


def test_default_loader_row_times_its_download(s3bench) -> None:
    seen = {}

    def start(model: str, env: dict[str, str]) -> dict:
        copy = Path(model)
        seen["files"] = {p.name: p.read_bytes() for p in copy.iterdir()}
        return {"ranks": [{"rank": 0, "seconds": 1.0}]}

    res = s3bench.run("safetensors+download", 1, start)
    assert res["download_seconds"] > 0 and res["download_bytes"] >= s3bench.checkpoint_bytes
    assert res["ranks"][0]["seconds"] == pytest.approx(1.0 + res["download_seconds"])
    for path in (p for p in s3bench.local.iterdir() if not p.name.startswith(".")):
        assert seen["files"][path.name] == path.read_bytes()  # a complete, exact copy
    assert not (s3bench.work / "copy").exists()  # deleted after the start


def _row(tp: str, loader: str, median: float, served: int | None = None) -> dict:
    row = {"tp": tp, "cache": "cold", "loader": loader, "runs": 3, "seconds_median": median, "seconds_min": median,
           "seconds_max": median, "rchar_per_rank": 0, "disk_read_per_rank": 0, "peak_rss_mb": 1.0,
           "checkpoint_bytes": 1_000_000_000, "server_limit_gbps": 0.25}
    if served is not None:
        row["served_per_rank"] = served
    return row


def test_object_store_targets() -> None:
    targets = bench.parse_targets("all", "s3")
    assert set(targets) == {"s3-bytes-tp2", "s3-runai-tp2", "s3-runai-tp1", "s3-limit-tp1"}
    rows = [_row("tp1", "fastload", 4.5, served=1_000_000_000), _row("tp1", "runai_streamer", 5.0),
            _row("tp2", "fastload", 3.5, served=550_000_000), _row("tp2", "runai_streamer", 5.0)]
    got = {v["target"]: v for v in bench.check_targets(rows, targets)}
    assert got["s3-bytes-tp2"]["ok"] and got["s3-bytes-tp2"]["value"] == pytest.approx(0.55)
    assert not got["s3-runai-tp2"]["ok"] and got["s3-runai-tp2"]["value"] == pytest.approx(0.7)
    assert got["s3-runai-tp1"]["ok"]
    # 1 GB at 0.25 GB/s takes 4 s; 4.5 s is 89% of the limit
    assert got["s3-limit-tp1"]["ok"] and got["s3-limit-tp1"]["value"] == pytest.approx(4.5 / 4.0)
    assert bench.select_loaders("s3", None)[0][:2] == ["fastload", "runai_streamer"]
