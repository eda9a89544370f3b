"""Model attributes with which SGLang's default loader reads other files or filters names
(``allow_patterns_overrides``, ``secondary_weights``): fastload leaves such a model's weights to
SGLang's default loader, with one warning, and the model loads exactly as with it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from vllm_fastload.tools.checkpoints import write_checkpoint

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

CODE = """
import json, sys
from vllm_fastload.tools import sglang_ranks
device = sglang_ranks.setup_rank(0, 1, int(sys.argv[2]))
from sglang.srt.models.llama import LlamaForCausalLM
LlamaForCausalLM.allow_patterns_overrides = ["*.safetensors"]
out = {mode: sglang_ranks.load_and_digest(sys.argv[1], fmt, extra, "auto", device)
       for mode, fmt, extra in (("default", "auto", {}), ("fastload", "fastload", {"progress": False}))}
print("RESULT", json.dumps(out))
"""


def test_a_model_that_picks_its_own_files_loads_through_sglangs_default_loader(tmp_path, sg_env):
    path = write_checkpoint(tmp_path / "llama", "tiny-llama", files=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", CODE, str(path), str(port)], capture_output=True, text=True,
                         env=sg_env, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["fastload"]["loader"] == "FastloadModelLoader"
    report = result["fastload"]["report"]
    assert not report["planned"] and "allow_patterns_overrides" in report["fallback_reason"]
    assert result["fastload"]["digests"] == result["default"]["digests"]
    assert "loading its weights with SGLang's default loader" in out.stderr
