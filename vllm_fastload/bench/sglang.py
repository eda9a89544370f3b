"""``vllm-fastload bench --engine sglang``: real SGLang server starts, fastload against SGLang's loaders.

Every measurement is a fresh ``python -m sglang.launch_server`` (``tools.sglang_server``), stopped
once ready: SGLang's own weight-load time of its slowest rank (its "Load weight end. elapsed" line,
from "Load weight begin": the model's construction is before it, post-processing inside) and the
process's start to ready (``/health`` answering, after SGLang's warm-up request). Loaders are
interleaved within every repetition (each repetition starts with the next loader); the cold rows
drop the checkpoint from the page cache before every start, the warm rows read it in first.

The loaders: fastload (its early reads on, as a user gets them), SGLang's default loader
(``safetensors``: ``--load-format auto``), and the default loader with SGLang's own cold-start aid
(``safetensors-overlap``: ``--startup-weight-load-mode overlap``; it stages the checkpoint's files
while CUDA graphs are captured). SGLang refuses overlap where it cannot run it (it needs CUDA
graphs: not on a CPU); a loader whose start fails is not started again at that TP, and the table
shows why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_fastload.bench.cache import evict, warm
from vllm_fastload.bench.contention import MachineLoad
from vllm_fastload.bench.loaders import LOADERS, check_known
from vllm_fastload.bench.logs import root_cause
from vllm_fastload.bench.machine import MachineState
from vllm_fastload.bench.targets import Target, all_met, by_name, parse_targets, print_verdicts, verdict
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.servers import ServerExited
from vllm_fastload.tools.sglang_server import SMALL_MODEL_FLAGS, SglangServer, sglang_env

#: The loaders measured unless ``--loaders`` says otherwise (``bench.loaders`` says what each is).
SGLANG_LOADERS = ("fastload", "safetensors", "safetensors-overlap")
#: The cold-start targets (a cold start costs what a warm one costs); ratios of medians.
TARGETS = by_name(
    Target("weights-cold-warm", 1.15, "fastload cold / fastload warm, weight load"),
    Target("weights-cold", 0.5, "fastload cold / safetensors cold, weight load"),
    Target("weights-cold-overlap", 0.9, "fastload cold / safetensors-overlap cold, weight load"),
    Target("weights-warm", 1.0, "fastload warm / safetensors warm, weight load"),
    Target("ready-cold", 1.0, "fastload cold / safetensors cold, process start to ready"),
    Target("share-tp2", 0.56, "TP=2: the largest share of the checkpoint a fastload rank read"),
)
#: The ratio targets: name -> fastload's row (cache, loader), the other row, the medians compared.
_RATIOS = {
    "weights-cold-warm": (("cold", "fastload"), ("warm", "fastload"), "load_median"),
    "weights-cold": (("cold", "fastload"), ("cold", "safetensors"), "load_median"),
    "weights-cold-overlap": (("cold", "fastload"), ("cold", "safetensors-overlap"), "load_median"),
    "weights-warm": (("warm", "fastload"), ("warm", "safetensors"), "load_median"),
    "ready-cold": (("cold", "fastload"), ("cold", "safetensors"), "ready_median"),
}


@dataclass(frozen=True)
class Start:
    """One server start's numbers (or why it failed)."""

    #: SGLang's weight-load seconds of its slowest rank.
    load_s: float | None = None
    #: The process's start to ready, seconds.
    ready_s: float | None = None
    #: The share of the checkpoint each fastload rank read, in rank order.
    read_share: tuple[float, ...] = ()
    #: GB of the checkpoint fastload's early reads had read as the load began (None: no early reads).
    early_gb: float | None = None
    #: Seconds a CPU quota held the start back (``--machine quota``; None: no quota).
    throttled_s: float | None = None
    #: The most memory the start's cgroup held at once, page cache included (None: not measured).
    group_peak: int | None = None
    error: str | None = None


def start_once(model: str, loader: str, tp: int, log: Path, prefix: tuple[str, ...] = ()) -> Start:
    """Start SGLang with ``loader`` on ``model`` at ``tp`` (its command behind ``prefix``, a
    ``MachineLoad``'s), stop it once ready; its numbers."""
    env = sglang_env(tp, FASTLOAD_PROGRESS="false")
    server = SglangServer(model, [*(LOADERS[loader].sglang_args or ()), *SMALL_MODEL_FLAGS], tp=tp, log_path=log,
                          env=env, startup_timeout=900)
    server.cmd = [*prefix, *server.cmd]
    try:
        server.start()
    except (ServerExited, TimeoutError):
        return Start(error=f"{root_cause(server.log_text())} (log: {log})")
    finally:
        server.stop()
    parsed = server.start_log()
    if len(parsed.load_s) != tp:
        return Start(error=f"{len(parsed.load_s)} of {tp} ranks logged 'Load weight end' (log: {log})")
    return Start(load_s=max(parsed.load_s.values()), ready_s=server.ready_s,
                 read_share=tuple(parsed.read_share[r] for r in sorted(parsed.read_share)), early_gb=parsed.early_gb)


