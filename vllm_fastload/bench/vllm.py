"""``vllm-fastload bench``: vLLM's ``load_weights`` with fastload vs vLLM's own loaders, one run.

Each measurement is a fresh vLLM start in a subprocess (``bench/start_vllm.py``); inside
each worker ``worker_hooks`` records ``load_weights`` seconds, bytes read and RSS per rank.
Loaders are interleaved within every repetition (each repetition starts with the next
loader); the cold-cache rows evict the checkpoint from the page cache before every start.
``--source sshfs`` serves the checkpoint from a private ``sshd`` on loopback mounted with
``sshfs`` (``bench/netfs.py``): a real network filesystem, where vLLM's answer is its
``prefetch`` load strategy; there the cold rows evict both the server's files and the mount's.
The machine's state (first touch of fresh memory, cold read speed of the disk) is measured
in the same run and printed above the table, and ``--targets`` turns named targets into the
exit status. Two reference rows read no file: ``zerofill`` (writes
zeros into every parameter) is the floor, the cost of touching fresh parameter memory;
``memcopy`` (copies into every parameter from a buffer already in memory) is the floor for a
loader that must deliver the bytes, the best any warm-cache loader could do.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm_fastload
from vllm_fastload.bench.cache import evict, warm
from vllm_fastload.bench.contention import MachineLoad
from vllm_fastload.bench.loaders import LOADERS, RENAMED, check_known, runs_on, why_not
from vllm_fastload.bench.logs import root_cause
from vllm_fastload.bench.machine import MachineState, release_memory
from vllm_fastload.bench.targets import Target, all_met, by_name, print_verdicts, verdict
from vllm_fastload.bench.targets import parse_targets as parse_spec
from vllm_fastload.bench.worker_hooks import timed_env
from vllm_fastload.sources.hub import is_repo_id
from vllm_fastload.tools.checkpoints import write_checkpoint, write_random_checkpoint
from vllm_fastload.tools.processes import remove_logged_cpu_shm
from vllm_fastload.tools.quantize import SCHEMES, quantize_checkpoint
from vllm_fastload.tools.vllm_server import vllm_env
from vllm_fastload.tp_rules import rank_requests

#: The loaders a source measures unless ``--loaders`` says otherwise (``bench.loaders`` says what each is).
SOURCE_LOADERS: dict[str, list[str]] = {
    "local": ["fastload", "fastload-buffered", "safetensors", "safetensors-mt", "runai_streamer", "zerofill",
              "memcopy", "fastsafetensors", "instanttensor"],
    "sshfs": ["fastload", "safetensors", "safetensors-prefetch"],
    "s3": ["fastload", "runai_streamer", "runai_streamer-distributed", "safetensors+download"],
    "hub": ["fastload", "fastload-hub-id", "safetensors", "safetensors-hub-id"],
}
#: Default page-cache states per source: a network filesystem is measured cold (its server's
#: and the client's page cache evicted): a warm client cache would not be a network read.
SOURCE_CACHE = {"local": "warm,cold", "sshfs": "cold", "s3": "cold", "hub": "warm,cold"}


def start_command(model: str, name: str, tp: int, kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """``start_vllm``'s command line for loader ``name``: its load format, extra config and
    ``LLM(...)`` arguments (``kwargs`` added)."""
    loader = LOADERS[name]
    assert loader.vllm_format is not None, f"{name} is no vLLM loader"
    return [sys.executable, "-m", "vllm_fastload.bench.start_vllm", model, loader.vllm_format, str(tp),
            json.dumps(dict(loader.config)) if loader.config else "",
            json.dumps({**loader.vllm_args, **(kwargs or {})})]


def run_once(model: str, loader: str, tp: int, work: Path, cache: str = "", env_extra: dict | None = None,
             prefix: tuple[str, ...] = ()) -> dict:
    """One vLLM start of ``loader`` (its command behind ``prefix``: a ``MachineLoad``'s), timed."""
    probe_dir = Path(tempfile.mkdtemp(dir=work))
    env = timed_env(vllm_env(tp, FASTLOAD_PROGRESS="false", FASTLOAD_DEV_BENCH_CACHE=cache, **(env_extra or {})),
                    probe_dir)
    log = probe_dir / "vllm.log"
    started = time.time()
    try:
        with log.open("wb") as f:
            proc = subprocess.run([*prefix, *start_command(model, loader, tp)], stdout=f, stderr=subprocess.STDOUT,
                                  env=env, timeout=900)
    finally:
        remove_logged_cpu_shm(log)
    return records(probe_dir, started, tp, proc.returncode, [log])


def records(probe: Path, started: float, ranks: int, returncode: int, logs: list[Path]) -> dict:
    """What the timers (``worker_hooks``) recorded in ``probe`` of a start begun at ``started``: each
    rank's record, its ``load_model`` merged in, and the time to ready; or, where the start failed
    or fewer than ``ranks`` ranks recorded a load, an error naming the root cause in its ``logs``."""
    found = sorted((json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))), key=lambda r: r["rank"])
    models = {r["rank"]: r for r in (json.loads(p.read_text()) for p in probe.glob("model*.json"))}
    ready = probe / "ready.json"
    if returncode != 0 or len(found) != ranks or not ready.exists():
        cause = root_cause("".join(log.read_text(errors="replace") for log in logs))
        return {"error": f"exit {returncode}, {len(found)} rank records: {cause} "
                         f"(log{'s' if len(logs) > 1 else ''}: {', '.join(map(str, logs))})"}
    for r in found:
        r.update({k: v for k, v in models.get(r["rank"], {}).items() if k != "rank"})
    return {"ranks": found, "ready_s": json.loads(ready.read_text())["ready_at"] - started}


