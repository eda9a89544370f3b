"""``vllm-fastload bench --engine sglang``: SGLang's ``load_model`` with fastload vs SGLang's default loader.

In-process in rank processes set up as SGLang's scheduler processes are (``tools.sglang_ranks``): no
server (an SGLang server cannot start on a CPU machine without SGLang's CPU kernels). Every
measurement is a fresh set of ``tp`` rank processes that loads the checkpoint once, so each load
finds a fresh process as a server's start does; only ``load_model`` is timed (the model's
construction, reading, post-processing), from a barrier that every rank passes together to the
slowest rank's end. Loaders are interleaved within every repetition (each repetition starts with
the next loader); the cold rows evict the checkpoint from the page cache before every load, the
warm rows read it into the page cache first. fastload runs with early reads off here: in-process
there is no start-up for them to overlap with.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path

from vllm_fastload.bench.machine import evict
from vllm_fastload.tools.checkpoints import write_checkpoint

#: name -> (SGLang load format, --model-loader-extra-config)
LOADERS: dict[str, tuple[str, dict]] = {
    "fastload": ("fastload", {"progress": False, "early_reads": "never"}),
    "default": ("auto", {}),
}


def _rank(rank: int, tp: int, port: int, path: str, load_format: str, extra: dict, dtype: str, out: str) -> None:
    from vllm_fastload.tools import sglang_ranks

    device = sglang_ranks.setup_rank(rank, tp, port)
    result = sglang_ranks.load_timed(path, load_format, extra, dtype, device)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def measure(path: str, tp: int, loader: str, dtype: str, work: Path, timeout: float = 900) -> dict:
    """One load on ``tp`` fresh rank processes: the slowest rank's seconds, and each rank's result."""
    load_format, extra = LOADERS[loader]
    out = Path(work) / f"{loader}-tp{tp}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, tp, port, path, load_format, extra, dtype, str(out)))
             for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    ranks = []
    for r, p in enumerate(procs):
        f = out / f"rank{r}.json"
        if not f.exists():
            raise RuntimeError(f"{loader} at TP={tp}: rank {r} ended without a result (exit code {p.exitcode})")
        ranks.append(json.loads(f.read_text()))
    return {"seconds": max(r["seconds"] for r in ranks), "ranks": ranks}


def _files(path: str) -> list[str]:
    return sorted(str(p) for p in Path(path).glob("*.safetensors"))


def _warm(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def run(path: str, tps: list[int], caches: list[str], repeats: int, dtype: str, work: Path) -> list[dict]:
    """Every (TP, cache) row: ``repeats`` interleaved repetitions of every loader."""
    files = _files(path)
    rows = []
    names = list(LOADERS)
    for tp in tps:
        for cache in caches:
            samples: dict[str, list[dict]] = {n: [] for n in names}
            for rep in range(repeats):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    if cache == "cold":
                        evict(files)
                    else:
                        _warm(files)
                    samples[name].append(measure(path, tp, name, dtype, work))
            for name in names:
                seconds = [m["seconds"] for m in samples[name]]
                reports = [r.get("report") or {} for r in samples[name][-1]["ranks"]]
                share = [r["bytes_read"] / max(r["bytes_total"], 1) for r in reports if "bytes_read" in r]
                rows.append({"tp": tp, "cache": cache, "loader": name, "seconds": seconds,
                             "median": statistics.median(seconds), "read_share": share})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each fastload row with its ratio to the default loader's."""
    default = {(r["tp"], r["cache"]): r["median"] for r in rows if r["loader"] == "default"}
    lines = ["| TP | cache | loader | load_model median s | min - max s | vs default | read share per rank |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["median"] / default[(r["tp"], r["cache"])] if (r["tp"], r["cache"]) in default else None
        share = " / ".join(f"{s:.3f}" for s in r["read_share"]) or "-"
        versus = "-" if ratio is None or r["loader"] == "default" else f"{ratio:.2f}x"
        lines.append(f"| {r['tp']} | {r['cache']} | {r['loader']} | {r['median']:.3f} | {min(r['seconds']):.3f} - "
                     f"{max(r['seconds']):.3f} | {versus} | {share} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise SystemExit("bench --engine sglang needs SGLang installed in this environment")
    if args.repeats < 3:
        print(f"note: --repeats {args.repeats}: a smoke run; medians and spreads need >= 3")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model and not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model}: not a checkpoint directory (bench --engine sglang reads local ones)")
    path = args.model or str(write_checkpoint(".fastload/bench-llama", "bench-llama", files=4))
    tps = [int(t) for t in args.tp.split(",")]
    caches = (args.cache or "warm,cold").split(",")
    work = Path(args.out) / "sglang-runs"
    work.mkdir(parents=True, exist_ok=True)
    import sglang

    print(f"bench --engine sglang: {path}, SGLang {sglang.__version__}, TP {tps}, {caches}, {args.repeats} "
          f"interleaved repetition(s); load_model seconds of the slowest rank", flush=True)
    rows = run(path, tps, caches, args.repeats, "auto", work)
    out = Path(args.out) / f"bench-sglang-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"model": path, "sglang": sglang.__version__, "rows": rows}, indent=1))
    print(table(rows))
    print(f"saved {out}")
    return 0
