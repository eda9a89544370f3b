"""Start SGLang's HTTP server (``python -m sglang.launch_server``) in a subprocess, wait until it is
ready, talk to it through ``/generate``, stop it with everything it started.

For ``vllm-fastload bench --engine sglang`` and the SGLang tests. Without CUDA it starts SGLang's
CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) with the OpenMP threads of the ranks on
disjoint CPUs (``SGLANG_CPU_OMP_THREADS_BIND``: SGLang otherwise wants a NUMA node per rank).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_fastload.frozen import FrozenMap
from vllm_fastload.tools.processes import stop_session
from vllm_fastload.tools.servers import EngineServer

#: Flags that make a tiny model start quickly on a CPU (prompts are token ids; a small KV cache,
#: which SGLang otherwise sizes to most of the memory).
SMALL_MODEL_FLAGS = ["--skip-tokenizer-init", "--max-total-tokens", "2048"]

#: SGLang's line as each rank's weights are loaded: ``[2026-01-01 10:00:00 TP1] Load weight end.
#: elapsed=0.46 s, ...`` (the rank named in the prefix at TP>1 only). Not anchored to a line's start:
#: another rank's progress bar may end on the same line, before it.
LOAD_END = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: TP(\d+))?\] Load weight end\. elapsed=([\d.]+) s")
#: fastload's line per rank: ``fastload rank 1/2: read 835.9 MB of 1671.6 MB checkpoint (0.500, ...``.
RANK_LINE = re.compile(r"fastload rank (\d+)/(\d+): read [\d.]+ MB of [\d.]+ MB checkpoint \(([\d.]+),")
#: fastload's early-reads lines: the start (once per launch), and how far they came before the load.
EARLY_START = re.compile(r"fastload: early reads: (\d+) checkpoint files \(([\d.]+) GB\)")
EARLY_STOPPED = re.compile(r"fastload: early reads: stopped after ([\d.]+) s, when the load began; ([\d.]+) of "
                           r"([\d.]+) GB read early")
EARLY_DONE = re.compile(r"fastload: early reads: (\d+) of (\d+) files in the page cache after ([\d.]+) s")


def uses_cpu() -> bool:
    """Whether SGLang runs on the CPU here (no CUDA device)."""
    import torch

    return not torch.cuda.is_available()


def sglang_env(tp: int = 1, **extra: str) -> dict[str, str]:
    """The environment for an SGLang server child: offline; on a CPU, SGLang's CPU engine with each
    rank's OpenMP threads on CPUs of its own."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    if uses_cpu():
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if tp > 1:
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", omp_binding(tp))
    env.update(extra)
    return env


def omp_binding(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: this process's CPUs split into ``tp``
    groups (``0|1`` on two CPUs), each rank's list written as SGLang parses it (``0,1|2,3``)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(len(cpus) // tp, 1)
    groups = [cpus[(r * share) % len(cpus):][:share] or cpus[:1] for r in range(tp)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


@dataclass(frozen=True)
class StartLog:
    """What a start's log says about loading: per-rank seconds (SGLang's own "Load weight end"),
    fastload's per-rank read shares, and the early reads."""

    #: rank -> SGLang's "Load weight end. elapsed" seconds.
    load_s: Mapping[int, float]
    #: rank -> the share of the checkpoint fastload read on that rank (none for another loader).
    read_share: Mapping[int, float]
    #: How many times early reads started (one per launch, or none).
    early_starts: int
    #: GB the early reads had read when the load began (all of it if they finished first); None
    #: without early reads.
    early_gb: float | None
    #: The checkpoint's GB as the early reads saw it.
    early_total_gb: float | None

    @classmethod
    def parse(cls, text: str) -> StartLog:
        load_s = {int(m.group(1) or 0): float(m.group(2)) for m in LOAD_END.finditer(text)}
        shares = {int(m.group(1)): float(m.group(3)) for m in RANK_LINE.finditer(text)}
        starts = EARLY_START.findall(text)
        total = float(starts[0][1]) if starts else None
        stopped = EARLY_STOPPED.search(text)
        early = float(stopped.group(2)) if stopped else total if EARLY_DONE.search(text) else None
        return cls(FrozenMap(load_s), FrozenMap(shares), len(starts), early, total)


class SglangServer(EngineServer):
    """``with SglangServer(model, ["--load-format", "fastload"], log_path=...) as srv: ...``.

    The server runs in a session of its own, so that ``stop`` ends everything it started (its
    scheduler and detokenizer processes, fastload's early reads)."""

    engine = "SGLang"

    def __init__(self, model: str | os.PathLike, args: list[str], *, tp: int = 1, log_path: str | os.PathLike,
                 startup_timeout: float = 600, env: dict[str, str] | None = None) -> None:
        super().__init__(log_path=log_path, startup_timeout=startup_timeout, env=env or sglang_env(tp))
        device = ["--device", "cpu"] if uses_cpu() else []
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--tp", str(tp), *device, *args]

    def start_log(self) -> StartLog:
        return StartLog.parse(self.log_text())

    def stop(self) -> None:
        """End the server and every process of its session (SIGTERM, then SIGKILL)."""
        if self.proc is not None:
            stop_session(self.proc.pid, timeout=30)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (cannot be: it was sent SIGKILL)
                pass
        self._close_log()
