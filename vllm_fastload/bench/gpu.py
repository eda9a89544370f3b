"""``vllm-fastload bench-gpu``: fastload's GPU backends against the other loaders and the machine's limits.

One run measures everything it compares, on the same checkpoint and in the same state:

- loaders, interleaved within each repetition, cold (files evicted from the page cache before
  each one) and warm: fastload's ``cuda`` and ``kvikio`` backends with ``read_into`` into
  preallocated device tensors (as the vLLM loader does) at TP=1 and for the TP=2 rank-1 slice
  set; ``safetensors.safe_open(device="cuda:0")`` plus a copy into the same destinations;
  fastsafetensors and InstantTensor when they can be imported;
- the limits: sequential read bandwidth of the disk holding the checkpoint (parallel
  ``O_DIRECT`` reads into aligned buffers), parallel reads from the page cache, and pinned
  host-to-device copy bandwidth. Cold, no loader can beat min(disk, H2D); warm, min(page
  cache, H2D);
- device memory each loader needs beyond the destinations (torch's allocator peak, and the
  driver's view, which also sees memory allocated outside torch);
- correctness: after every load, every destination is compared bit for bit with safetensors'
  CPU read.

``--smoke`` runs the same code on a CPU-only machine (a 14 MB checkpoint, fastload's ``host``
backend and safetensors into host tensors, no H2D limit), so that CI exercises the table,
JSON, limit and eviction code. Without ``--smoke``, a machine without CUDA gets a one-line
error, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import vllm_fastload
from vllm_fastload.bench.cache import Cold, evict, make_cold, read_files, warm
from vllm_fastload.bench.core import status_kb
from vllm_fastload.bench.loaders import LOADERS, runs_on
from vllm_fastload.bench.targets import print_verdicts, verdict
from vllm_fastload.config import FastloadConfig
from vllm_fastload.machine import usable_cpus
from vllm_fastload.tensors import dtype_of, shape_of
from vllm_fastload.tools.checkpoints import LLAMA3_8B, ModelSpec, write_random_checkpoint
from vllm_fastload.tp_rules import rank_requests

#: The smoke checkpoint: 14 MB, dim-1 slices that skip 4 KiB per row (read row by row).
SMOKE_SPEC = ModelSpec(hidden=256, intermediate=4096, layers=2, heads=4, kv_heads=2, vocab=1000)
#: The loaders this benchmark calls itself (``bench.loaders``): fastload's backends (backend ->
#: loader), and the anchors, the other projects every fastload row is compared with.
BACKENDS = {LOADERS[n].config["backend"]: n for n in runs_on("library") if "backend" in LOADERS[n].config}
ANCHORS = tuple(n for n in runs_on("library") if "backend" not in LOADERS[n].config)
TP1, TP2 = "TP=1", "TP=2 rank 1"
GB = 1e9


class BenchError(RuntimeError):
    """A condition the benchmark cannot run under; printed as one line, not a traceback."""


# -- page cache and disk ------------------------------------------------------------------------

@dataclass
class Eviction:
    """How cold the cold repetitions were, over the run."""

    method: str = "posix_fadvise(DONTNEED)"
    worst_resident: float = 0.0
    drop_caches_used: int = 0
    failures: int = 0

    def note(self) -> str:
        if self.failures:
            return (f"EVICTION FAILED {self.failures} times (up to {self.worst_resident:.1%} of the checkpoint "
                    "stayed cached): those cold numbers are partly warm")
        extra = f", drop_caches needed {self.drop_caches_used} times" if self.drop_caches_used else ""
        return f"{self.method}{extra}; at most {self.worst_resident:.1%} of the checkpoint stayed cached"

    def count(self, cold: Cold) -> None:
        left = cold.resident or 0.0  # the run's own files: the kernel always says
        self.drop_caches_used += cold.dropped
        self.worst_resident = max(self.worst_resident, left)
        if left > 0.05:
            self.failures += 1


def disk_read_gbps(paths: list[str], threads: int, block: int) -> tuple[float, str]:
    """Sequential read bandwidth of the files' disk: parallel ``O_DIRECT`` reads (page cache bypassed).

    Where the filesystem refuses ``O_DIRECT`` (tmpfs, some overlays), buffered reads of
    evicted files stand in, and the method says so.
    """
    total = sum(os.path.getsize(p) for p in paths)
    try:
        start = time.perf_counter()
        got = read_files(paths, threads, block, direct=True)
        method = f"O_DIRECT, {threads} threads x {block >> 20} MiB"
    except OSError as exc:
        evict(paths)
        start = time.perf_counter()
        got = read_files(paths, threads, block)
        method = f"buffered after eviction ({threads} threads; O_DIRECT refused: {exc.strerror})"
    seconds = time.perf_counter() - start
    if got != total:
        raise BenchError(f"disk read limit: read {got} of {total} bytes")
    return total / seconds / GB, method


def page_cache_gbps(paths: list[str], threads: int, block: int) -> float:
    """Parallel buffered reads of files already in the page cache, into reused buffers."""
    read_files(paths, threads, block)  # make sure they are cached
    start = time.perf_counter()
    got = read_files(paths, threads, block)
    return got / (time.perf_counter() - start) / GB


def h2d_gbps(device: torch.device, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Pinned host-to-device copy bandwidth: the most any loader that stages in host memory gets."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best / GB


def filesystem_of(path: str) -> str:
    """The mount type holding ``path`` (tmpfs or overlay make 'cold' and 'disk' mean little)."""
    best, fstype = "", "?"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, fstype = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    return fstype


# -- memory -----------------------------------------------------------------------------------------


class DeviceMemory:
    """Peak device memory beyond what was allocated when the load started.

    torch's allocator peak sees fastload's and fastsafetensors' buffers; a sampling thread
    on ``cudaMemGetInfo`` also sees memory allocated outside torch (InstantTensor's ring
    buffer, cuFile's bounce buffers). On the host (smoke), the process's peak RSS growth.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stop = threading.Event()
        self.alloc_extra = 0
        self.driver_extra = 0

    def __enter__(self) -> DeviceMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._used0 = self._peak = total - free
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._base = status_kb("VmRSS")
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            free, total = torch.cuda.mem_get_info(self.device)
            self._peak = max(self._peak, total - free)

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            finally:
                self._stop.set()
                self._thread.join()
            free, total = torch.cuda.mem_get_info(self.device)
            self._peak = max(self._peak, total - free)
            self.alloc_extra = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            self.driver_extra = max(0, self._peak - self._used0)
        else:
            self.alloc_extra = self.driver_extra = max(0, status_kb("VmHWM") - self._base) * 1024


# -- loaders ----------------------------------------------------------------------------------------


@dataclass
class Loader:
    """One way of filling the destinations; ``run`` returns the bytes it read from the files."""

    name: str
    tp: str
    run: Callable[[], int]
    note: str = ""


@dataclass
class Row:
    cache: str
    loader: str
    tp: str
    seconds: list[float] = field(default_factory=list)
    bytes: int = 0
    alloc_extra: list[int] = field(default_factory=list)
    driver_extra: list[int] = field(default_factory=list)
    mismatches: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.bytes / self.median / GB


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes hold NaNs, which ``torch.equal`` calls unequal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


@dataclass
class Setup:
    """The checkpoint, its destinations on the device and the oracle to check them against."""

    model: str
    device: torch.device
    files: list[str]
    total: int
    dests: dict[str, torch.Tensor]
    tp_requests: list
    tp_dests: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]

    def targets(self, tp: str) -> dict:
        if tp == TP1:
            return dict(self.dests)
        return {r: self.tp_dests[r.result_key] for r in self.tp_requests}

    def clear(self, tp: str) -> None:
        """Zero the destinations, so that a loader that skips a tensor cannot pass the check."""
        for d in (self.dests if tp == TP1 else self.tp_dests).values():
            d.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mismatches(self, tp: str) -> int:
        if tp == TP1:
            return sum(not same_bits(d, self.reference[n]) for n, d in self.dests.items())
        bad = 0
        for r in self.tp_requests:
            want = self.reference[r.name]
            if r.dim is not None:
                want = want.narrow(r.dim, r.start, r.length)
            bad += not same_bits(self.tp_dests[r.result_key], want)
        return bad


