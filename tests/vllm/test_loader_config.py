"""The loader's configuration checks that need no vLLM start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm.config.load import LoadConfig

from vllm_fastload.errors import ConfigError
from vllm_fastload.vllm_plugin import cpus
from vllm_fastload.vllm_plugin.loader import FastloadModelLoader


def _loader(extra: dict) -> FastloadModelLoader:
    return FastloadModelLoader(LoadConfig(load_format="fastload", model_loader_extra_config=extra))


def test_credentials_in_the_extra_config_are_refused():
    """vLLM logs --model-loader-extra-config verbatim: a key there would end up in every log."""
    with pytest.raises(ConfigError, match=r"aws_secret_access_key .* environment") as err:
        _loader({"remote": {"store_options": {"aws_secret_access_key": "s3cr3t-value", "allow_http": "true"}}})
    assert "s3cr3t-value" not in str(err.value)
    loader = _loader({"threads": 3, "direct_io": "never", "remote": {"store_options": {"allow_http": "true"}}})
    assert loader.config.threads == 3 and loader.config.direct_io == "never"


def test_extra_config_goes_over_the_environment(monkeypatch):
    """The loader reads FASTLOAD_* first and puts --model-loader-extra-config on top, key by key in
    ``remote``, so the environment's endpoint and credentials survive a tuning override."""
    monkeypatch.setenv("FASTLOAD_THREADS", "3")
    monkeypatch.setenv("FASTLOAD_PROGRESS", "false")
    monkeypatch.setenv("FASTLOAD_REMOTE__ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("FASTLOAD_REMOTE__STORE_OPTIONS__AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    config = _loader({"threads": 2, "remote": {"max_in_flight": 4}}).config
    assert (config.threads, config.progress) == (2, False)
    assert (config.remote.endpoint, config.remote.max_in_flight) == ("http://127.0.0.1:9", 4)
    assert config.remote.store_options["aws_secret_access_key"].get_secret_value() == "s3cr3t-value"
    monkeypatch.setenv("FASTLOAD_REMOTE__TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=r"remote\.timeout_s \(from FASTLOAD_REMOTE__TIMEOUT_S\)") as err:
        _loader({})
    assert "s3cr3t-value" not in str(err.value)
    monkeypatch.delenv("FASTLOAD_REMOTE__TIMEOUT_S")
    monkeypatch.setenv("FASTLOAD_THREDS", "3")
    with pytest.raises(ConfigError, match="unknown environment variable FASTLOAD_THREDS"):
        _loader({"threads": 2})


def test_whole_reads_on_several_ranks_go_through_the_page_cache():
    """Every rank reads every tensor through load_weights: with O_DIRECT each would fetch the whole
    checkpoint from disk (TP=2 cold took 2.4x the default loader); the page cache shares one read."""
    from vllm_fastload.config import ConfigFacts, FastloadConfig, resolve

    config = FastloadConfig.build({"progress": False})
    assert resolve(config, ConfigFacts(whole_reads=2)).direct_io == "never"
    assert resolve(config, ConfigFacts(whole_reads=2)).origin("direct_io") == "whole reads"
    assert resolve(config, ConfigFacts(whole_reads=1)) is config
    always = FastloadConfig.build({"direct_io": "always"})
    assert resolve(always, ConfigFacts(whole_reads=2)) is always  # an explicit choice is kept


# A rank process whose main thread vLLM bound to one core, started by an unbound engine process
# (this test): which CPUs its reader threads get, with vLLM's automatic binding and with the user's.
BOUND_RANK = """
import json, os, sys, threading
engine = threading.Event()
if sys.argv[1] == "in-process":  # an engine thread started before vLLM binds the main thread
    threading.Thread(target=engine.wait, daemon=True).start()
os.sched_setaffinity(0, {0})
from vllm_fastload.vllm_plugin.cpus import reader_cpus
print(json.dumps(reader_cpus()))
engine.set()
"""


def _rank_cpus(bind: str | None, engine: str = "own-process") -> list[int] | None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    out = subprocess.run([sys.executable, "-c", BOUND_RANK, engine], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 (the loader's choice of "
                    "CPUs beside a rank bound to CPU 0)")
def test_reader_cpus_beside_a_bound_rank():
    same_node = [c for c in sorted(os.sched_getaffinity(0)) if cpus._node(c) == cpus._node(0)]
    # Automatic binding: the rank's core and the free cores of its NUMA node.
    assert _rank_cpus(None) == _rank_cpus("auto") == same_node
    # The user's binding gives CPU 1 to another rank: never added. An unreadable one adds nothing.
    assert _rank_cpus("0|1") is None
    assert _rank_cpus("0-1") is None
    assert _rank_cpus("zero|one") is None
    # The engine's threads in the rank's own process run everywhere: so do the reader's.
    assert _rank_cpus(None, "in-process") == sorted(os.sched_getaffinity(0))
    # An unbound process (GPUs, "nobind") keeps its threads where they are.
    assert cpus.reader_cpus() is None


def test_cpus_bound_by_the_user(monkeypatch):
    for setting, want in [("0-3|4,6", {0, 1, 2, 3, 4, 6}), ("auto", set()), ("nobind", set()), ("", set())]:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", setting)
        assert cpus._bound_by_user() == want


_EARLY_READS = """
import json, os, socket, sys, threading
import torch.distributed as dist
from vllm.plugins import load_general_plugins
from vllm_fastload.tools.verify import engine_config
if __name__ == "__main__":
    if sys.argv[2] == "rank":  # as vllm-fastload verify's rank processes: in a group before any config
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    load_general_plugins()
    engine_config(sys.argv[1], 2, "fastload", {"progress": False})
    reading = [t.name for t in threading.enumerate() if t.name == "fastload-early-reads"]
    print("early reads:", json.dumps([bool(reading), os.environ.get("_FASTLOAD_EARLY_READS_MARKS") is not None]))
"""


@pytest.mark.parametrize("process", ["front-end", "rank"])
def test_early_reads_start_where_vllm_builds_its_config_not_in_a_rank(tmp_path, process):
    """A config that loads with fastload starts early reads in the process that built it (vLLM's
    front end, ``LLM(...)``), not in a process that already is a rank of a group: there the load is
    next (``vllm-fastload verify`` builds a config per checkpoint in its ranks; reading there left a
    thread holding the files for minutes per checkpoint, waiting for marks no other rank leaves)."""
    from vllm_fastload.early import decide as early
    from vllm_fastload.early import marks
    from vllm_fastload.tools.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "demo", "demo", files=2)
    script = tmp_path / "config.py"
    script.write_text(_EARLY_READS)
    # Not what an earlier early-reads start in this test process left for its children.
    env = {k: v for k, v in os.environ.items() if k not in (early.STARTED_ENV, marks.MARKS_ENV)}
    out = subprocess.run([sys.executable, str(script), str(path), process], capture_output=True, text=True,
                         timeout=600, env={**env, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    expected = process == "front-end"
    line = next(line for line in out.stdout.splitlines() if line.startswith("early reads:"))
    assert json.loads(line.partition(":")[2]) == [expected, expected], out.stdout[-3000:] + out.stderr[-3000:]