def _start_s3(model: str, env: dict[str, str], *, name: str, tp: int, work: Path, cache: str,
              prefix: tuple[str, ...]) -> dict:
    return run_once(model, name, tp, work, cache, env, prefix)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "report", None):
        return report(Path(args.report), args.targets)
    source = getattr(args, "source", "local") or "local"
    wanted_targets = parse_targets(args.targets, source)  # a typo fails before minutes of set-up
    if source == "sshfs":
        from vllm_fastload.bench.netfs import sshfs_mount

        local = args.model or str(write_checkpoint(".fastload/netfs-llama", "netfs-llama", files=4))
        options = tuple(o for o in (args.sshfs_options or "").split(",") if o)
        with sshfs_mount(local, options=options) as mountpoint:
            print(f"sshfs: {local} served by a private sshd on loopback, mounted at {mountpoint}"
                  f" (options: {', '.join(options) or 'defaults'})", flush=True)
            return run_bench(args, str(mountpoint), source, wanted_targets,
                             server_files=sorted(str(p) for p in Path(local).glob("*.safetensors")))
    if source == "s3":
        from vllm_fastload.bench.s3bench import S3Bench

        local = Path(args.model or write_checkpoint(".fastload/netfs-llama", "netfs-llama", files=4))
        tps = [int(t) for t in args.tp.split(",")]
        with S3Bench(local, ranks=max(tps), work=Path(args.out) / "s3-copies") as s3:
            return run_bench(args, s3.uri, source, wanted_targets, s3=s3)
    if source == "hub" or _hub_id(args.model):
        from vllm_fastload.bench.hubbench import hub_checkpoint

        if not _hub_id(args.model):
            raise SystemExit("--source hub needs --model org/name (a Hugging Face Hub id)")
        wanted_targets = parse_targets(args.targets, "hub")
        with hub_checkpoint(args.model, stand_in=getattr(args, "stand_in_hub", False)) as hub:
            print(f"hub id {hub.repo_id}, served by {hub.served_by}; its cached snapshot {hub.snapshot}", flush=True)
            return run_bench(args, hub.snapshot, "hub", wanted_targets, hub=hub)
    return run_bench(args, bench_checkpoint(args.model), source, wanted_targets)


def _hub_id(model: str | None) -> bool:
    """Whether ``--model`` is a Hub id (``org/name``; a preset or a path is not)."""
    return model is not None and "/" in model and is_repo_id(model)


def bench_checkpoint(model: str | None) -> str:
    """``--model``: a directory, or a preset made under ``.fastload/`` on first use (random bytes
    for the 6.46 GB one: normal draws would take minutes to write; ``bench-llama-SCHEME``: the
    1.67 GB one quantized, for what post-processing costs per scheme)."""
    if model in (None, "bench-llama"):
        return str(write_checkpoint(".fastload/bench-llama", "bench-llama", files=4))
    if model == "bench-llama-6g":
        return str(write_random_checkpoint(".fastload/bench-llama-6g", model, files=4))
    if model.startswith("bench-llama-"):
        scheme = model.removeprefix("bench-llama-")
        if scheme not in SCHEMES:
            raise SystemExit(f"--model {model}: no such preset; presets: bench-llama, bench-llama-6g, "
                             + ", ".join(f"bench-llama-{s}" for s in SCHEMES))
        base = write_checkpoint(".fastload/bench-llama", "bench-llama", files=4)
        return str(quantize_checkpoint(base, Path(".fastload") / model, scheme))
    return model


def select_loaders(source: str, loaders: str | None) -> tuple[list[str], dict[str, str]]:
    """The loaders to measure, in the table's order: ``--loaders`` if given, else the source's
    defaults, of those that run here; and why each other one asked for does not."""
    import torch

    wanted = loaders.split(",") if loaders else SOURCE_LOADERS[source]
    check_known(wanted, "vllm")
    cuda = torch.cuda.is_available()
    names, skipped = [], {}
    for name in (n for n in runs_on("vllm") if n in wanted):
        why = why_not(LOADERS[name], cuda)
        if why is None:
            names.append(name)
        else:
            skipped[name] = why
    downloads = [n for n in names if LOADERS[n].download]
    if source != "s3" and downloads:
        raise SystemExit(f"{', '.join(downloads)} needs --source s3 (it downloads the checkpoint from the store)")
    hub_ids = sorted(n for n in names if LOADERS[n].hub_id)
    if source != "hub" and hub_ids:
        raise SystemExit(f"{', '.join(hub_ids)}: need --model org/name (a Hub id)")
    return names, skipped