def prepare(model: str, device: torch.device) -> Setup:
    """Open the checkpoint's headers, allocate destinations, read the oracle with safetensors."""
    from safetensors import safe_open

    with vllm_fastload.open(model, config={"progress": False}) as ckpt:
        infos = {n: ckpt.info(n) for n in ckpt.keys()}
        files = sorted(ckpt.files)
        total = ckpt.total_bytes
        tp_requests = rank_requests(ckpt.tensors, 2, 1)
    dests = {n: torch.empty(shape_of(i), dtype=dtype_of(i), device=device) for n, i in infos.items()}
    tp_dests = {}
    for r in tp_requests:
        shape = list(shape_of(infos[r.name]))
        if r.dim is not None:
            assert r.length is not None  # rank_requests names every slice's length
            shape[r.dim] = r.length
        tp_dests[r.result_key] = torch.empty(shape, dtype=dtype_of(infos[r.name]), device=device)
    reference = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                # A copy: safetensors' CPU tensors map the file, and mapped pages cannot be evicted.
                reference[name] = f.get_tensor(name).to(device, copy=True)
    return Setup(model, device, files, total, dests, tp_requests, tp_dests, reference)


def fastload_loader(s: Setup, name: str, tp: str, config: FastloadConfig, note: str = "") -> Loader:
    """fastload as the vLLM loader uses it: open, then ``read_into`` the preallocated destinations."""
    targets = s.targets(tp)

    def run() -> int:
        with vllm_fastload.open(s.model, device=s.device, config=config) as ckpt:
            return ckpt.read_into(targets).bytes_read

    return Loader(name, tp, run, note)


