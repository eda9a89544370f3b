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
from vllm_fastload.bench.logs import root_cause


@pytest.fixture
def registry(tmp_path: Path):
    """Install the hooks; afterwards unregister the reference loaders and unwrap the timers."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader import base_loader

    reg = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    before = dict(reg)
    load_model, post = base_loader.BaseModelLoader.load_model, base_loader.process_weights_after_loading
    worker_hooks.install(str(tmp_path))
    yield reg
    base_loader.BaseModelLoader.load_model, base_loader.process_weights_after_loading = load_model, post
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


def _run(seconds: list[float], rchar: int = 0, ready: float = 30.0, phases=None, cached: float | None = None) -> dict:
    """One start's records: per rank load_weights ``s``, load_model ``s + 1`` of which 0.1 post-processing;
    with ``phases`` (``s`` -> fastload's phases) also those and the page-cache share ``cached``."""
    ranks = [{"seconds": s, "rchar": rchar, "read_bytes": 0, "hwm_after_kb": 1024, "load_model_s": s + 1,
              "post_s": 0.1} for s in seconds]
    if phases is not None:
        for r in ranks:
            r.update(phases=phases(r["seconds"]), cached=cached)
    return {"ranks": ranks, "ready_s": ready}


def _planned(s: float) -> dict:
    return {"probe": 0.03, "plan": 0.001, "read": s - 0.031}


def test_summary_takes_the_slowest_rank_and_compares_with_default_and_floor(capsys):
    results = {
        "tp2|warm|fastload": [_run([0.6, 0.8], rchar=900, phases=_planned, cached=1.0),
                              _run([0.7, 0.5], rchar=900, phases=_planned, cached=0.9),
                              _run([1.0, 0.9], rchar=900, phases=_planned, cached=1.0)],
        "tp2|warm|safetensors": [_run([1.0, 0.9], ready=40), _run([1.0, 1.1], ready=41), _run([1.2, 1.0], ready=39)],
        # The path through the model's load_weights: no plan, and no cached share where it could not be told.
        "tp2|warm|fastload-whole": [_run([0.7, 0.7], phases=lambda s: {"probe": 0.01, "read": s - 0.01})],
        "tp2|warm|zerofill": [_run([0.4, 0.5])],
        "tp2|warm|memcopy": [_run([0.55, 0.6])],
        "tp2|cold|fastload": [{"error": "exit 1, 1 rank records; log tail:\nboom"}],
    }
    rows = {r["loader"] + "|" + r["cache"]: r for r in bench.summarize(results, total=2000)}
    fast = rows["fastload|warm"]
    assert fast["seconds_median"] == pytest.approx(0.8) and fast["seconds_min"] == pytest.approx(0.7)
    assert fast["vs_safetensors"] == pytest.approx(0.8 / 1.1)
    assert fast["vs_floor"] == pytest.approx(0.8 / 0.5)
    assert fast["rchar_per_rank"] == 900
    assert rows["memcopy|warm"]["vs_floor"] == pytest.approx(0.6 / 0.5)
    assert "boom" in rows["fastload|cold"]["error"]
    # What users wait for: load_model of the slowest rank, and the start to ready.
    assert (fast["load_model_median"], fast["load_model_min"], fast["load_model_max"]) == pytest.approx((1.8, 1.7, 2.0))
    assert fast["post_median"] == pytest.approx(0.1)
    assert fast["load_model_vs_safetensors"] == pytest.approx(1.8 / 2.1)
    assert fast["ready_median"] == pytest.approx(30.0) and fast["ready_vs_safetensors"] == pytest.approx(30 / 40)
    # fastload's phases: medians over runs and ranks (reads of 0.5-1.0 s less the 0.031 s before them).
    assert fast["phases_median"] == pytest.approx({"probe": 0.03, "plan": 0.001, "read": 0.75 - 0.031})
    assert fast["cached_min"] == pytest.approx(0.9) and "phases_median" not in rows["safetensors|warm"]

    bench.print_table(list(rows.values()))
    out = capsys.readouterr().out
    assert "memcopy" in out and "FAILED" in out and "0.73x" in out
    assert "load_model s" in out and "0.86x" in out and "0.75x" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "probe s" in line)  # the phase table's header
    assert lines[start].split()[-7:] == ["probe", "s", "plan", "s", "read", "s", "cached"]
    phase_rows = {line.split()[2]: line.split()[3:] for line in lines[start:] if line.startswith("2   warm")}
    assert phase_rows == {"fastload": ["0.800", "0.030", "0.001", "0.719", "0.90"],
                          "fastload-whole": ["0.700", "0.010", "-", "0.690", "-"]}