@dataclass(frozen=True)
class Source:
    """Where the loaders read the checkpoint from, and what a cold start evicts."""

    name: str
    #: What the loaders are given: a directory, an sshfs mount, an object URI, a Hub id's snapshot.
    model: str
    #: The checkpoint's files as the loaders see them (none for an object store).
    files: tuple[str, ...]
    #: The files behind a network mount or an object store: evicted too before a cold start (the
    #: server's page cache is the network filesystem's disk).
    server_files: tuple[str, ...]
    total: int
    #: A ``bench.s3bench.S3Bench`` when ``model`` is an object URI.
    s3: Any = None
    #: A ``bench.hubbench.HubCheckpoint`` when ``model`` is a Hub id's snapshot (the ``-hub-id``
    #: loaders are given the id).
    hub: Any = None

    def start(self, name: str, tp: int, work: Path, cache: str, prefix: tuple[str, ...] = ()) -> dict:
        """One vLLM start of loader ``name`` (behind ``prefix``, see ``run_once``)."""
        if self.hub is not None:
            return run_once(self.hub.repo_id if LOADERS[name].hub_id else self.model, name, tp, work, cache,
                            self.hub.env, prefix)
        if self.s3 is not None:
            return self.s3.run(name, tp, functools.partial(_start_s3, name=name, tp=tp, work=work, cache=cache,
                                                           prefix=prefix))
        return run_once(self.model, name, tp, work, cache, prefix=prefix)

    def sample_limit(self, state: MachineState) -> float:
        """What the storage serves cold: the object store's limit, or the disk's (the mount's) read rate."""
        if self.server_files:
            evict(self.server_files)
        return self.s3.sample_limit() if self.s3 is not None else state.sample_disk(self.files)


def run_bench(args: argparse.Namespace, model: str, source: str, wanted_targets: dict[str, float],
              server_files: list[str] | None = None, s3=None, hub=None) -> int:
    """Measure every loader on ``model`` (see ``Source`` for ``server_files``, ``s3`` and ``hub``)."""
    files = () if s3 is not None else tuple(sorted(str(p) for p in Path(model).glob("*.safetensors")))
    where = Source(source, model, files, tuple(s3.server_files() if s3 is not None else server_files or ()),
                   s3.checkpoint_bytes if s3 is not None else sum(Path(f).stat().st_size for f in files), s3, hub)
    names, skipped = select_loaders(source, args.loaders)
    tps = [int(t) for t in args.tp.split(",")]
    caches = (args.cache or SOURCE_CACHE[source]).split(",")
    if not caches or set(caches) - {"warm", "cold"}:
        raise SystemExit(f"--cache {args.cache!r}: expected warm, cold or warm,cold")
    from vllm_fastload.machine import filesystem_type

    fstype = filesystem_type(files[0]) if files else "s3rver" if s3 is not None else ""
    print(f"checkpoint {model} ({fstype or 'unknown filesystem'}): {where.total / 1e9:.2f} GB; loaders {names}; "
          f"skipped {skipped}")
    load = MachineLoad.parse(getattr(args, "machine", None) or "quiet")
    print(f"  machine: {load.describe()}", flush=True)
    state = MachineState()
    limit = where.sample_limit(state)
    if s3 is not None:
        print(f"  object store: {limit:.2f} GB/s, parallel ranged GETs of every object into memory", flush=True)
    else:
        what = "network filesystem, 4 threads" if where.server_files else "disk"
        print(f"  {what}: {limit:.2f} GB/s cold sequential read", flush=True)
    if args.release_memory:
        speed = release_memory(args.release_memory)
        print(f"  touched and released {args.release_memory:g} GiB of memory at {speed:.2f} GB/s, "
              "waited for it to go back to the host", flush=True)
    work = Path(args.out) / "vllm-runs"
    work.mkdir(parents=True, exist_ok=True)
    results, stopped_early = _repetitions(where, names, tps, caches, args.repeats, work, state,
                                          time.monotonic() + args.time_limit, load)
    where.sample_limit(state)
    verdicts = _report_run(where, results, state, wanted_targets, Path(args.out),
                           {"filesystem": fstype, "skipped": skipped, "stopped_early": stopped_early,
                            "machine": load})
    return 0 if all_met(verdicts) else 1


def _repetitions(where: Source, names: list[str], tps: list[int], caches: list[str], repeats: int, work: Path,
                 state: MachineState, deadline: float, load: MachineLoad) -> tuple[dict[str, list[dict]], bool]:
    """Every (TP, cache): ``repeats`` interleaved repetitions of every loader, until ``deadline``,
    each start in machine state ``load``; the starts' results by ``tpN|cache|loader``, and whether
    the deadline cut them short."""
    results: dict[str, list[dict]] = {}
    stopped_early = False
    for tp in tps:
        for cache in caches:
            for rep in range(repeats):
                print(f"  tp={tp} {cache} rep {rep + 1}: first touch {state.sample_memory():.2f} GB/s", flush=True)
                # Each repetition starts with the next loader: a VM's memory gets faster to touch
                # within a run of starts, and no loader should always go first.
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    if time.monotonic() > deadline:
                        stopped_early = True
                        break
                    # The references read no file, but a cold row still tells something: the
                    # start follows the eviction of the checkpoint, whose pages a VM may hand
                    # back to its host (slow to touch again) or the guest may reuse (fast).
                    if cache == "cold":
                        evict(where.files + where.server_files)
                    else:
                        warm(where.files)  # a cold row may have evicted them
                    with load.around() as contention:
                        res = where.start(name, tp, work, cache, contention.prefix)
                        counted = {"throttled_s": contention.throttled_s(), "group_peak": contention.memory_peak()}
                    res.update({k: v for k, v in counted.items() if v is not None})
                    results.setdefault(f"tp{tp}|{cache}|{name}", []).append(res)
                    _print_start(f"  tp={tp} {cache:<4} rep {rep + 1}", name, res)
    return results, stopped_early