def safetensors_loader(s: Setup) -> Loader:
    from safetensors import safe_open

    def run() -> int:
        for path in s.files:
            with safe_open(path, framework="pt", device=str(s.device)) as f:
                for name in f.keys():
                    s.dests[name].copy_(f.get_tensor(name))
        return s.total

    where = "device=" + str(s.device)
    return Loader("safetensors", TP1, run, f"safe_open({where}) + copy_")


def fastsafetensors_loader(s: Setup, gds: bool) -> Loader:
    """fastsafetensors as vLLM drives it: one file at a time into a whole-file device buffer."""
    from fastsafetensors import SafeTensorsFileLoader

    def run() -> int:
        loader = SafeTensorsFileLoader(None, str(s.device), nogds=not gds, debug_log=False)
        try:
            for path in s.files:
                loader.add_filenames({0: [path]})
                buffers = loader.copy_files_to_device()
                try:
                    for name in list(buffers.key_to_rank_lidx):
                        s.dests[name].copy_(buffers.get_tensor(name))
                finally:
                    buffers.close()
                loader.reset()
        finally:
            loader.close()
        return s.total

    return Loader("fastsafetensors", TP1, run, "GDS" if gds else "nogds (pread into bounce buffers)")


def instanttensor_loader(s: Setup) -> Loader:
    """InstantTensor with zero-copy views consumed at once (``copy=False``), all files in one open."""
    import instanttensor

    def run() -> int:
        with instanttensor.safe_open(list(s.files), framework="pt", device=s.device, copy=False) as f:
            for name, tensor in f.tensors():
                s.dests[name].copy_(tensor)
        return s.total

    return Loader("instanttensor", TP1, run, "copy=False, its default I/O backend (O_DIRECT)")


