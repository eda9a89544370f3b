"""What only the tests ask of an SGLang server: greedy outputs through ``/generate``, and the
processes of its session still running once it has ended."""

from __future__ import annotations

import json
import urllib.request

from vllm_fastload.tools.processes import session_processes
from vllm_fastload.tools.sglang_server import SglangServer


class SglangTestServer(SglangServer):
    """``tools.sglang_server.SglangServer`` and what the tests ask of it."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy output ids for each prompt (token ids), one batch through ``/generate``."""
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            out = json.loads(resp.read())
        return [item["output_ids"] for item in out]

    def leftovers(self) -> list[str]:
        """The processes of the server's session still running (``pid command``): none once it has
        ended cleanly."""
        return [] if self.proc is None else session_processes(self.proc.pid)