def _row(tp: str, cache: str, loader: str, median: float, lo: float, hi: float, disk: int = 0) -> dict:
    return {"tp": tp, "cache": cache, "loader": loader, "runs": 3, "seconds_median": median, "seconds_min": lo,
            "seconds_max": hi, "rchar_per_rank": 0, "disk_read_per_rank": disk, "peak_rss_mb": 1.0,
            "checkpoint_bytes": 1000}


def test_targets_pass_and_fail_on_the_medians_and_spread():
    rows = [
        _row("tp1", "cold", "fastload", 1.5, 1.4, 1.7), _row("tp1", "cold", "safetensors", 2.0, 1.9, 2.2),
        _row("tp2", "cold", "fastload", 1.3, 1.2, 1.4, disk=540), _row("tp2", "cold", "safetensors", 2.0, 2.0, 2.1),
        _row("tp1", "warm", "fastload", 1.05, 1.0, 1.1), _row("tp1", "warm", "zerofill", 1.0, 0.9, 1.0),
        _row("tp1", "warm", "safetensors", 0.9, 0.85, 1.1),
        _row("tp2", "warm", "fastload", 0.8, 0.7, 0.9, disk=600),
        _row("tp2", "warm", "zerofill", 0.5, 0.5, 0.6),
        _row("tp2", "warm", "safetensors", 0.6, 0.6, 0.62),
    ]
    got = {(v["target"], v["tp"]): v for v in bench.check_targets(rows, bench.parse_targets("all"))}
    assert got[("cold-tp1", "tp1")]["ok"] and got[("cold-tp1", "tp1")]["value"] == pytest.approx(0.75)
    assert not got[("cold-tp2", "tp2")]["ok"] and got[("cold-tp2", "tp2")]["value"] == pytest.approx(0.65)
    # The zero-fill floor judges TP=1; at TP=2 the copy out of the page cache is (weights-warm-tp2).
    assert got[("warm-floor", "tp1")]["ok"] and ("warm-floor", "tp2") not in got
    # TP=1: 0.15 s slower than the default, within the default's 0.25 s spread; TP=2: 0.2 s, spread 0.2 s.
    assert got[("warm-default", "tp1")]["ok"] and got[("warm-default", "tp2")]["ok"]
    assert not got[("disk-tp2", "tp2")]["ok"] and got[("disk-tp2", "tp2")]["value"] == pytest.approx(0.6)
    assert bench.check_targets(rows, bench.parse_targets("disk-tp2=0.61"))[0]["ok"]
    missing = bench.check_targets(rows[:2], bench.parse_targets("cold-tp2"))
    assert missing == [{"target": "cold-tp2", "tp": "tp2", "value": None, "limit": 0.6, "ok": False,
                        "detail": "rows not measured"}]
    assert not bench.check_targets(rows[:2], bench.parse_targets("disk-tp2"))[0]["ok"]  # TP=2 not run: missed
    with pytest.raises(SystemExit, match="unknown target 'cold'"):
        bench.parse_targets("cold")
    # The physical floors measured in the run are printed beside the verdicts, not folded into them.
    gigabyte = [dict(r, checkpoint_bytes=10**9, disk_read_per_rank=r["disk_read_per_rank"] * 10**6) for r in rows]
    bounded = {(v["target"], v["tp"]): v for v in bench.check_targets(
        gigabyte, bench.parse_targets("cold-tp2,disk-tp2"), {"disk_gbps": 0.5, "page_share_tp2": 0.58})}
    cold = bounded[("cold-tp2", "tp2")]
    assert not cold["ok"] and "the disk alone needs 2.00 s" in cold["detail"] and "= 1.00x default" in cold["detail"]
    assert "whole pages: 0.580" in bounded[("disk-tp2", "tp2")]["detail"]