def build_loaders(s: Setup, backends: list[str], anchors: list[str], config: FastloadConfig,
                  gds_active: bool, skipped: dict[str, str]) -> list[Loader]:
    """Every loader that can run here; the reasons for the others go into ``skipped``."""
    loaders: list[Loader] = []
    for backend in backends:
        note = ""
        if backend == "kvikio":
            from vllm_fastload.readers.kvikio import gds_status

            status = gds_status()
            if status["kvikio"] is None:
                skipped["fastload-kvikio"] = str(status["why"])
                continue
            note = f"GDS active: {status['active']} ({status['why']})"
        name = BACKENDS[backend]
        cfg = FastloadConfig.build({**config.model_dump(), **LOADERS[name].config})
        loaders += [fastload_loader(s, name, TP1, cfg, note), fastload_loader(s, name, TP2, cfg, note)]
    for name in anchors:
        try:
            if name == "safetensors":
                loaders.append(safetensors_loader(s))
            elif name == "fastsafetensors":
                loaders.append(fastsafetensors_loader(s, gds_active))
            elif name == "instanttensor":
                loaders.append(instanttensor_loader(s))
        except Exception as exc:  # ImportError, or a library that fails to load its native parts
            skipped[name] = f"not importable: {type(exc).__name__}: {exc}"
    return loaders


# -- the run ------------------------------------------------------------------------------------------


def _say(*parts: object) -> None:
    print(*parts, flush=True)


def _quiet(*parts: object) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; conditions it cannot run under end with one line on stderr and exit code 2."""
    try:
        return _main(args)
    except BenchError as exc:
        print(f"bench-gpu: {exc}", file=sys.stderr, flush=True)
        return 2


@dataclass(frozen=True)
class Options:
    """What the command line asks of one run, checked."""

    smoke: bool
    device: torch.device
    backends: tuple[str, ...]
    anchors: tuple[str, ...]
    spec: ModelSpec
    files: int
    directory: str
    seed: int
    json_path: Path
    threads: int
    block: int
    repeats: int
    time_limit: float


def options(args: argparse.Namespace) -> Options:
    """The run's options; a ``BenchError`` where this machine cannot run them (no CUDA without ``--smoke``)."""
    smoke = bool(args.smoke)
    if smoke:
        device = torch.device("cpu")
        backends, anchors = ("host",), ("safetensors",)
        spec, files, directory = SMOKE_SPEC, 3, args.dir or ".fastload/bench-gpu-smoke"
    else:
        if not torch.cuda.is_available():
            raise BenchError(f"needs a CUDA device, and torch {torch.__version__} sees none "
                             f"(torch.version.cuda={torch.version.cuda}); `--smoke` runs the reduced "
                             "CPU-only form")
        device = torch.device("cuda", torch.cuda.current_device())
        backends = tuple(b for b in args.backends.split(",") if b)
        anchors = tuple(a for a in args.anchors.split(",") if a)
        spec, files = ModelSpec(**LLAMA3_8B, layers=args.layers), args.files
        directory = args.dir or ".fastload/bench-gpu"
    unknown = (set(backends) - set(BACKENDS)) | (set(anchors) - set(ANCHORS))
    if unknown:
        raise BenchError(f"unknown backends or anchors: {', '.join(sorted(unknown))}")
    out = Path(args.out or os.environ.get("OUT") or "bench-results")
    return Options(smoke, device, backends, anchors, spec, files, directory, args.seed,
                   out / ("bench-gpu-smoke.json" if smoke else "bench-gpu.json"),
                   threads=4 if smoke else min(16, max(4, usable_cpus())), block=(1 << 20) if smoke else (16 << 20),
                   repeats=args.repeats, time_limit=float(args.time_limit))


@dataclass
class Run:
    """One run as it goes: what it measured so far, and what it set up to measure it."""

    opts: Options
    config: FastloadConfig
    env: dict
    gds: dict
    setup: Setup
    #: The checkpoint's filesystem and the seconds it took to write (or find) it.
    fs: str
    write_s: float
    started: float
    loaders: list[Loader] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    first_use: dict[str, float] = field(default_factory=dict)
    ev: Eviction = field(default_factory=Eviction)
    rows: dict[tuple[str, str, str], Row] = field(default_factory=dict)
    limits: dict[str, dict] = field(default_factory=dict)
    reps_done: int = 0