def _print_start(head: str, name: str, res: dict) -> None:
    if "error" in res:
        print(f"{head} {name}: FAILED {res['error']}", flush=True)
        return
    secs = ", ".join(f"{r['seconds']:.2f}" for r in res["ranks"])
    served = res.get("served_per_rank")
    throttled = f"; held back by the quota {res['throttled_s']:.1f} s" if "throttled_s" in res else ""
    ready = f"; ready {res['ready_s']:.1f} s" if "ready_s" in res else ""
    print(f"{head} {name:<20} load_weights per rank {secs} s{ready}{throttled}"
          + (f" (incl. download {res['download_seconds']:.2f} s)" if "download_seconds" in res else "")
          + (f"; served per rank {', '.join(f'{b / 1e9:.3f}' for b in served)} GB" if served else ""), flush=True)


def _report_run(where: Source, results: dict[str, list[dict]], state: MachineState, wanted: dict[str, float],
                out: Path, facts: dict) -> list[dict]:
    """Print the tables and verdicts, write the JSON document and the chart; the verdicts."""
    rows = summarize(results, where.total)
    load: MachineLoad = facts["machine"]
    print()
    print(state.summary())
    print(f"machine: {load.describe()}")
    if where.s3 is not None:
        print(where.s3.summary())
        for row in rows:
            row["server_limit_gbps"] = statistics.median(where.s3.limits)
    print_table(rows)
    bounds = {"disk_gbps": statistics.median(state.disk) if state.disk else None,
              "page_share_tp2": page_rounded_share(where.model, 2) if where.name == "local" else None}
    verdicts = check_targets(rows, wanted, bounds)
    print_verdicts(verdicts)
    stem = "bench-vllm" if where.name == "local" else f"bench-vllm-{where.name}"
    stem += "" if load.kind == "quiet" else f"-{load.name.replace('=', '')}"
    (out / f"{stem}.json").write_text(json.dumps({
        "source": where.name, "filesystem": facts["filesystem"], "checkpoint_bytes": where.total,
        "server_limit_gbps": where.s3.limits if where.s3 is not None else None, "rows": rows, "raw": results,
        "machine": state.as_dict(), "targets": verdicts, "bounds": bounds, "skipped": facts["skipped"],
        "stopped_early": facts["stopped_early"], "machine_load": load.name}, indent=2))
    chart(rows, out / f"{stem}.png",
          title=f"vLLM load_weights by loader, checkpoint on {facts['filesystem'] or where.name}")
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}"
          + (" (time limit reached: some runs skipped)" if facts["stopped_early"] else ""))
    return verdicts


def report(path: Path, targets: str | None) -> int:
    """Print a saved run's tables again and judge it on ``targets`` (``--report``): a run takes
    half an hour, a question about it should not."""
    try:
        saved = json.loads(path.read_text())
        rows, source = saved["rows"], saved["source"]
        for row in rows:  # a saved run may name a loader otherwise
            row["loader"] = RENAMED.get(row["loader"], row["loader"])
        bounds = saved.get("bounds")
        if bounds is None:  # a run saved before its bounds were: the disk speed it measured
            disk = (saved.get("machine") or {}).get("disk_read_gbps") or []
            bounds = {"disk_gbps": statistics.median(disk)} if disk else None
        print(f"{path}: {source} run, {saved.get('checkpoint_bytes', 0) / 1e9:.2f} GB checkpoint"
              + (", stopped early by its time limit" if saved.get("stopped_early") else ""))
        print_table(rows)
        verdicts = check_targets(rows, parse_targets(targets, source), bounds)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"--report {path}: not a JSON file written by vllm-fastload bench ({exc!r})") from None
    print_verdicts(verdicts)
    return 0 if all_met(verdicts) else 1


def summarize(results: dict[str, list[dict]], total: int) -> list[dict]:
    rows = []
    for key, runs in results.items():
        tp, cache, name = key.split("|")
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append({"tp": tp, "cache": cache, "loader": name, "error": runs[0]["error"][:300]})
            continue
        rows.append({"tp": tp, "cache": cache, "loader": name, "runs": len(ok), "failed_runs": len(runs) - len(ok),
                     **_times(ok), **_per_rank(ok), "checkpoint_bytes": total})
    for row in rows:
        if "error" not in row:
            _compare(row, _row(rows, row["tp"], row["cache"], "safetensors"), _row(rows, row["tp"], "warm", FLOOR))
    return rows


def _times(ok: list[dict]) -> dict:
    """load_weights of the slowest rank; what users wait for: load_model (slowest rank), of it vLLM's
    post-processing, and the process start to the engine constructed."""
    per_rank_max = [max(r["seconds"] for r in run["ranks"]) for run in ok]
    return {"seconds_median": statistics.median(per_rank_max), "seconds_min": min(per_rank_max),
            "seconds_max": max(per_rank_max),
            **_medians("load_model_s", [max(r.get("load_model_s", 0.0) for r in run["ranks"]) for run in ok]),
            **_medians("post_s", [max(r.get("post_s", 0.0) for r in run["ranks"]) for run in ok]),
            **_medians("ready_s", [run["ready_s"] for run in ok if "ready_s" in run]),
            **_medians("throttled_s", [run["throttled_s"] for run in ok if "throttled_s" in run]),
            **_medians("group_peak", [run["group_peak"] / 2**30 for run in ok if "group_peak" in run])}


