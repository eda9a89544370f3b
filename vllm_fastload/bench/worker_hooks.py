"""Benchmark instrumentation inside vLLM's worker processes (active only with FASTLOAD_BENCH_DIR set).

Wraps ``load_weights`` of every registered loader to record, per rank: seconds, bytes the
process read (``/proc/self/io``), RSS before and peak RSS after. Also registers ``zerofill``,
a loader that reads nothing and only writes zeros into every parameter: the cost of
touching fresh parameter memory, i.e. the floor for any CPU loader.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from vllm_fastload.bench.core import status_kb


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

    def load_weights(self, model, model_config):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        io_before, rss_before = _io(), status_kb("VmRSS")
        start = time.perf_counter()
        result = original(self, model, model_config)
        seconds = time.perf_counter() - start
        io_after = _io()
        record = {"rank": rank, "loader": type(self).__name__, "load_format": self.load_config.load_format,
                  "seconds": seconds, "rchar": io_after["rchar"] - io_before["rchar"],
                  "read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
                  "rss_before_kb": rss_before, "hwm_after_kb": status_kb("VmHWM")}
        (out_dir / f"rank{rank}-{os.getpid()}.json").write_text(json.dumps(record))
        return result

    load_weights._fastload_timed = True
    cls.load_weights = load_weights


def install(out_dir: str) -> None:
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class ZeroFillLoader(BaseModelLoader):
        """Reads nothing; writes zeros into every parameter (the fresh-memory floor)."""

        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            for p in model.parameters():
                p.data.zero_()

    registry = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    if "zerofill" not in registry:
        model_loader.register_model_loader("zerofill")(ZeroFillLoader)
    path = Path(out_dir)
    for cls in set(registry.values()):
        _timed(cls, path)