def _main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    run = _set_up(options(args), started)
    rep_s = 0.0
    for rep in range(run.opts.repeats):
        elapsed = time.perf_counter() - started
        if rep and elapsed + rep_s > run.opts.time_limit:
            _say(f"time limit: {elapsed:.0f} s used, a repetition takes ~{rep_s:.0f} s; stopping after {rep} of "
                 f"{run.opts.repeats} (--time-limit {run.opts.time_limit:.0f})")
            break
        rep_start = time.perf_counter()
        for cache in ("cold", "warm"):
            _limits(run, cache, rep)
            for loader in list(run.loaders):
                if not _measure(loader, cache, rep, run):
                    run.loaders.remove(loader)
        run.reps_done = rep + 1
        rep_s = time.perf_counter() - rep_start
        # Written after every repetition: a run stopped from outside still leaves its numbers.
        _write(run.opts.json_path, _report(run, say=_quiet))
    if not run.rows:
        raise BenchError("no measurement finished")
    result = _report(run)
    _write(run.opts.json_path, result)
    _say(f"wrote {run.opts.json_path}")
    return 0 if result["correct"] else 1


def _set_up(opts: Options, started: float) -> Run:
    """The checkpoint, its destinations, the loaders that work here (each run once on a small
    checkpoint first), and what the run prints about them."""
    config = FastloadConfig.from_env(progress=False)
    env = _environment(opts.device)
    _say(f"bench-gpu{' --smoke' if opts.smoke else ''}: {env['summary']}")
    from vllm_fastload.readers.kvikio import gds_status

    gds = gds_status() if not opts.smoke else {"kvikio": None, "active": False, "why": "smoke run: no GPU"}
    _say(f"kvikio/GDS: {gds}")
    start = time.perf_counter()
    model = str(write_random_checkpoint(opts.directory, opts.spec, files=opts.files, seed=opts.seed))
    write_s = time.perf_counter() - start
    run = Run(opts, config, env, gds, prepare(model, opts.device), filesystem_of(model), write_s, started)
    spec = opts.spec
    _say(f"checkpoint {model}: {run.setup.total / GB:.2f} GB in {len(run.setup.files)} files "
         f"({spec.layers} layers of hidden {spec.hidden}, intermediate {spec.intermediate}, {spec.heads}/"
         f"{spec.kv_heads} heads, vocab {spec.vocab}, {str(spec.dtype).removeprefix('torch.')}, random bytes); "
         f"written or reused in {write_s:.1f} s; filesystem {run.fs}")
    if run.fs.split()[0] in ("tmpfs", "ramfs"):
        _say("  WARNING: the checkpoint is in memory (tmpfs): 'cold' and 'disk' measure memory, not a disk")
    _say(f"config: threads={config.threads} read_size={config.read_size.human_readable()} "
         f"aggregate={config.aggregate_size.human_readable()} budget={config.memory_budget.human_readable()}")
    loaders = build_loaders(run.setup, list(opts.backends), list(opts.anchors), config, bool(gds["active"]),
                            run.skipped)
    run.loaders = _warm_up(loaders, run)
    _say("first use (warm-up on a 14 MB checkpoint, not in the table): "
         + ", ".join(f"{k} {v:.2f} s" for k, v in run.first_use.items()))
    for name, why in run.skipped.items():
        _say(f"  skipped {name}: {why}")
    run.limits = {"disk": {"gbps": []}, "page_cache": {"gbps": []}, "h2d": {"gbps": []}}
    if opts.device.type != "cuda":
        run.limits["h2d"] = {"gbps": [], "why": "no CUDA device (smoke run on the host)"}
    return run


def _limits(run: Run, cache: str, rep: int) -> None:
    """The limits a repetition's loads of ``cache`` are held against: the disk's rate cold; the page
    cache's and the host-to-device copy's warm."""
    files, threads, block, limits = run.setup.files, run.opts.threads, run.opts.block, run.limits
    if cache == "cold":
        evict(files)
        gbps, method = disk_read_gbps(files, threads, block)
        limits["disk"]["gbps"].append(gbps)
        limits["disk"]["method"] = method
        _say(f"  rep {rep + 1} limit disk read       {gbps:7.2f} GB/s  ({method})")
        return
    gbps = page_cache_gbps(files, threads, block)
    limits["page_cache"]["gbps"].append(gbps)
    limits["page_cache"]["method"] = f"buffered pread from the page cache, {threads} threads"
    _say(f"  rep {rep + 1} limit page cache read {gbps:7.2f} GB/s")
    if run.opts.device.type == "cuda":
        gbps = h2d_gbps(run.opts.device)
        limits["h2d"]["gbps"].append(gbps)
        limits["h2d"]["method"] = "pinned 1 GiB -> device copy_, best of 3"
        _say(f"  rep {rep + 1} limit pinned H2D      {gbps:7.2f} GB/s")


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(path)