def run(model: str, tps: list[int], caches: list[str], repeats: int, loaders: list[str], work: Path,
        deadline: float, state: MachineState, load: MachineLoad) -> dict[str, list[Start]]:
    """Every (TP, cache): ``repeats`` interleaved repetitions of every loader, each start in machine
    state ``load``; key ``tp|cache|loader``. The speed of fresh memory is sampled before each
    repetition (every load fills fresh memory)."""
    files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
    results: dict[str, list[Start]] = {}
    for tp in tps:
        failed: dict[str, str] = {}  # loader -> why it does not start at this TP
        for cache in caches:
            for rep in range(repeats):
                if time.monotonic() > deadline:
                    break
                print(f"  tp={tp} {cache} rep {rep + 1}: first touch {state.sample_memory():.2f} GB/s", flush=True)
                for name in loaders[rep % len(loaders):] + loaders[:rep % len(loaders)]:
                    key = f"{tp}|{cache}|{name}"
                    if name in failed:
                        results.setdefault(key, [Start(error=failed[name])])
                        continue
                    if time.monotonic() > deadline:
                        continue
                    if cache == "cold":
                        evict(files)
                    else:
                        warm(files)
                    with load.around() as contention:
                        result = start_once(model, name, tp, work / f"{name}-tp{tp}-{cache}-{rep}.log",
                                            contention.prefix)
                        result = dataclasses.replace(result, throttled_s=contention.throttled_s(),
                                                     group_peak=contention.memory_peak())
                    results.setdefault(key, []).append(result)
                    if result.error is not None:
                        failed[name] = result.error
                        print(f"  tp={tp} {cache:<4} rep {rep + 1} {name:<16} FAILED, not started again at "
                              f"TP={tp}: {result.error}", flush=True)
                        continue
                    share = ", ".join(f"{s:.3f}" for s in result.read_share)
                    print(f"  tp={tp} {cache:<4} rep {rep + 1} {name:<16} weight load {result.load_s:.2f} s, "
                          f"ready {result.ready_s:.1f} s" + (f", read share {share}" if share else "")
                          + (f", early reads {result.early_gb:.2f} GB as the load began"
                             if result.early_gb is not None else "")
                          + (f", held back by the quota {result.throttled_s:.1f} s"
                             if result.throttled_s is not None else "")
                          + (f", group peak {result.group_peak / 2**30:.2f} GiB"
                             if result.group_peak is not None else ""), flush=True)
    return results


def summarize(results: dict[str, list[Start]]) -> list[dict]:
    rows = []
    for key, starts in results.items():
        tp, cache, loader = key.split("|")
        ok = [s for s in starts if s.error is None]
        row: dict = {"tp": int(tp), "cache": cache, "loader": loader, "runs": len(ok)}
        if not ok:
            rows.append({**row, "error": starts[0].error})
            continue
        load = [s.load_s for s in ok if s.load_s is not None]
        ready = [s.ready_s for s in ok if s.ready_s is not None]
        early = [s.early_gb for s in ok if s.early_gb is not None]
        throttled = [s.throttled_s for s in ok if s.throttled_s is not None]
        peaks = [s.group_peak / 2**30 for s in ok if s.group_peak is not None]
        rows.append({**row, "load_s": load, "load_median": statistics.median(load), "ready_s": ready,
                     "ready_median": statistics.median(ready), "read_share": list(ok[-1].read_share),
                     "early_gb_median": statistics.median(early) if early else None,
                     "throttled_median": statistics.median(throttled) if throttled else None,
                     "group_peak_gib": peaks})
    return rows