def _per_rank(ok: list[dict]) -> dict:
    """The bytes and memory of the busiest rank; fastload's phases and what it found cached."""
    ranks = [r for run in ok for r in run["ranks"]]
    out = {"rchar_per_rank": max(r["rchar"] for r in ranks), "disk_read_per_rank": max(r["read_bytes"] for r in ranks),
           "peak_rss_mb": max(r["hwm_after_kb"] for r in ranks) / 1024}
    phases = [r["phases"] for r in ranks if r.get("phases")]
    if phases:  # fastload's split of load_weights, median over runs and ranks, per phase
        out["phases_median"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    cached = [r["cached"] for r in ranks if r.get("cached") is not None]
    if cached:  # the share of the checkpoint in the page cache as a rank's load began
        out["cached_min"] = min(cached)
    served = [b for run in ok for b in run.get("served_per_rank", [])]
    if served:
        out["served_per_rank"] = max(served)
    return out


def _compare(row: dict, base: dict | None, floor: dict | None) -> None:
    """Add the row's ratios to the default loader's row and to the floor."""
    row["vs_safetensors"] = row["seconds_median"] / base["seconds_median"] if base else None
    row["vs_floor"] = row["seconds_median"] / floor["seconds_median"] if floor else None
    for stem in ("load_model", "ready"):
        if base and f"{stem}_median" in row and base.get(f"{stem}_median"):
            row[f"{stem}_vs_safetensors"] = row[f"{stem}_median"] / base[f"{stem}_median"]


def _medians(key: str, values: list[float]) -> dict[str, float]:
    """``key_median``, ``key_min`` and ``key_max`` over the runs (nothing if none measured it)."""
    if not values:
        return {}
    stem = key.removesuffix("_s")
    return {f"{stem}_median": statistics.median(values), f"{stem}_min": min(values), f"{stem}_max": max(values)}


def _row(rows: list[dict], tp: str, cache: str, loader: str) -> dict | None:
    return next((r for r in rows if r["tp"] == tp and r["cache"] == cache and r["loader"] == loader
                 and "error" not in r), None)


def print_table(rows: list[dict]) -> None:
    served = any("served_per_rank" in r for r in rows)
    print(f"\n{'tp':<4}{'cache':<6}{'loader':<27}{'median s':>9}{'min s':>7}{'max s':>7}{'n':>3}{'vs default':>11}"
          f"{'vs floor':>9}{'read/rank GB':>13}{'disk/rank GB':>13}{'peak RSS MB':>12}"
          + (f"{'served/rank GB':>15}" if served else ""))
    for r in rows:
        if "error" in r:
            print(f"{r['tp'][2:]:<4}{r['cache']:<6}{r['loader']:<27} FAILED: {r['error']}")
            continue
        vs = f"{r['vs_safetensors']:.2f}x" if r.get("vs_safetensors") else "-"
        fl = f"{r['vs_floor']:.2f}x" if r.get("vs_floor") else "-"
        sv = f"{r['served_per_rank'] / 1e9:>15.3f}" if "served_per_rank" in r else f"{'-':>15}" if served else ""
        print(f"{r['tp'][2:]:<4}{r['cache']:<6}{r['loader']:<27}{r['seconds_median']:>9.2f}{r['seconds_min']:>7.2f}"
              f"{r['seconds_max']:>7.2f}{r['runs']:>3}{vs:>11}{fl:>9}{r['rchar_per_rank'] / 1e9:>13.2f}"
              f"{r['disk_read_per_rank'] / 1e9:>13.2f}{r['peak_rss_mb']:>12.0f}{sv}")
    print("median/min/max: load_weights of the slowest rank over n runs; vs: ratio of medians (floor: the warm "
          "zero-fill row); read/rank: bytes through read calls (mmap page faults are not counted there); "
          "disk/rank: bytes fetched from storage"
          + ("; served/rank: bytes the object store served each rank (counted by a proxy in front of it); "
             "safetensors+download: load_weights plus the download of the local copy" if served else ""))
    print_wait_table(rows)
    print_memory_table(rows)
    print_phase_table(rows)


def print_memory_table(rows: list[dict]) -> None:
    """The memory a start held (its group's peak, page cache included; each rank's peak RSS) and,
    under a CPU quota, how long the quota held it back."""
    measured = [r for r in rows if "group_peak_median" in r]
    if not measured:
        return
    quota = any("throttled_median" in r for r in measured)
    print(f"\n{'tp':<4}{'cache':<6}{'loader':<27}{'group peak GiB':>15}{'min-max':>12}{'peak RSS/rank MB':>17}"
          + (f"{'held back s':>12}{'min-max':>12}" if quota else ""))
    for r in measured:
        held = (f"{r['throttled_median']:>12.1f}{r['throttled_min']:>6.1f}-{r['throttled_max']:<5.1f}"
                if "throttled_median" in r else "")
        print(f"{r['tp'][2:]:<4}{r['cache']:<6}{r['loader']:<27}{r['group_peak_median']:>15.2f}"
              f"{r['group_peak_min']:>6.2f}-{r['group_peak_max']:<5.2f}{r['peak_rss_mb']:>17.0f}{held}")
    print("group peak: the most memory the start's own cgroup held at once (every process of the start and the "
          "page cache they read in, as a container's limit counts it), medians and min-max over the runs; peak "
          "RSS: the largest rank's" + ("; held back: time the CPU quota throttled the start" if quota else ""))


def print_wait_table(rows: list[dict]) -> None:
    """What users wait for: vLLM's ``load_model`` and the process start to the engine constructed."""
    measured = [r for r in rows if "load_model_median" in r]
    if not measured:
        return
    print(f"\n{'tp':<4}{'cache':<6}{'loader':<27}{'load_model s':>13}{'min-max':>12}{'post s':>8}{'vs default':>11}"
          f"{'ready s':>9}{'min-max':>13}{'vs default':>11}")
    for r in measured:
        lm_vs = f"{r['load_model_vs_safetensors']:.2f}x" if r.get("load_model_vs_safetensors") else "-"
        rd_vs = f"{r['ready_vs_safetensors']:.2f}x" if r.get("ready_vs_safetensors") else "-"
        ready = (f"{r['ready_median']:>9.1f}{r['ready_min']:>6.1f}-{r['ready_max']:<6.1f}" if "ready_median" in r
                 else f"{'-':>9}{'':>13}")
        print(f"{r['tp'][2:]:<4}{r['cache']:<6}{r['loader']:<27}{r['load_model_median']:>13.2f}"
              f"{r['load_model_min']:>6.2f}-{r['load_model_max']:<5.2f}{r['post_median']:>8.3f}{lm_vs:>11}"
              f"{ready}{rd_vs:>11}")
    print("load_model: vLLM's BaseModelLoader.load_model on the slowest rank (model init, load_weights, "
          "post-processing); post: of it process_weights_after_loading; ready: the bench starting the process "
          "to vLLM's LLM(...) returning (medians, min-max over the runs; vs default: ratio of medians)")


def print_phase_table(rows: list[dict]) -> None:
    """Where fastload's ``load_weights`` goes (the phases of its rank log line), per row that has them."""
    measured = [r for r in rows if r.get("phases_median")]
    if not measured:
        return
    names = list(dict.fromkeys(k for r in measured for k in r["phases_median"]))
    print(f"\n{'tp':<4}{'cache':<6}{'loader':<27}{'load_weights s':>15}"
          + "".join(f"{n + ' s':>10}" for n in names) + f"{'cached':>8}")
    for r in measured:
        phases = r["phases_median"]
        cached = f"{r['cached_min']:.2f}" if "cached_min" in r else "-"
        print(f"{r['tp'][2:]:<4}{r['cache']:<6}{r['loader']:<27}{r['seconds_median']:>15.3f}"
              + "".join(f"{phases[n]:>10.3f}" if n in phases else f"{'-':>10}" for n in names) + f"{cached:>8}")
    print("load_weights: of the slowest rank, as in the first table; phases: fastload's load_weights as its rank "
          "log line splits it, medians over runs and ranks (so they need not add up to it). probe: opening the "
          "checkpoint and asking the page cache what it holds, then, on the per-rank path, learning the model's "
          "writes; plan: this rank's reads; check: the plan's checks; read: reading into the parameters (at TP>1 "
          "with the ranks' agreement on sharing row reads; on the path through the model's load_weights, that "
          "load_weights); replay: of it, copies made by the model's own slicing; post: post-processing per layer "
          "(post_per_layer); cached: the smallest share of the checkpoint in the page cache as a rank's load "
          "began; -: not a phase of that row's path")


# -- targets -------------------------------------------------------------------------------
FLOOR = "zerofill"
#: Ratios of medians unless said otherwise.
TARGETS = by_name(
    Target("cold-tp1", 0.75, "TP=1 cold: fastload / default loader"),
    Target("cold-tp2", 0.60, "TP=2 cold: fastload / default loader"),
    Target("warm-floor", 1.10, "TP=1 warm: fastload / zero-fill floor (at TP=2: weights-warm-tp2)"),
    Target("warm-default", 0.0, "warm, every TP: fastload median - default median, at most the larger spread "
                                "(max-min) of the two rows plus this many seconds"),
    Target("disk-tp2", 0.56, "TP=2: disk bytes per rank / checkpoint bytes, every cache state"),
    Target("netfs-default", 0.70, "network filesystem (--source sshfs), every TP, cold: fastload / default loader"),
    Target("s3-bytes-tp2", 0.60, "object store, TP=2: bytes served per rank (server side) / checkpoint"),
    Target("s3-runai-tp2", 0.60, "object store, TP=2: fastload / runai_streamer"),
    Target("s3-runai-tp1", 1.00, "object store, TP=1: fastload / runai_streamer"),
    Target("s3-limit-tp1", 1.25, "object store, TP=1: fastload seconds / the seconds the server's own limit "
                                 "allows (1.25: at least 80% of the limit)"),
    Target("netfs-prefetch", 1.00, "network filesystem (--source sshfs), every TP, cold: fastload / the default "
                                   "loader's prefetch strategy"),
    # What users wait for: vLLM's load_model and the time to ready, not load_weights alone.
    Target("model-cold-warm", 1.15, "every TP: fastload's cold load_model / its own warm load_model"),
    Target("model-cold-tp1", 0.65, "TP=1 cold: fastload / default loader, load_model"),
    Target("model-cold-tp2", 0.70, "TP=2 cold: fastload / default loader, load_model"),
    Target("model-warm", 1.00, "warm, every TP: fastload / default loader, load_model"),
    Target("ready-cold", 1.00, "cold, every TP: fastload / default loader, process start to engine ready"),
    Target("weights-warm-tp2", 1.00, "TP=2 warm: fastload / default loader, load_weights (at TP=2 the copy out "
                                     "of the page cache on the rank's core is the floor, not the zero-fill)"),
    Target("hub-cold", 1.10, "--model org/name, cold, every TP: fastload given the Hub id / fastload given its "
                             "cached snapshot as a directory, load_model"),
)
#: Targets that ``--targets all`` means for each source (the others need rows it does not measure).
SOURCE_TARGETS = {"local": ["cold-tp1", "cold-tp2", "warm-floor", "warm-default", "disk-tp2", "model-cold-warm",
                            "model-cold-tp1", "model-cold-tp2", "model-warm", "ready-cold", "weights-warm-tp2"],
                  "sshfs": ["netfs-default", "netfs-prefetch"],
                  "s3": ["s3-bytes-tp2", "s3-runai-tp2", "s3-runai-tp1", "s3-limit-tp1"],
                  "hub": ["hub-cold"]}
_UNMEASURED = "rows not measured"


def parse_targets(spec: str | None, source: str = "local") -> dict[str, float]:
    """``--targets all`` (this source's targets) or ``cold-tp1,disk-tp2=0.55``: names from TARGETS,
    optional own limits."""
    return parse_spec(spec, TARGETS, SOURCE_TARGETS[source])


def page_rounded_share(model: str, tp: int) -> float:
    """The largest share of the checkpoint one rank must fetch from disk at this TP: its slices
    (by the Llama layout of ``tp_rules``) rounded out to whole pages, the page cache's unit."""
    page = mmap.PAGESIZE
    with vllm_fastload.open(model, config=vllm_fastload.FastloadConfig(progress=False)) as ckpt:
        shares = []
        for rank in range(tp):
            pages: set[tuple[str, int]] = set()
            for t in ckpt.plan(rank_requests(ckpt.tensors, tp, rank)).tensors:
                for offset, length in t.ranges:
                    pages.update((t.info.file, p) for p in range(offset // page, -(-(offset + length) // page)))
            shares.append(len(pages) * page / ckpt.total_bytes)
    return max(shares)


def check_targets(rows: list[dict], targets: dict[str, float],
                  bounds: Mapping[str, float | None] | None = None) -> list[dict]:
    """One verdict per target and TP it applies to; a target whose rows were not measured is missed.

    ``bounds`` (disk GB/s measured in the run, page-rounded share per rank) add the physical
    floor to the detail, so a target below it reads as such rather than as a loader to tune."""
    known: dict[str, Any] = dict(bounds or {})
    return [v for name, limit in targets.items() for v in _JUDGES[name](rows, name, limit, known)]


def _fastload_tps(rows: list[dict]) -> list[str]:
    """The TPs fastload was run at (a target judged at every TP), or a placeholder that reads as
    not measured."""
    return sorted({r["tp"] for r in rows if r["loader"] == "fastload"}) or ["tp?"]


def _ratio(name: str, limit: float, tp: str, fl: dict | None, base: dict | None, detail: str,
           key: str = "seconds_median") -> dict:
    """``fl[key] / base[key]``, or not measured where a row is missing."""
    if not (fl and base and fl.get(key) and base.get(key)):
        return verdict(name, None, limit, _UNMEASURED, tp=tp)
    return verdict(name, fl[key] / base[key], limit, detail, tp=tp)


def _cold(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    tp = "tp" + name[-1]
    fl, base = _row(rows, tp, "cold", "fastload"), _row(rows, tp, "cold", "safetensors")
    detail = "fastload / default, cold"
    if fl and base and known.get("disk_gbps"):
        # Every byte of the checkpoint comes off the one disk once, whatever the ranks share.
        floor = fl["checkpoint_bytes"] / 1e9 / known["disk_gbps"]
        detail += (f"; the disk alone needs {floor:.2f} s for the checkpoint at "
                   f"{known['disk_gbps']:.2f} GB/s = {floor / base['seconds_median']:.2f}x default")
    return [_ratio(name, limit, tp, fl, base, detail)]


def _netfs(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    other = "safetensors" if name == "netfs-default" else "safetensors-prefetch"
    return [_ratio(name, limit, tp, _row(rows, tp, "cold", "fastload"), _row(rows, tp, "cold", other),
                   f"fastload / {other}, cold") for tp in _fastload_tps(rows)]


def _s3_bytes(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    fl = _row(rows, "tp2", "cold", "fastload")
    if not (fl and "served_per_rank" in fl):
        return [verdict(name, None, limit, _UNMEASURED, tp="tp2")]
    return [verdict(name, fl["served_per_rank"] / fl["checkpoint_bytes"], limit, "served per rank / checkpoint",
                    tp="tp2")]


def _s3_runai(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    tp = "tp" + name[-1]
    return [_ratio(name, limit, tp, _row(rows, tp, "cold", "fastload"), _row(rows, tp, "cold", "runai_streamer"),
                   "fastload / runai_streamer")]


def _s3_limit(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    fl = _row(rows, "tp1", "cold", "fastload")
    gbps = fl.get("server_limit_gbps") if fl else None
    if not (fl and gbps):
        return [verdict(name, None, limit, _UNMEASURED, tp="tp1")]
    return [verdict(name, fl["seconds_median"] / (fl["checkpoint_bytes"] / 1e9 / gbps), limit,
                    f"server limit {gbps:.3f} GB/s", tp="tp1")]


#: Start-up targets: name -> (metric, fastload's cache, the other row's cache, the other row's loader).
_STARTUP = {
    "model-cold-warm": ("load_model", "cold", "warm", "fastload"),
    "model-cold-tp1": ("load_model", "cold", "cold", "safetensors"),
    "model-cold-tp2": ("load_model", "cold", "cold", "safetensors"),
    "model-warm": ("load_model", "warm", "warm", "safetensors"),
    "ready-cold": ("ready", "cold", "cold", "safetensors"),
    "weights-warm-tp2": ("seconds", "warm", "warm", "safetensors"),
    "hub-cold": ("load_model", "cold", "cold", "fastload"),
}
#: Targets whose fastload row is another loader's (name -> loader).
_STARTUP_LOADER = {"hub-cold": "fastload-hub-id"}


def _startup(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    """A ratio of medians of fastload's row to another row of the same TP; for every TP measured
    unless the name ends in one."""
    metric, cache, other_cache, other = _STARTUP[name]
    named = re.search(r"-(tp\d+)$", name)
    loader = _STARTUP_LOADER.get(name, "fastload")
    key = f"{metric}_median"
    label = "load_weights" if metric == "seconds" else metric
    out = []
    for tp in [named.group(1)] if named else _fastload_tps(rows):
        fl, base = _row(rows, tp, cache, loader), _row(rows, tp, other_cache, other)
        detail = (f"{label} {fl[key]:.2f} s ({cache} {loader}) / {base[key]:.2f} s ({other_cache} {other})"
                  if fl and base and fl.get(key) and base.get(key) else "")
        out.append(_ratio(name, limit, tp, fl, base, detail, key))
    return out


def _disk(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    fls = [r for r in rows if r["tp"] == "tp2" and r["loader"] == "fastload" and "error" not in r]
    if not fls:
        return [verdict(name, None, limit, _UNMEASURED, tp="tp2")]
    detail = "disk bytes per rank / checkpoint"
    if known.get("page_share_tp2"):
        detail += f"; the rank's slices rounded out to whole pages: {known['page_share_tp2']:.3f}"
    return [verdict(name, max(r["disk_read_per_rank"] / r["checkpoint_bytes"] for r in fls), limit, detail,
                    tp="tp2")]


def _warm_floor(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    return [_ratio(name, limit, "tp1", _row(rows, "tp1", "warm", "fastload"), _row(rows, "tp1", "warm", FLOOR),
                   "fastload / floor, warm")]


def _warm_default(rows: list[dict], name: str, limit: float, known: dict) -> list[dict]:
    """Slower than the default loader by no more than the run's spread."""
    out = []
    for tp in _fastload_tps(rows):
        fl, base = _row(rows, tp, "warm", "fastload"), _row(rows, tp, "warm", "safetensors")
        if not (fl and base):
            out.append(verdict(name, None, limit, _UNMEASURED, tp=tp))
            continue
        spread = max(fl["seconds_max"] - fl["seconds_min"], base["seconds_max"] - base["seconds_min"])
        out.append(verdict(name, fl["seconds_median"] - base["seconds_median"] - spread, limit,
                           f"median {fl['seconds_median']:.2f} s vs {base['seconds_median']:.2f} s, spread "
                           f"{spread:.2f} s", tp=tp))
    return out


#: How each target is judged.
_JUDGES: Mapping[str, Callable[[list[dict], str, float, dict], list[dict]]] = {
    "cold-tp1": _cold, "cold-tp2": _cold, "warm-floor": _warm_floor, "warm-default": _warm_default,
    "disk-tp2": _disk, "netfs-default": _netfs, "netfs-prefetch": _netfs, "s3-bytes-tp2": _s3_bytes,
    "s3-runai-tp2": _s3_runai, "s3-runai-tp1": _s3_runai, "s3-limit-tp1": _s3_limit,
    **dict.fromkeys(_STARTUP, _startup),
}


def chart(rows: list[dict], path: Path, title: str = "vLLM load_weights by loader") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    ok = [r for r in rows if "error" not in r]
    labels = [f"{r['loader']}\nTP={r['tp'][2:]} {r['cache']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, len(ok) * 0.9), 4.5))
    colors = ["tab:green" if r["loader"] == "fastload" else "tab:gray" if LOADERS[r["loader"]].reference
              else "tab:blue" for r in ok]
    ax.bar(range(len(ok)), [r["seconds_median"] for r in ok], color=colors)
    ax.set_xticks(range(len(ok)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("load_weights, slowest rank (s, median)")
    ax.set_title(f"{title} (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