def _measure(loader: Loader, cache: str, rep: int, run: Run) -> bool:
    """One timed load; False (and the error in ``run.skipped``) if the loader failed."""
    s = run.setup
    s.clear(loader.tp)
    if cache == "cold":
        # Dropping every cache disturbs anything else running on the machine, so only the GPU run
        # (a machine of its own) may; the smoke run, which also runs on shared machines, may not.
        run.ev.count(make_cold(s.files, drop="leftover" if s.device.type == "cuda" else "never"))
    else:
        warm(s.files, unless_cached=True)
    try:
        with DeviceMemory(s.device) as mem:
            start = time.perf_counter()
            nbytes = loader.run()
            if s.device.type == "cuda":
                torch.cuda.synchronize(s.device)
            seconds = time.perf_counter() - start
    except Exception as exc:
        run.skipped[f"{loader.name} {loader.tp}"] = (f"failed in rep {rep + 1} ({cache}): "
                                                     f"{type(exc).__name__}: {exc}")
        _say(f"  rep {rep + 1} {cache:<4} {loader.name:<16} {loader.tp:<12} FAILED: {type(exc).__name__}: {exc}")
        return False
    bad = s.mismatches(loader.tp)
    row = run.rows.setdefault((cache, loader.name, loader.tp), Row(cache, loader.name, loader.tp))
    row.seconds.append(seconds)
    row.bytes = nbytes
    row.alloc_extra.append(mem.alloc_extra)
    row.driver_extra.append(mem.driver_extra)
    row.mismatches += bad
    _say(f"  rep {rep + 1} {cache:<4} {loader.name:<16} {loader.tp:<12} {seconds:7.3f} s "
         f"{nbytes / seconds / GB:7.2f} GB/s  dev mem +{mem.alloc_extra / 1e6:8.1f} MB "
         f"(driver +{mem.driver_extra / 1e6:8.1f} MB){'  MISMATCHES: ' + str(bad) if bad else ''}")
    return True


def _warm_up(loaders: list[Loader], run: Run) -> list[Loader]:
    """Run every loader once on a small checkpoint, outside the timed runs; return those that worked.

    CUDA, cuFile and library start-up costs (and pinned host memory, which torch caches once
    allocated) are paid once per process by whichever loader comes first and belong to no
    single load; ``run.first_use`` records what each paid here, since a server start pays it too.
    A loader that fails here (a library that imports but cannot run on this machine) is
    reported and left out, not fatal.
    """
    opts, device = run.opts, run.opts.device
    if opts.smoke:
        small, trial = run.setup, loaders
    else:
        tiny = Path(opts.directory).with_name(Path(opts.directory).name + "-warmup")
        small = prepare(str(write_random_checkpoint(tiny, SMOKE_SPEC, files=2, seed=1)), device)
        trial = build_loaders(small, list(opts.backends), list(opts.anchors), run.config, bool(run.gds["active"]),
                              {})
    failed = set()
    for loader in trial:
        try:
            small.clear(loader.tp)
            start = time.perf_counter()
            loader.run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            run.first_use[f"{loader.name} {loader.tp}"] = time.perf_counter() - start
            bad = small.mismatches(loader.tp)
        except Exception as exc:
            run.skipped[f"{loader.name} {loader.tp}"] = f"failed in the warm-up: {type(exc).__name__}: {exc}"
            failed.add((loader.name, loader.tp))
            continue
        if bad:
            _say(f"  warm-up: {loader.name} {loader.tp} got {bad} tensors wrong on the small checkpoint")
    del small, trial
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return [x for x in loaders if (x.name, x.tp) not in failed]