def _find(rows: list[dict], tp: int, cache: str, loader: str) -> dict | None:
    return next((r for r in rows if r["tp"] == tp and r["cache"] == cache and r["loader"] == loader), None)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: medians (min-max) and ratios to the default loader's."""
    lines = ["| TP | cache | loader | weight load s, slowest rank | vs default | ready s | vs default | "
             "read share per rank | early reads GB at load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['tp']} | {r['cache']} | {r['loader']} |"
        if "error" in r:
            lines.append(f"{head} did not start: {r['error']} | | | | | |")
            continue
        base = _find(rows, r["tp"], r["cache"], "safetensors")
        if base is None or "error" in base or r["loader"] == "safetensors":
            load_vs = ready_vs = "-"
        else:
            load_vs = f"{r['load_median'] / base['load_median']:.2f}x"
            ready_vs = f"{r['ready_median'] / base['ready_median']:.2f}x"
        share = " / ".join(f"{s:.3f}" for s in r["read_share"]) or "-"
        early = "-" if r["early_gb_median"] is None else f"{r['early_gb_median']:.2f}"
        lines.append(f"{head} {r['load_median']:.2f} ({min(r['load_s']):.2f}-{max(r['load_s']):.2f}) | {load_vs} | "
                     f"{r['ready_median']:.1f} ({min(r['ready_s']):.1f}-{max(r['ready_s']):.1f}) | {ready_vs} | "
                     f"{share} | {early} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], tps: list[int], targets: dict[str, float] | None = None) -> list[dict]:
    """Each target (``targets``: name -> limit; all of them by default) at each TP it applies to,
    from the medians in ``rows``. One not measured is missed where ``targets`` asked for it, and
    otherwise says why it was not measured."""
    wanted = targets if targets is not None else {name: t.limit for name, t in TARGETS.items()}
    required = targets is not None
    out = [_ratio(rows, name, limit, tp, required) for tp in tps for name, limit in wanted.items() if name in _RATIOS]
    if "share-tp2" in wanted and (2 in tps or required):
        shares = [s for r in rows if r["tp"] == 2 and r["loader"] == "fastload" for s in r.get("read_share", [])]
        out.append(verdict("share-tp2", max(shares) if shares else None, wanted["share-tp2"],
                           "the largest share of the checkpoint a fastload rank read", tp="tp2", required=required))
    return out


def _ratio(rows: list[dict], name: str, limit: float, tp: int, required: bool) -> dict:
    a, b, field = _RATIOS[name]
    ra, rb = _find(rows, tp, *a), _find(rows, tp, *b)
    missing = [f"{c} {loader}: {r['error'] if r and 'error' in r else 'not run'}"
               for (c, loader), r in ((a, ra), (b, rb)) if r is None or "error" in r]
    if missing:
        return verdict(name, None, limit, "; ".join(missing), tp=f"tp{tp}", required=required)
    assert ra is not None and rb is not None
    label = "ready" if field == "ready_median" else "weight load"
    saved = f", {rb[field] - ra[field]:.2f} s saved" if field == "ready_median" else ""
    return verdict(name, ra[field] / rb[field], limit, f"{label} {ra[field]:.2f} s ({a[0]} {a[1]}) / "
                   f"{rb[field]:.2f} s ({b[0]} {b[1]}){saved}", tp=f"tp{tp}", required=required)


def main(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise SystemExit("bench --engine sglang needs SGLang installed in this environment")
    if args.repeats < 3:
        print(f"note: --repeats {args.repeats}: a smoke run; medians and spreads need >= 3")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model and not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model}: not a checkpoint directory (bench --engine sglang reads local ones)")
    model = args.model or str(write_checkpoint(".fastload/bench-llama", "bench-llama", files=4))
    loaders = args.loaders.split(",") if args.loaders else list(SGLANG_LOADERS)
    check_known(loaders, "sglang", " for --engine sglang")
    wanted = parse_targets(args.targets, TARGETS, where=" for --engine sglang") if args.targets else None
    tps = [int(t) for t in args.tp.split(",")]
    caches = (args.cache or "warm,cold").split(",")
    if not caches or set(caches) - {"warm", "cold"}:
        raise SystemExit(f"--cache {args.cache!r}: expected warm, cold or warm,cold")
    work = Path(args.out) / "sglang-runs"
    work.mkdir(parents=True, exist_ok=True)
    import sglang

    files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    print(f"bench --engine sglang: {model} ({total / 1e9:.2f} GB), SGLang {sglang.__version__}, server starts, "
          f"TP {tps}, {caches}, loaders {loaders}, {args.repeats} interleaved repetition(s)", flush=True)
    load = MachineLoad.parse(getattr(args, "machine", None) or "quiet")
    print(f"  machine: {load.describe()}", flush=True)
    state = MachineState()
    print(f"  disk: {state.sample_disk(files):.2f} GB/s cold sequential read", flush=True)
    results = run(model, tps, caches, args.repeats, loaders, work, time.monotonic() + args.time_limit, state, load)
    state.sample_disk(files)
    rows = summarize(results)
    print()
    print(state.summary())
    print(f"machine: {load.describe()}")
    print("weight load: SGLang's 'Load weight end. elapsed' of the slowest rank; ready: the process's start to "
          "/health answering; medians (min-max)")
    print(table(rows))
    checks = verdicts(rows, tps, wanted)
    print_verdicts(checks)
    out = Path(args.out) / ("bench-sglang.json" if load.kind == "quiet" else
                            f"bench-sglang-{load.name.replace('=', '')}.json")
    out.write_text(json.dumps({"model": model, "checkpoint_bytes": total, "sglang": sglang.__version__,
                               "machine_load": load.name, "rows": rows, "targets": checks, "machine": state.as_dict(),
                               "raw": {k: [asdict(s) for s in v] for k, v in results.items()}}, indent=1))
    print(f"wrote {out}; the servers' logs are in {work}")
    return 0 if wanted is None or all_met(checks) else 1
