"""Benchmark instrumentation inside vLLM's worker processes (active only with FASTLOAD_DEV_BENCH_DIR set).

Wraps ``load_weights`` of every registered loader to record, per rank: seconds, bytes the
process read (``/proc/self/io``), RSS before and peak RSS after; and vLLM's
``BaseModelLoader.load_model`` (what the worker waits for: model init, ``load_weights``, the
post-processing) with its ``process_weights_after_loading`` inside. Also registers two
reference loaders that read no file:

- ``zerofill`` writes zeros into every parameter: the cost of touching fresh parameter
  memory, the floor for any CPU loader;
- ``memcopy`` copies into every parameter from a buffer already in memory: fresh memory plus
  one memory-to-memory copy, the floor for any loader that delivers bytes (a warm page cache
  is such a buffer; a real loader also pays for finding its pages and for its read calls).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from pathlib import Path

from vllm_fastload.bench.cache import warm
from vllm_fastload.bench.core import status_kb

#: A folder whose sitecustomize installs these timers in every process of a vLLM that has it on its
#: PYTHONPATH: the loader itself never imports benchmark code.
SITE = Path(__file__).parent / "site"


def timed_env(env: dict[str, str], out_dir: str | os.PathLike) -> dict[str, str]:
    """``env`` for a vLLM whose every process records its loads into ``out_dir``."""
    return {**env, "FASTLOAD_DEV_BENCH_DIR": str(out_dir),
            "PYTHONPATH": os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")])}


#: Numbers the loads of one process, so that a second load does not overwrite the first's record.
_loads = itertools.count()


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value)
    return out


def _timed(cls, out_dir: Path):
    original = cls.load_weights
    if getattr(original, "_fastload_timed", False):
        return

    @functools.wraps(original)
    def load_weights(self, model, model_config):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        endpoints = os.environ.get(ENDPOINTS_ENV)
        if endpoints:  # this rank's own counting proxy (bench/objstore.py)
            os.environ["AWS_ENDPOINT_URL"] = endpoints.split(",")[rank]
        _set_cache_state(os.environ.get(CACHE_ENV), model_config, rank)
        if dist.is_initialized():
            dist.barrier()  # no rank starts its clock while another still warms or evicts
        io_before, rss_before = _io(), status_kb("VmRSS")
        start = time.perf_counter()
        result = original(self, model, model_config)
        seconds = time.perf_counter() - start
        io_after = _io()
        report = getattr(self, "report", None)  # fastload's LoadReport (None: another loader)
        record = {"rank": rank, "loader": type(self).__name__, "load_format": self.load_config.load_format,
                  "seconds": seconds, "rchar": io_after["rchar"] - io_before["rchar"],
                  "read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
                  "rss_before_kb": rss_before, "hwm_after_kb": status_kb("VmHWM"),
                  "cpus": len(os.sched_getaffinity(0)),
                  # fastload's own split of the time (probe, plan, read, post, ...), as in its log line
                  "phases": dict(report.phases) if report is not None else None,
                  # the share of the checkpoint in the page cache as fastload's load began
                  "cached": report.cached if report is not None else None,
                  # the share of the tensors its plan reads in the page cache as its reads began
                  "own_cached": report.own_cached if report is not None else None}
        (out_dir / f"rank{rank}-{os.getpid()}-{next(_loads)}.json").write_text(json.dumps(record))
        return result

    setattr(load_weights, "_fastload_timed", True)  # noqa: B010 (marks the wrapper as installed)
    cls.load_weights = load_weights


#: Comma-separated endpoint URLs, one per rank: each rank's object store requests go to its own
#: counting proxy, so the bytes each rank was served are counted on the server side.
ENDPOINTS_ENV = "FASTLOAD_DEV_BENCH_ENDPOINTS"
#: "warm" or "cold": the page-cache state the benchmark wants at the moment load_weights starts.
CACHE_ENV = "FASTLOAD_DEV_BENCH_CACHE"


def _set_cache_state(cache: str | None, model_config, rank: int) -> None:
    """Keep a warm cache warm right before the clock starts, not only before vLLM starts.

    vLLM's start-up runs for tens of seconds before ``load_weights``, and a host may reclaim page
    cache it finds idle meanwhile (a proactive reclaimer): a "warm" start would then read
    from disk. Rank 0 does it for all ranks (they share the page cache).
    A cold cache is made cold before the process starts (``bench.vllm``), never here: whatever a
    loader reads before ``load_weights`` (early reads) must count as the time it saves.
    """
    if cache != "warm" or rank != 0 or model_config is None:
        return
    warm(sorted(str(p) for p in Path(model_config.model).glob("*.safetensors")))


def install(out_dir: str) -> None:
    import torch
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class ZeroFillLoader(BaseModelLoader):
        """Reads nothing; writes zeros into every parameter (the fresh-memory floor)."""

        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            for p in model.parameters():
                p.data.zero_()

    class MemCopyLoader(ZeroFillLoader):
        """Reads nothing; copies into every parameter from one resident source buffer."""

        #: Larger than any CPU cache, so the source comes from DRAM like page-cache pages do.
        SOURCE_BYTES = 256 << 20

        def __init__(self, load_config) -> None:
            super().__init__(load_config)
            # Filled here, before the timed load_weights: the page cache it stands for is resident too.
            self.source = torch.full((self.SOURCE_BYTES,), 0x3C, dtype=torch.uint8)

        def load_weights(self, model, model_config) -> None:
            for p in model.parameters():
                if not p.data.is_contiguous():
                    p.data.zero_()
                    continue
                flat = p.data.reshape(-1).view(torch.uint8)
                for start in range(0, flat.numel(), self.SOURCE_BYTES):
                    part = flat[start:start + self.SOURCE_BYTES]
                    part.copy_(self.source[:part.numel()])

    registry = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    for name, cls in (("zerofill", ZeroFillLoader), ("memcopy", MemCopyLoader)):
        if name not in registry:
            model_loader.register_model_loader(name)(cls)
    path = Path(out_dir)
    for cls in set(registry.values()):
        _timed(cls, path)
    _time_load_model(path)


def _time_load_model(out_dir: Path) -> None:
    """Record ``load_model`` and its post-processing per rank (``model{rank}-*.json``)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model
    if getattr(original, "_fastload_timed", False):
        return
    post = base_loader.process_weights_after_loading
    spent = {"post": 0.0}

    @functools.wraps(post)
    def process_weights_after_loading(*args, **kwargs):
        start = time.perf_counter()
        try:
            return post(*args, **kwargs)
        finally:
            spent["post"] += time.perf_counter() - start

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        import torch.distributed as dist

        spent["post"] = 0.0
        start = time.perf_counter()
        model = original(self, *args, **kwargs)
        record = {"rank": dist.get_rank() if dist.is_initialized() else 0,
                  "load_model_s": time.perf_counter() - start, "post_s": spent["post"]}
        (out_dir / f"model{record['rank']}-{os.getpid()}-{next(_loads)}.json").write_text(json.dumps(record))
        return model

    setattr(load_model, "_fastload_timed", True)  # noqa: B010 (marks the wrapper as installed)
    base_loader.process_weights_after_loading = process_weights_after_loading
    base_loader.BaseModelLoader.load_model = load_model
