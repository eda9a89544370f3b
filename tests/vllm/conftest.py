"""Real vLLM (the CPU build in CI), started once per scenario in a subprocess; checkpoints made here."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.processes import remove_logged_cpu_shm

HERE = Path(__file__).parent
#: Whether this is a vLLM GPU build run as vLLM's CPU platform (scripts/test.sh puts
#: gpu_build_on_cpu/ on PYTHONPATH for the run against vLLM 0.33.0, which has no CPU build).
GPU_BUILD_ON_CPU = importlib.util.find_spec("fastload_test_gpu_build_on_cpu") is not None

#: name -> (preset, files); one file means no index (a plain model.safetensors).
ARCHITECTURES = {
    "llama-gqa": ("tiny-gqa1", 2),   # one kv head: replicated on both ranks at TP=2
    "qwen2": ("tiny-qwen2", 2),      # qkv bias
    "tied": ("tiny-tied", 1),        # tied embeddings, single file
    "mixtral": ("tiny-mixtral", 3),  # MoE
}
UNUSED_TENSOR = "model.layers.0.self_attn.rotary_emb.inv_freq"  # Llama's load_weights skips it


def run_scenario(out_dir: Path, name: str, model: Path, load_format: str, tp: int,
                 extra: dict | None = None, env: dict | None = None, timeout: float = 600) -> dict:
    out = out_dir / f"{name}.json"
    log = out_dir / f"{name}.log"
    cmd = [sys.executable, str(HERE / "scenario.py"), str(model), load_format, str(tp), str(out)]
    if extra is not None:
        cmd.append(json.dumps(extra))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_hung(proc)
            raise AssertionError(f"{name}: the start did not end within {timeout:.0f} s (a hang); the stacks of "
                                 f"its threads end its log ({log}):\n{log.read_text(errors='replace')[-8000:]}"
                                 ) from None
        except BaseException:  # interrupted (pytest's own time limit): leave nothing running
            _kill_group(proc)
            raise
        finally:
            remove_logged_cpu_shm(log)
    result = json.loads(out.read_text()) if out.exists() else {"error": f"no result (exit {proc.returncode})"}
    result["log"] = log.read_text(errors="replace")
    result["returncode"] = proc.returncode
    return result


def _stop_hung(proc: subprocess.Popen) -> None:
    """Have the scenario write every thread's stack to its log (``scenario.py`` registers SIGUSR1
    with ``faulthandler``), then end its whole process group."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(3)
    except ProcessLookupError:
        pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Scenarios:
    """Caches scenario results so each vLLM start happens once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, dict] = {}

    def get(self, name: str, model: Path, load_format: str, tp: int, **kwargs) -> dict:
        key = (name, load_format, tp)
        if key not in self.cache:
            self.cache[key] = run_scenario(self.root, f"{name}-{load_format}-tp{tp}", model, load_format, tp,
                                           **kwargs)
        return self.cache[key]


def make_checkpoints(root: Path) -> dict[str, Path]:
    """One small checkpoint per architecture (``ARCHITECTURES``), below ``root``."""
    paths = {}
    for name, (preset, files) in ARCHITECTURES.items():
        paths[name] = write_checkpoint(root / name, preset, files=files, index=files > 1)
    # A tensor the model never uses: it must not be read.
    shard = paths["llama-gqa"] / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors[UNUSED_TENSOR] = torch.arange(16, dtype=torch.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = paths["llama-gqa"] / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][UNUSED_TENSOR] = shard.name
    index.write_text(json.dumps(doc))
    return paths


def rewrite(src: Path, dst: Path, change) -> Path:
    """Copy a single-file checkpoint, letting ``change(tensors)`` edit the tensor dict."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


#: vLLM's own rotary cache: no checkpoint tensor, and the first forward pass converts it to the
#: activations' dtype, which the warm-up of a compiled start (``PP_COMPILATION``) runs and an
#: eager reference start does not.
COMPUTED_BUFFER = ".rotary_emb.cos_sin_cache"


def assert_subsets(stages: list[dict], reference: dict) -> None:
    """Each stage's parameters and buffers equal the one-rank default loader's of the same name,
    and the stages together hold every one of them."""
    seen: set[str] = set()
    for rank, digests in enumerate(stages):
        different = [name for name, digest in digests.items()
                     if reference.get(name) != digest and not name.endswith(COMPUTED_BUFFER)]
        assert not different, f"rank {rank}: {different}"
        seen |= digests.keys()
    # (One rank shares one rotary module among its layers, listed once: under the first layer it holds.)
    missing = {name for name in reference.keys() ^ seen if not name.endswith(COMPUTED_BUFFER)}
    assert not missing, sorted(missing)


def pytest_terminal_summary(terminalreporter) -> None:
    """The geometry property tests' totals: examples run per pattern and paths taken (see test_geometry)."""
    geometry = sys.modules.get("tests.vllm.test_geometry")
    if geometry is None or not geometry.EXAMPLES_RUN:
        return
    run = geometry.EXAMPLES_RUN
    terminalreporter.write_sep("-", "geometry properties")
    terminalreporter.write_line(f"{sum(run.values())} generated cases, each over every rank of its size: "
                                + ", ".join(f"{k} {v}" for k, v in sorted(run.items())))
    paths = sorted(geometry.PATHS_TAKEN.items())
    terminalreporter.write_line("tensors per path: " + ", ".join(f"{k} {v}" for k, v in paths))