def _environment(device: torch.device) -> dict:
    env: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cpus": usable_cpus(), "machine": platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / GB, 1), cuda=torch.version.cuda)
        env["summary"] = (f"{props.name} ({props.total_memory / GB:.0f} GB), torch {torch.__version__} "
                          f"CUDA {torch.version.cuda}, {usable_cpus()} CPUs, Python {platform.python_version()}")
    else:
        env["summary"] = (f"host only, torch {torch.__version__}, {usable_cpus()} CPUs, "
                          f"Python {platform.python_version()}")
    return env


# -- report -------------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _report(run: Run, say: Callable[..., None] = _say) -> dict:
    """Print the table and the target verdicts (through ``say``); return the JSON document."""
    disk, cache_bw, h2d = (_median(run.limits[k]["gbps"]) for k in ("disk", "page_cache", "h2d"))
    limit = {"cold": min(x for x in (disk, h2d) if x is not None) if disk else None,
             "warm": min(x for x in (cache_bw, h2d) if x is not None) if cache_bw else None}
    s = run.setup
    say(f"\ncheckpoint {s.total / GB:.2f} GB; limits (median): disk {_fmt(disk)} GB/s, page cache {_fmt(cache_bw)} "
        f"GB/s, pinned H2D {_fmt(h2d)} GB/s -> limit cold {_fmt(limit['cold'])}, warm {_fmt(limit['warm'])} GB/s")
    say(f"eviction: {run.ev.note()}")
    out_rows = _table(run.rows, limit, s.total, say)
    verdicts = _verdicts(run, limit)
    print_verdicts(verdicts, say)
    for name, why in run.skipped.items():
        say(f"  skipped {name}: {why}")
    say(f"kvikio: {run.gds.get('why')}; {len(run.loaders)} loaders x {run.reps_done} repetitions x cold/warm in "
        f"{time.perf_counter() - run.started:.0f} s")
    spec = run.opts.spec
    fastload_failed = _fastload_failed(run.skipped)
    return {
        "version": 1, "smoke": run.opts.smoke, "environment": run.env,
        "checkpoint": {"dir": s.model, "bytes": s.total, "files": len(s.files), "filesystem": run.fs,
                       "write_or_reuse_s": run.write_s,
                       "spec": {**spec.__dict__, "dtype": str(spec.dtype)}},
        "config": json.loads(run.config.model_dump_json(exclude={"on_layer_ready"})),
        "gds": run.gds, "limits": {**run.limits, "cold": limit["cold"], "warm": limit["warm"]},
        "eviction": {**asdict(run.ev), "note": run.ev.note()}, "rows": out_rows,
        "loaders": [{"name": x.name, "tp": x.tp, "note": x.note} for x in run.loaders],
        "skipped": run.skipped, "first_use_s": run.first_use, "targets": verdicts, "reps_done": run.reps_done,
        "correct": not sum(r.mismatches for r in run.rows.values()) and not fastload_failed,
        "fastload_failed": fastload_failed, "elapsed_s": time.perf_counter() - run.started,
    }


