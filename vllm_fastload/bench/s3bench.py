"""``vllm-fastload bench --source s3``: one checkpoint served by s3rver on loopback to every loader.

vLLM's own process (config.json, tokenizer files) talks to a shared counting proxy; each TP
rank's ``load_weights`` talks to its own proxy (``worker_hooks`` sets ``AWS_ENDPOINT_URL`` per
rank), so bytes served per rank are counted on the server side. The default loader cannot read
objects: its row downloads the checkpoint into a local directory right before the start (timed,
added to its ``load_weights`` seconds, deleted afterwards), as users do today.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from vllm_fastload.bench import objstore
from vllm_fastload.bench.loaders import LOADERS

PREFIX = "checkpoint"


class S3Bench:
    """s3rver with the checkpoint uploaded, one counting proxy for vLLM and one per rank."""

    def __init__(self, local: Path, ranks: int, work: Path) -> None:
        self.local = local
        self.ranks = ranks
        self.work = work
        self.uri = f"s3://{objstore.BUCKET}/{PREFIX}"
        self.limits: list[float] = []
        self._stack = ExitStack()

    def __enter__(self) -> S3Bench:
        try:
            self.server = self._stack.enter_context(objstore.S3rver(objstore.ensure_s3rver()))
            self.shared = self._stack.enter_context(objstore.CountingProxy(self.server.port, "vllm"))
            self.rank_proxies = [self._stack.enter_context(objstore.CountingProxy(self.server.port, f"rank{r}"))
                                 for r in range(self.ranks)]
            keys = objstore.upload(self.local, self.server.url, PREFIX)
            self.sizes = {k: (self.local / k.rsplit("/", 1)[-1]).stat().st_size for k in keys}
        except BaseException:
            self._stack.close()
            raise
        print(f"s3: {self.local} uploaded to s3rver at {self.server.url} as {self.uri}; vLLM via {self.shared.url}, "
              f"ranks via {', '.join(p.url for p in self.rank_proxies)}", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        shutil.rmtree(self.work, ignore_errors=True)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.sizes.values())

    def server_files(self) -> list[str]:
        """s3rver's data files: evicted before cold starts (the server's page cache is its disk)."""
        root = Path(self.server.data_dir)
        return sorted(str(p) for p in root.rglob("*") if p.is_file())

    def sample_limit(self) -> float:
        """The server's own limit, through a proxy like every loader's requests (not counted as a rank's)."""
        from vllm_fastload.bench.cache import evict

        evict(self.server_files())
        value = objstore.server_limit_gbps(self.rank_proxies[0].url, self.sizes)
        self.rank_proxies[0].take()
        self.limits.append(value)
        return value

    def summary(self) -> str:
        return (f"object store: s3rver limit (parallel ranged GETs, 16 in flight, 8 MiB) median "
                f"{statistics.median(self.limits):.3f} GB/s (min {min(self.limits):.3f}, max {max(self.limits):.3f}, "
                f"n={len(self.limits)})")

    def env(self, tp: int) -> dict[str, str]:
        return {**objstore.s3_env(self.shared.url),
                "FASTLOAD_DEV_BENCH_ENDPOINTS": ",".join(p.url for p in self.rank_proxies[:tp])}

    def run(self, name: str, tp: int, start: Callable[[str, dict[str, str]], dict]) -> dict:
        """One start of loader ``name``: ``start(model, env)`` with the URI, or with a fresh local
        copy for the default loader; server-side byte counts added to the result."""
        for proxy in (self.shared, *self.rank_proxies):
            proxy.take()
        if not LOADERS[name].download:
            res = start(self.uri, self.env(tp))
            if "error" not in res:
                res["served_per_rank"] = [p.take()[0] for p in self.rank_proxies[:tp]]
                res["served_to_vllm"] = self.shared.take()[0]
            return res
        copy = self.work / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        try:
            seconds = objstore.download(self.shared.url, PREFIX, copy)
            downloaded = self.shared.take()[0]
            res = start(str(copy), self.env(tp))
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        if "error" not in res:
            res["download_seconds"], res["download_bytes"] = seconds, downloaded
            for rank in res["ranks"]:
                rank["load_weights_seconds"] = rank["seconds"]
                rank["seconds"] += seconds  # the copy is part of this loader's time to weights
        return res
