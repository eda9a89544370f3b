"""``vllm-fastload verify`` as users run it (the installed console script, on checkpoints made here):
exit 0 when every parameter on every rank equals the default loader's, exit 1 naming the parameter
and the rank when one does not. The broken plan is a test-only fault (``fault/sitecustomize.py``)
that every load-time check lets through, so only the comparison can catch it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.quantize import quantize_checkpoint

from .conftest import GPU_BUILD_ON_CPU, HERE

pytestmark = pytest.mark.vllm

sys.path.insert(0, str(HERE))
import registry  # noqa: E402
import zoo  # noqa: E402


def _verify(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    script = shutil.which("vllm-fastload", path=str(Path(sys.executable).parent))
    assert script, "the vllm-fastload console script is not installed next to this Python"
    return subprocess.run([script, "verify", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify")
    return {"demo": write_checkpoint(root / "demo", "demo", files=2),
            "gpt2": registry.build("GPT2LMHeadModel", root, "large")}


@pytest.fixture(scope="module")
def core_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A dense, an MoE and a quantized checkpoint (compressed-tensors W8A8 int8; fp8 on a vLLM GPU
    build run as the CPU platform, whose int8 post-processing needs the CPU build's kernels)."""
    root = tmp_path_factory.mktemp("verify-core")
    if GPU_BUILD_ON_CPU:
        quantized = quantize_checkpoint(registry.build("LlamaForCausalLM", root, "small"), root / "llama-w8a8-fp8",
                                        "fp8")
    else:
        quantized = zoo.build_quantized("llama-w8a8-int8", root)
    return {"LlamaForCausalLM": write_checkpoint(root / "dense", "demo", files=2),
            "MixtralForCausalLM": registry.build("MixtralForCausalLM", root, "small"),
            "quantized LlamaForCausalLM": quantized}


@pytest.mark.core
@pytest.mark.gpu_build
@pytest.mark.parametrize("tp", [1, 2])
def test_dense_moe_and_quantized_are_exact_on_every_rank(core_checkpoints, tp):
    """Every parameter on every rank equals the default loader's, after loading and after vLLM's
    post-processing (the vLLM end-to-end check that runs against every tested vLLM release)."""
    proc = _verify(*map(str, core_checkpoints.values()), "--tp", str(tp))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: 3 of 3 exact" in proc.stdout, proc.stdout
    for path in core_checkpoints.values():
        line = next(line for line in proc.stdout.splitlines() if f"({path})" in line)
        assert f"exact on all {tp} ranks" in line and "after loading and after post-processing" in line, line
        assert "planned per rank" in line, line
        assert "post-processed per layer" not in line, line  # opt-in: see the test below


def test_post_processing_per_layer_is_exact_on_every_rank(core_checkpoints):
    """The opt-in ``post_per_layer``: each module compared right before its post-processing (run
    during the read) and after vLLM's pass, on both ranks."""
    proc = _verify(*map(str, core_checkpoints.values()), "--tp", "2", "--fastload-config",
                   '{"post_per_layer": true}')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: 3 of 3 exact" in proc.stdout, proc.stdout
    for path in core_checkpoints.values():
        line = next(line for line in proc.stdout.splitlines() if f"({path})" in line)
        assert "exact on all 2 ranks" in line and "post-processed per layer" in line, line


def test_verify_passes_the_demo_checkpoint_and_a_zoo_family(checkpoints):
    proc = _verify(str(checkpoints["demo"]), str(checkpoints["gpt2"]), "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "verdict: 2 of 2 exact" in out
    for arch, path in (("LlamaForCausalLM", checkpoints["demo"]), ("GPT2LMHeadModel", checkpoints["gpt2"])):
        line = next(line for line in out.splitlines() if line.startswith(f"{arch} ({path})"))
        assert "exact on all 2 ranks" in line and "planned per rank" in line, line


def test_verify_fails_a_broken_plan_naming_the_parameter_and_the_rank(checkpoints):
    env = {"VERIFY_FAULT_RANK": "1", "PYTHONPATH": os.pathsep.join([str(HERE / "fault"),
                                                                    os.environ.get("PYTHONPATH", "")])}
    proc = _verify(str(checkpoints["gpt2"]), "--tp", "2", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    faulted = next(line for line in proc.stdout.splitlines() if line.startswith("VERIFY_FAULT: "))
    param = faulted.split()[1]
    assert "DIFFERENT" in proc.stdout and "differs on rank 1" in proc.stdout, proc.stdout
    # The parameter the fault moved is named (the checkpoint name maps onto vLLM's parameter).
    assert param.rsplit(".", 2)[-2] in proc.stdout.split("DIFFERENT", 1)[1].splitlines()[0]
    assert "verdict: 0 of 1 exact" in proc.stdout