def _table(rows: dict[tuple[str, str, str], Row], limit: dict, total: int, say: Callable[..., None]) -> list[dict]:
    """Print the rows, cold first; the JSON form of each."""
    say(f"{'cache':<5} {'loader':<16} {'TP':<12} {'read GB':>8} {'median s':>9} {'spread s':>15} {'GB/s':>7} "
        f"{'of limit':>8} {'vs st':>6} {'vs fst':>6} {'vs it':>6} {'dev +MB':>9} {'drv +MB':>9} {'ok':>3}")
    out = []
    for (cache, name, tp), row in sorted(rows.items(), key=lambda kv: (kv[0][0] != "cold", kv[0][1], kv[0][2])):
        refs = {a: rows.get((cache, a, TP1)) for a in ANCHORS}
        vs = {a: row.median / ref.median if ref is not None else None for a, ref in refs.items()}
        of_limit = row.gbps / limit[cache] if limit[cache] else None
        say(f"{cache:<5} {name:<16} {tp:<12} {row.bytes / GB:>8.2f} {row.median:>9.3f} "
            f"{min(row.seconds):>7.3f}-{max(row.seconds):<7.3f} {row.gbps:>7.2f} {_pct(of_limit):>8} "
            f"{_ratio(vs['safetensors']):>6} {_ratio(vs['fastsafetensors']):>6} {_ratio(vs['instanttensor']):>6} "
            f"{max(row.alloc_extra) / 1e6:>9.1f} {max(row.driver_extra) / 1e6:>9.1f} "
            f"{'yes' if not row.mismatches else 'NO':>3}")
        out.append({**asdict(row), "median_s": row.median, "gbps": row.gbps, "of_limit": of_limit,
                    "time_vs": vs, "read_fraction": row.bytes / total})
    say("(vs st/fst/it: median time / the anchor's TP=1 median time, same cache; below 1 is faster. dev: torch "
        "allocator peak beyond the destinations; drv: the driver's used-memory peak beyond the start)")
    return out


def _fastload_failed(skipped: dict[str, str]) -> list[str]:
    """fastload's loads that raised: a failure of the check, not a skipped anchor (a kvikio that
    cannot be imported is skipped before any load and is not counted here)."""
    return sorted(k for k, v in skipped.items() if k.startswith("fastload-") and v.startswith("failed"))


def _verdicts(run: Run, limit: dict) -> list[dict]:
    """Every fastload backend against the limits, the anchors and its own TP=1 time; then the
    run's exactness and how cold its cold repetitions were."""
    rows, budget = run.rows, int(run.config.memory_budget)
    out: list[dict] = []
    for name in sorted({name for (_, name, _) in rows if name.startswith("fastload-")}):
        for cache in ("cold", "warm"):
            out += _backend_verdicts(rows, name, cache, limit[cache], run.skipped)
        tp2 = [r.bytes / run.setup.total for r in rows.values() if r.tp == TP2 and r.loader == name]
        out.append(verdict(f"{name} TP=2 rank 1: bytes read <= 0.55x checkpoint", tp2[-1] if tp2 else None, 0.55,
                           required=False))
        extra = [max(r.alloc_extra) for r in rows.values() if r.loader == name]
        out.append(verdict(f"{name}: device memory beyond destinations <= memory_budget ({budget / 2**20:.0f} MiB)",
                           max(extra) / budget if extra else None, 1.0, "ratio to the budget (torch allocator)",
                           required=False))
    out.append(verdict("every load equals safetensors' CPU read, bit for bit (tensors wrong)",
                       sum(r.mismatches for r in rows.values()), 0))
    failed = _fastload_failed(run.skipped)
    out.append(verdict("no fastload load raised (loaders that failed)", len(failed), 0, ", ".join(failed)))
    if run.ev.failures:
        out.append(verdict("cold repetitions were cold", run.ev.worst_resident, 0.05, run.ev.note()))
    return out


def _backend_verdicts(rows: dict[tuple[str, str, str], Row], name: str, cache: str, cache_limit: float | None,
                      skipped: dict[str, str]) -> list[dict]:
    tp1, tp2 = rows.get((cache, name, TP1)), rows.get((cache, name, TP2))
    out = [verdict(f"{name} TP=1 {cache}: >= 90% of the limit", tp1.gbps / cache_limit
                   if tp1 and cache_limit else None, 0.9, at_least=True, required=False)]
    for a in ("fastsafetensors", "instanttensor"):
        ref = rows.get((cache, a, TP1))
        out.append(verdict(f"{name} TP=1 {cache}: ahead of {a} (time ratio < 1)",
                           tp1.median / ref.median if tp1 and ref else None, 1.0,
                           skipped.get(a, "not measured") if ref is None else "", required=False))
    out.append(verdict(f"{name} TP=2 rank 1 {cache}: time <= 0.6x its TP=1 time",
                       tp2.median / tp1.median if tp2 and tp1 else None, 0.6, required=False))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
