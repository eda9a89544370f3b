"""The benchmark's pieces that need no vLLM start: its reference loaders (run in this process on
a small module, through vLLM's own loader registry) and the table arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from vllm_fastload.bench import vllm as bench
from vllm_fastload.bench import worker_hooks


@pytest.fixture
def registry(tmp_path: Path):
    """Install the hooks; afterwards unregister the reference loaders and unwrap the timers."""
    from vllm.model_executor import model_loader

    reg = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    before = dict(reg)
    worker_hooks.install(str(tmp_path))
    yield reg
    for cls in set(reg.values()):
        wrapped = getattr(cls.load_weights, "__wrapped__", None)
        if getattr(cls.load_weights, "_fastload_timed", False) and wrapped is not None:
            cls.load_weights = wrapped
    reg.clear()
    reg.update(before)


def _model() -> nn.Module:
    m = nn.Module()
    m.proj = nn.Linear(64, 48, dtype=torch.bfloat16)
    m.norm = nn.Parameter(torch.empty(3 << 20, dtype=torch.float32), requires_grad=False)  # 12 MiB
    m.strided = nn.Parameter(torch.ones(8, 4).t(), requires_grad=False)  # not contiguous
    return m


def test_reference_loaders_write_every_parameter_and_record_the_rank(registry, tmp_path: Path):
    from vllm.config.load import LoadConfig

    model = _model()
    memcopy = registry["memcopy"](LoadConfig(load_format="memcopy"))
    memcopy.SOURCE_BYTES = 1 << 20  # several source-sized pieces per large parameter
    memcopy.source = memcopy.source[:memcopy.SOURCE_BYTES]
    memcopy.load_weights(model, None)
    for name, p in model.named_parameters():
        if name == "strided":
            assert torch.count_nonzero(p) == 0
        else:
            assert bool((p.data.reshape(-1).view(torch.uint8) == 0x3C).all()), name

    registry["zerofill"](LoadConfig(load_format="zerofill")).load_weights(model, None)
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())

    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank0-*.json"))]
    assert sorted(r["load_format"] for r in records) == ["memcopy", "zerofill"]
    for r in records:
        assert r["rank"] == 0 and r["seconds"] > 0 and r["hwm_after_kb"] >= r["rss_before_kb"] > 0


def _run(seconds: list[float], rchar: int = 0) -> dict:
    return {"ranks": [{"seconds": s, "rchar": rchar, "read_bytes": 0, "hwm_after_kb": 1024} for s in seconds]}


def test_summary_takes_the_slowest_rank_and_compares_with_default_and_floor(capsys):
    results = {
        "tp2|warm|fastload": [_run([0.6, 0.8], rchar=900), _run([0.7, 0.5], rchar=900), _run([1.0, 0.9], rchar=900)],
        "tp2|warm|safetensors": [_run([1.0, 0.9]), _run([1.0, 1.1]), _run([1.2, 1.0])],
        "tp2|warm|zerofill (floor)": [_run([0.4, 0.5])],
        "tp2|warm|memcopy (copy floor)": [_run([0.55, 0.6])],
        "tp2|cold|fastload": [{"error": "exit 1, 1 rank records; log tail:\nboom"}],
    }
    rows = {r["loader"] + "|" + r["cache"]: r for r in bench.summarize(results, total=2000)}
    fast = rows["fastload|warm"]
    assert fast["seconds_median"] == pytest.approx(0.8) and fast["seconds_min"] == pytest.approx(0.7)
    assert fast["vs_safetensors"] == pytest.approx(0.8 / 1.1)
    assert fast["vs_floor"] == pytest.approx(0.8 / 0.5)
    assert fast["rchar_per_rank"] == 900
    assert rows["memcopy (copy floor)|warm"]["vs_floor"] == pytest.approx(0.6 / 0.5)
    assert "boom" in rows["fastload|cold"]["error"]

    bench.print_table(list(rows.values()))
    out = capsys.readouterr().out
    assert "memcopy (copy floor)" in out and "FAILED" in out and "0.73x" in out
