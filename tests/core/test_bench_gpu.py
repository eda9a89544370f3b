"""``vllm-fastload bench-gpu``: its CPU-only smoke form end to end, and its refusal without CUDA.

The GPU benchmark itself runs only where there is a GPU (``scripts/gpu-check.sh``); the smoke
form runs the same checkpoint writer, limit measurements, eviction, correctness check, table,
verdicts and JSON on the host, so that none of that is dead code in CI.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import vllm_fastload
from vllm_fastload import cli
from vllm_fastload.bench import gpu as bench
from vllm_fastload.tools.checkpoints import tensor_shapes, write_random_checkpoint
from vllm_fastload.tp_rules import rank_requests

from ._util import assert_bitexact

REPEATS = 2
EXPECTED_ROWS = {(cache, loader, tp) for cache in ("cold", "warm")
                 for loader, tp in (("fastload-host", bench.TP1), ("fastload-host", bench.TP2),
                                    ("safetensors", bench.TP1))}


def run_smoke(tmp_path: Path) -> tuple[int, dict]:
    rc = cli.main(["bench-gpu", "--smoke", "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                   "--repeats", str(REPEATS)])
    return rc, json.loads((tmp_path / "out" / "bench-gpu-smoke.json").read_text())


def test_smoke_run_measures_everything_and_checks_the_bytes(tmp_path: Path):
    rc, result = run_smoke(tmp_path)
    assert rc == 0
    assert result["smoke"] is True and result["correct"] is True and result["reps_done"] == REPEATS

    model = str(tmp_path / "ckpt")
    with vllm_fastload.open(model, config={"progress": False}) as ckpt:
        total = ckpt.total_bytes
        tp_bytes = ckpt.plan(rank_requests(ckpt.tensors, 2, 1)).read_bytes
        files = sorted(ckpt.files)
    assert result["checkpoint"]["bytes"] == total and result["checkpoint"]["files"] == len(files) == 3
    assert total == sum(math.prod(shape) * 2 for _, shape in tensor_shapes(bench.SMOKE_SPEC))

    # Limits: disk (O_DIRECT or its stated fallback) and page cache per repetition; no H2D on a host.
    limits = result["limits"]
    for kind in ("disk", "page_cache"):
        assert len(limits[kind]["gbps"]) == REPEATS and all(x > 0 for x in limits[kind]["gbps"])
        assert limits[kind]["method"]
    assert limits["h2d"]["gbps"] == [] and "no CUDA" in limits["h2d"]["why"]
    assert limits["cold"] == pytest.approx(statistics.median(limits["disk"]["gbps"]))
    assert limits["warm"] == pytest.approx(statistics.median(limits["page_cache"]["gbps"]))

    # One row per loader, TP and cache state, each with every repetition, checked bit for bit.
    rows = {(r["cache"], r["loader"], r["tp"]): r for r in result["rows"]}
    assert set(rows) == EXPECTED_ROWS
    for (cache, _loader, tp), row in rows.items():
        assert len(row["seconds"]) == REPEATS and all(s > 0 for s in row["seconds"])
        assert row["mismatches"] == 0
        assert row["bytes"] == (tp_bytes if tp == bench.TP2 else total)
        assert row["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        assert row["gbps"] == pytest.approx(row["bytes"] / row["median_s"] / 1e9)
        assert row["of_limit"] == pytest.approx(row["gbps"] / limits[cache])
        anchor = rows[(cache, "safetensors", bench.TP1)]
        assert row["time_vs"]["safetensors"] == pytest.approx(row["median_s"] / anchor["median_s"])
        assert row["time_vs"]["fastsafetensors"] is None and row["time_vs"]["instanttensor"] is None
        assert len(row["alloc_extra"]) == REPEATS and all(x >= 0 for x in row["alloc_extra"])
    assert 0 < rows[("cold", "fastload-host", bench.TP2)]["read_fraction"] <= 0.55

    # Verdicts: computed from the rows, with n/a where an anchor was not measured.
    verdicts = {v["target"]: v for v in result["targets"]}
    tp_verdict = verdicts["fastload-host TP=2 rank 1: bytes read <= 0.55x checkpoint"]
    assert tp_verdict["ok"] is True and tp_verdict["value"] == pytest.approx(tp_bytes / total)
    assert verdicts["every load equals safetensors' CPU read, bit for bit (tensors wrong)"]["ok"] is True
    ahead = verdicts["fastload-host TP=1 cold: ahead of fastsafetensors (time ratio < 1)"]
    assert ahead["ok"] is None and ahead["detail"]
    speed = verdicts["fastload-host TP=1 warm: >= 90% of the limit"]
    assert speed["value"] == pytest.approx(rows[("warm", "fastload-host", bench.TP1)]["of_limit"])
    memory = [v for label, v in verdicts.items() if "device memory beyond destinations" in label]
    assert len(memory) == 1 and memory[0]["ok"] is not None
    ev = result["eviction"]
    assert (ev["failures"] > 0) == ("cold repetitions were cold" in verdicts)
    assert ev["drop_caches_used"] == 0  # the smoke run never drops the whole machine's caches


def test_smoke_run_catches_a_loader_that_delivers_wrong_bytes(tmp_path: Path, monkeypatch):
    honest = bench.safetensors_loader

    def corrupting(setup: bench.Setup) -> bench.Loader:
        loader = honest(setup)
        run = loader.run

        def wrong() -> int:
            nbytes = run()
            setup.dests["model.norm.weight"].view(torch.uint8)[7] ^= 1
            return nbytes

        loader.run = wrong
        return loader

    monkeypatch.setattr(bench, "safetensors_loader", corrupting)
    rc, result = run_smoke(tmp_path)
    assert rc == 1 and result["correct"] is False
    for row in result["rows"]:
        assert row["mismatches"] == (REPEATS if row["loader"] == "safetensors" else 0)


def test_random_checkpoint_is_valid_safetensors_and_idempotent(tmp_path: Path):
    root = write_random_checkpoint(tmp_path / "c", bench.SMOKE_SPEC, files=3, seed=5)
    files = sorted(root.glob("*.safetensors"))
    assert len(files) == 3 and (root / "model.safetensors.index.json").exists()
    stamp = {p: p.stat().st_mtime_ns for p in files}
    seen = {}
    with vllm_fastload.open(root, config={"progress": False}) as ckpt:
        for path in files:
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    theirs = f.get_tensor(name)
                    assert_bitexact(ckpt.get_tensor(name), theirs, name)
                    seen[name] = theirs
    assert {n: tuple(t.shape) for n, t in seen.items()} == dict(tensor_shapes(bench.SMOKE_SPEC))
    # Not a constant pattern: tensors of one shape differ, and another seed gives other bytes.
    assert not torch.equal(seen["model.layers.0.mlp.up_proj.weight"].view(torch.int16),
                           seen["model.layers.1.mlp.up_proj.weight"].view(torch.int16))
    write_random_checkpoint(root, bench.SMOKE_SPEC, files=3, seed=5)
    assert {p: p.stat().st_mtime_ns for p in files} == stamp
    other = write_random_checkpoint(tmp_path / "d", bench.SMOKE_SPEC, files=3, seed=6)
    assert (other / files[0].name).read_bytes() != files[0].read_bytes()


def test_without_cuda_the_gpu_run_says_so_in_one_line(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["bench-gpu", "--dir", str(tmp_path / "never"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("bench-gpu: needs a CUDA device") and "--smoke" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()
