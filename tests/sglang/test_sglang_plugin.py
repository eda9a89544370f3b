"""The SGLang plugin path and fastload's errors under SGLang.

The plugin: SGLang discovers the ``sglang.srt.plugins`` entry point; after its ``load_plugins()``
(what ``sglang.launch_server``, ``sglang serve`` and every scheduler process call),
``--load-format fastload`` parses, ``ServerArgs(load_format="fastload")`` is accepted and
``get_model_loader`` returns fastload's loader; ``SGLANG_PLUGINS`` without it leaves SGLang as it
was. Each check runs in a fresh process (plugins and hooks are process-wide).

Bad input: the clear errors fastload gives under vLLM (tests/vllm/test_vllm_loader.py), here
through SGLang's loader interface, naming the file and the tensor or parameter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.vllm.conftest import rewrite
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.verify import run_ranks

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

PRELUDE = "from sglang.srt.plugins import load_plugins; load_plugins(); "


def run_python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sglang-plugin") / "tied", "tiny-tied", files=1, index=False)


def test_sglang_discovers_the_entry_point(sg_env):
    out = run_python("from sglang.srt.plugins import GENERAL_PLUGINS_GROUP as g; "
                     "from importlib.metadata import entry_points; "
                     "print([e.value for e in entry_points(group=g) if e.name == 'fastload'])", sg_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['vllm_fastload.sglang_plugin:register']"


def test_load_format_fastload_is_accepted_and_routed_to_fastloads_loader(sg_env, tied):
    code = PRELUDE + (
        "from sglang.srt.server_args import ServerArgs, prepare_server_args; "
        "from sglang.srt.configs.load_config import LoadConfig; "
        "from sglang.srt.model_loader.loader import get_model_loader; "
        f"cli = prepare_server_args(['--model-path', {str(tied)!r}, '--load-format', 'fastload', '--device', 'cpu']); "
        f"args = ServerArgs(model_path={str(tied)!r}, load_format='fastload', device='cpu'); "
        "loader = get_model_loader(LoadConfig(load_format=args.load_format, "
        "model_loader_extra_config=args.model_loader_extra_config)); "
        "print(cli.load_format, args.load_format, type(loader).__module__, type(loader).__name__)")
    out = run_python(code, sg_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["fastload", "fastload", "vllm_fastload.sglang_plugin.loader",
                                       "FastloadModelLoader"]


def test_registering_leaves_the_loader_unimported_until_a_load_needs_it(sg_env, tied):
    """Every process SGLang starts runs ``register``, with any load format: fastload's configuration
    and loading code are imported only where fastload is chosen."""
    code = PRELUDE + (
        "import sys; from sglang.srt.server_args import prepare_server_args; "
        f"prepare_server_args(['--model-path', {str(tied)!r}, '--device', 'cpu']); "
        "print(sorted(m for m in sys.modules if m.startswith(('vllm_fastload.config', 'vllm_fastload.model.'))))")
    out = run_python(code, sg_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[]"


def test_sglang_plugins_without_fastload_leaves_sglang_as_it_was(sg_env, tied):
    code = PRELUDE + ("from sglang.srt.server_args import prepare_server_args; "
                      f"prepare_server_args(['--model-path', {str(tied)!r}, '--load-format', 'fastload'])")
    out = run_python(code, {**sg_env, "SGLANG_PLUGINS": "some_other_plugin"})
    assert out.returncode != 0
    assert "invalid choice: 'fastload'" in out.stderr


VALIDATE = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import get_model_loader
for extra in sys.argv[1:]:
    try:
        get_model_loader(LoadConfig(load_format="fastload", model_loader_extra_config=extra))
        print("ACCEPTED")
    except Exception as e:
        print(type(e).__name__, str(e).replace(chr(10), " "))
"""