def _wait(row: dict, load_model: float, ready: float) -> dict:
    return dict(row, load_model_median=load_model, load_model_min=load_model, load_model_max=load_model,
                post_median=0.1, ready_median=ready, ready_min=ready, ready_max=ready)


def _bench_args(**given):
    from vllm_fastload.cli import build_parser

    args = build_parser().parse_args(["bench"])
    vars(args).update(given)
    return args


def test_start_up_targets_judge_load_model_and_ready(tmp_path: Path, capsys):
    rows = [
        _wait(_row("tp1", "cold", "fastload", 1.5, 1.4, 1.7), 3.0, 30.0),
        _wait(_row("tp1", "cold", "safetensors", 5.0, 4.9, 5.2), 7.0, 34.0),
        _wait(_row("tp1", "warm", "fastload", 0.8, 0.8, 0.9), 3.6, 30.0),
        _wait(_row("tp1", "warm", "safetensors", 0.8, 0.8, 0.8), 3.5, 30.0),
        _wait(_row("tp2", "cold", "fastload", 1.6, 1.4, 1.7), 3.1, 31.0),
        _wait(_row("tp2", "cold", "safetensors", 2.3, 2.0, 2.9), 4.0, 30.5),
        _wait(_row("tp2", "warm", "fastload", 0.45, 0.4, 0.5), 2.9, 30.0),
        _wait(_row("tp2", "warm", "safetensors", 0.5, 0.45, 0.5), 3.0, 30.0),
    ]
    wanted = bench.parse_targets("all")
    assert {"model-cold-warm", "model-cold-tp1", "model-cold-tp2", "model-warm", "ready-cold",
            "weights-warm-tp2"} <= set(wanted)
    got = {(v["target"], v["tp"]): v for v in bench.check_targets(rows, wanted)}
    value = {key: v["value"] for key, v in got.items()}
    # Cold load_model against the same loader's warm one: 3.0/3.6 and 3.1/2.9.
    assert got[("model-cold-warm", "tp1")]["ok"] and value[("model-cold-warm", "tp1")] == pytest.approx(3 / 3.6)
    assert got[("model-cold-warm", "tp2")]["ok"] and value[("model-cold-warm", "tp2")] == pytest.approx(3.1 / 2.9)
    assert value[("model-cold-tp1", "tp1")] == pytest.approx(3 / 7) and ("model-cold-tp1", "tp2") not in got
    assert not got[("model-cold-tp2", "tp2")]["ok"] and value[("model-cold-tp2", "tp2")] == pytest.approx(3.1 / 4)
    assert not got[("model-warm", "tp1")]["ok"] and got[("model-warm", "tp2")]["ok"]
    assert got[("ready-cold", "tp1")]["ok"] and not got[("ready-cold", "tp2")]["ok"]
    assert value[("weights-warm-tp2", "tp2")] == pytest.approx(0.9)
    detail = got[("weights-warm-tp2", "tp2")]["detail"]
    assert detail == "load_weights 0.45 s (warm fastload) / 0.50 s (warm safetensors)"
    # A row without load_model (an older run) is not measured, so missed.
    bare = [{k: v for k, v in r.items() if not k.startswith("load_model")} for r in rows]
    assert bench.check_targets(bare, {"model-warm": 1.0})[0]["detail"] == "rows not measured"

    # --report judges a saved run again, without running anything.
    saved = tmp_path / "bench-vllm.json"
    saved.write_text(json.dumps({"source": "local", "checkpoint_bytes": 10**9,
                                 "rows": [dict(r, checkpoint_bytes=10**9) for r in rows],
                                 "machine": {"disk_read_gbps": [1.2, 1.3, 1.25]}}))
    args = _bench_args(report=str(saved), targets="model-cold-tp1,ready-cold,cold-tp1")
    assert bench.main(args) == 1  # ready-cold at TP=2 is missed
    out = capsys.readouterr().out
    assert "[ok] model-cold-tp1 tp1: 0.429" in out and "[MISSED] ready-cold tp2: 1.016" in out
    assert "the disk alone needs 0.80 s for the checkpoint at 1.25 GB/s" in out  # the run's own disk speed
    assert "load_model s" in out  # the tables again
    assert bench.main(_bench_args(report=str(saved), targets="model-cold-tp1")) == 0
    assert "targets:" in capsys.readouterr().out
    assert bench.main(_bench_args(report=str(saved), targets=None)) == 0 and "targets:" not in capsys.readouterr().out
    for broken in ("{}", json.dumps({"source": "local", "rows": [{"tp": "tp1"}]}), "not json"):
        saved.write_text(broken)
        with pytest.raises(SystemExit, match="not a JSON file written by vllm-fastload bench"):
            bench.main(_bench_args(report=str(saved), targets="all"))
    with pytest.raises(SystemExit, match="bench-llama-nf4: no such preset; presets: bench-llama, bench-llama-6g, "
                                         "bench-llama-int8"):
        bench.bench_checkpoint("bench-llama-nf4")