def test_plugin_options_are_validated_as_under_vllm(sg_env):
    extras = [json.dumps({"threads": 2, "bogus_knob": 1}),
              json.dumps({"remote": {"store_options": {"aws_secret_access_key": "x"}}}),
              json.dumps({"threads": 4})]
    out = subprocess.run([sys.executable, "-c", VALIDATE, *extras], capture_output=True, text=True, env=sg_env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    unknown, secret, fine = out.stdout.strip().splitlines()[-3:]
    assert unknown.startswith("ConfigError") and "invalid fastload configuration" in unknown and "bogus_knob" in unknown
    assert secret.startswith("ConfigError") and "SGLang's start-up log" in secret
    assert fine == "ACCEPTED"


RESOLVE = PRELUDE + """
import logging, os, subprocess, sys
logging.basicConfig(level=logging.INFO)
import vllm_fastload.model as model
calls = []
start = model.start_early_reads
model.start_early_reads = lambda engine, settings: (calls.append(engine), start(engine, settings))[1]
from sglang.srt.server_args import ServerArgs
args = ServerArgs(model_path=sys.argv[1], load_format="fastload", device="cpu")
args.resolve_once()
args.resolve_once()  # as SGLang's publish() does again, in this process and in every scheduler's
print(sys.argv[2], "hooks", len(calls), "guard", os.environ.get("_FASTLOAD_EARLY_READS"), flush=True)
if sys.argv[2] == "launcher":  # a process it starts inherits its environment, as SGLang's schedulers do
    subprocess.run([sys.executable, __file__, sys.argv[1], "scheduler"], check=True)
"""


def test_early_reads_run_once_though_sglangs_hook_runs_in_every_process(sg_env, tied, tmp_path):
    """SGLang runs the ``resolve_once`` hook after every call, in every process that publishes the
    arguments; only ``model/early.py``'s environment guard keeps early reads to one per launch."""
    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE)
    out = subprocess.run([sys.executable, str(script), str(tied), "launcher"], capture_output=True, text=True,
                         env=sg_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if " hooks " in ln]
    assert lines == [f"launcher hooks 2 guard {tied}", f"scheduler hooks 2 guard {tied}"]
    assert out.stderr.count("fastload: early reads: 1 checkpoint files") == 1, out.stderr[-3000:]


# -- bad input ------------------------------------------------------------------------------------

def _broken(tied: Path, root: Path) -> dict[str, Path]:
    out = {}
    out["truncated"] = rewrite(tied, root / "truncated", lambda t: None)
    shard = out["truncated"] / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    out["partly"] = rewrite(tied, root / "partly", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    out["missing"] = rewrite(tied, root / "missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    k = "model.layers.0.self_attn.k_proj.weight"
    out["shape"] = rewrite(tied, root / "shape", lambda t: t.__setitem__(
        k, torch.zeros(t[k].shape[0] + 8, t[k].shape[1], dtype=t[k].dtype)))
    norm = "model.layers.1.input_layernorm.weight"
    out["dtype"] = rewrite(tied, root / "dtype", lambda t: t.__setitem__(norm, torch.zeros(t[norm].shape,
                                                                                          dtype=torch.int32)))
    return out


@pytest.fixture(scope="module")
def errors(tied, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """fastload's error for each broken checkpoint, loaded in one rank process at TP=1."""
    root = tmp_path_factory.mktemp("sglang-broken")
    broken = _broken(tied, root)
    results = run_ranks([str(p) for p in broken.values()], 1, root / "out",
                        {"fastload": ("fastload", {"progress": False})}, verbose=False, engine="sglang")
    return {name: (path, results[0][str(path)].get("error", "loaded without an error"))
            for name, path in broken.items()}


def test_truncated_file(errors):
    path, error = errors["truncated"]
    assert "TruncatedFileError" in error and str(path / "model.safetensors") in error


def test_a_stacked_parameter_missing_a_shard(errors):
    path, error = errors["partly"]
    assert "model.layers.1.mlp.gate_up_proj.weight is only partly provided by the checkpoint" in error
    assert "model.layers.1.mlp.gate_proj.weight" in error and str(path) in error


def test_a_parameter_the_checkpoint_does_not_provide(errors):
    """SGLang's default loader leaves it as allocated without a word; fastload stops."""
    path, error = errors["missing"]
    assert "checkpoint does not provide every parameter of the model" in error
    assert "model.layers.1.mlp.down_proj.weight" in error and str(path) in error


def test_wrong_shape(errors):
    path, error = errors["shape"]
    assert "CheckpointError" in error
    assert "tensor 'model.layers.0.self_attn.k_proj.weight'" in error and str(path / "model.safetensors") in error


def test_wrong_shape_is_refused_at_tp2_too(errors, tmp_path):
    """At TP=2 each rank takes only its part of the tensor, and SGLang's default loader narrows an
    oversized one on both without a word: the two ranks find together that 8 rows are left out."""
    path, _ = errors["shape"]
    results = run_ranks([str(path)], 2, tmp_path / "out", {"default": ("auto", {}),
                                                          "fastload": ("fastload", {"progress": False})},
                        verbose=False, engine="sglang")
    for rank, done in enumerate(results):
        entry = done[str(path)]
        assert "default" in entry, f"SGLang's default loader refused it on rank {rank}: {entry}"
        error = entry.get("error", "")
        assert error.startswith("CheckpointError: ") and "the 2 ranks of the tensor-parallel group together take " \
            "only [0, 64) of its dim 0 (of 72" in error, f"rank {rank}: {entry}"
        assert "tensor 'model.layers.0.self_attn.k_proj.weight'" in error and "qkv_proj.weight" in error, error


def test_wrong_dtype(errors):
    _, error = errors["dtype"]
    assert "checkpoint dtype I32 does not match parameter" in error
    assert "tensor 'model.layers.1.input_layernorm.weight'" in error