def test_page_rounded_share_counts_whole_pages_of_each_ranks_slices(tmp_path: Path):
    from vllm_fastload.tools.checkpoints import write_checkpoint

    model = write_checkpoint(tmp_path / "m", "tiny-llama", files=1)
    whole = bench.page_rounded_share(str(model), 1)
    assert 1.0 <= whole < 1.01  # every byte, plus the pages that tensors' ends share with the next
    assert 0.5 < bench.page_rounded_share(str(model), 2) < whole


def test_a_failed_start_reports_the_workers_first_error():
    log = "\n".join([
        "INFO 11-22 12:00:00 [core.py:90] Initializing a V1 LLM engine",
        "(Worker_TP1 pid=77) ERROR 11-22 12:00:05 [multiproc_executor.py:700] Traceback (most recent call last):",
        '(Worker_TP1 pid=77) ERROR   File "x.py", line 3, in load',
        "(Worker_TP1 pid=77) vllm_fastload.errors.ConfigError: invalid fastload configuration: threads: "
        "Input should be greater than or equal to 1",
        "(EngineCore_DP0 pid=70) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert root_cause(log) == ("ConfigError: invalid fastload configuration: threads: "
                               "Input should be greater than or equal to 1")
    assert root_cause(log.splitlines()[-1]).startswith("RuntimeError: Engine core initialization failed")
    assert root_cause("no error here\nthe end") == ("no exception line in the log; it ends with: "
                                                   "no error here | the end")


def test_machine_state_is_measured(tmp_path: Path):
    from vllm_fastload.bench.machine import MachineState, release_memory

    path = tmp_path / "f.bin"
    path.write_bytes(b"\x01" * (3 << 20) + b"\x02" * 1000)
    state = MachineState()
    assert state.sample_memory() > 0 and state.sample_disk([str(path)]) > 0
    assert "first touch of fresh memory median" in state.summary() and len(state.as_dict()["disk_read_gbps"]) == 1
    assert release_memory(0.01, wait_s=0) > 0


_PROBE = """
import sys
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.model_executor import model_loader
formats = sorted(model_loader._LOAD_FORMAT_TO_MODEL_LOADER)
tooling = sorted(m for m in sys.modules if m.startswith(("vllm_fastload.bench", "vllm_fastload.tools")))
print(formats, tooling)
"""


@pytest.mark.parametrize("installed", [False, True])
def test_only_the_benchmark_installs_its_timers(installed: bool, tmp_path: Path):
    """vLLM's plugin loading registers fastload and imports no benchmark or demo code, even with
    the benchmark's variable set; the benchmark's own sitecustomize adds its timers."""
    import os
    import subprocess
    import sys

    site = Path(bench.__file__).parent / "site"
    env = {**os.environ, "FASTLOAD_DEV_BENCH_DIR": str(tmp_path)}
    if installed:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    formats, tooling = out.stdout.strip().splitlines()[-1].split("] [")
    assert "'fastload'" in formats
    if installed:
        assert "'zerofill'" in formats and "'memcopy'" in formats
        assert "vllm_fastload.bench.worker_hooks" in tooling
    else:
        assert "zerofill" not in formats and tooling == "]"
