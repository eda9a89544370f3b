"""The supported vLLM range: the running vLLM is in it, an untested one gets one log line per
process, and a vLLM lacking an interface fastload needs stops start-up with an error naming it."""

from __future__ import annotations

import logging
import os

import pytest
import vllm
from vllm.config.load import LoadConfig

from vllm_fastload.vllm_plugin import compat
from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

from .conftest import HERE, run_scenario

pytestmark = pytest.mark.vllm


@pytest.mark.core
@pytest.mark.gpu_build
def test_the_running_vllm_is_a_supported_release():
    """scripts/test.sh names the release each environment must hold (FASTLOAD_DEV_TEST_VLLM), so an
    environment that silently resolved another vLLM fails here."""
    assert compat.is_supported(vllm.__version__), vllm.__version__
    expected = os.environ.get("FASTLOAD_DEV_TEST_VLLM")
    if expected:
        assert vllm.__version__ == expected
    assert compat.missing_interfaces() == []


@pytest.mark.core
@pytest.mark.gpu_build
def test_supported_range_is_by_release():
    assert compat.supported_range() == "vLLM 0.29 to 0.33"
    for version in ("0.29.0", "0.30.1", "0.32.0", "0.32.3", "0.33.0"):
        assert compat.is_supported(version), version
    for version in ("0.28.2", "0.34.0", "0.34.0rc1", "1.0.0", "unknown", ""):
        assert not compat.is_supported(version), version


@pytest.mark.core
@pytest.mark.gpu_build
def test_an_untested_vllm_is_named_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(compat, "_noted", False)
    with caplog.at_level(logging.WARNING, logger="vllm_fastload.vllm_plugin"):
        compat.note_release()
        compat.note_release()
    lines = [r.getMessage() for r in caplog.records if "outside the range" in r.getMessage()]
    assert lines == ["fastload: vLLM 0.99.0 is outside the range this fastload is tested with (vLLM 0.29 to "
                     "0.33); `vllm-fastload verify MODEL --tp N` checks it on your checkpoint"]


@pytest.mark.core
@pytest.mark.gpu_build
def test_a_missing_interface_stops_the_loader_naming_it(monkeypatch):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    monkeypatch.delattr(DefaultModelLoader, "track_weights_loading")
    with pytest.raises(compat.UnsupportedVllmError,
                       match=r"lacks DefaultModelLoader\.track_weights_loading\. fastload supports vLLM 0\.29 to "
                             r"0\.33"):
        FastloadModelLoader(LoadConfig(load_format="fastload"))


def test_vllm_without_an_interface_fails_at_start_naming_it_and_reads_nothing(checkpoints, tmp_path):
    """A real start on a vLLM that calls itself 0.99.0 and lacks ``track_weights_loading`` (every
    process vLLM starts imports old_vllm/sitecustomize.py, which makes it so): every process logs
    the untested release once, and the start stops before any weight is read, naming the interface."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE / "old_vllm"), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "SCENARIO_GENERATE": "0"}
    result = run_scenario(tmp_path, "old-vllm", checkpoints["llama-gqa"], "fastload", 1, env=env, timeout=300)
    assert "error" in result and "digests" not in result, result["log"][-3000:]
    log = result["log"]
    assert ("fastload cannot run on vLLM 0.99.0: it lacks DefaultModelLoader.track_weights_loading. fastload "
            "supports vLLM 0.29 to 0.33") in log, log[-4000:]
    noted = [line.split("WARNING")[0] for line in log.splitlines()
             if "vLLM 0.99.0 is outside the range this fastload is tested with" in line]
    # The engine core and the worker (vLLM prefixes their lines with their pids), and this process.
    assert len(noted) >= 3 and len(set(noted)) == len(noted), noted
    assert "fastload rank 0/1: read" not in log  # stopped before reading


@pytest.mark.core
@pytest.mark.gpu_build
def test_a_vllm_that_cannot_register_the_loader_is_warned_about_not_stopped(monkeypatch, caplog):
    """The plugin runs in every vLLM process, also in those that never load with fastload: where it
    cannot register, it says why and lets vLLM start."""
    from vllm.model_executor import model_loader

    from vllm_fastload.vllm_plugin import register

    monkeypatch.delattr(model_loader, "register_model_loader")
    with caplog.at_level(logging.WARNING, logger="vllm_fastload.vllm_plugin"):
        register()
    assert any("it lacks the loader registry (register_model_loader)" in r.getMessage() for r in caplog.records)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_plugin_shows_each_line_once_before_and_after_vllm_configures_its_logging(monkeypatch):
    """Before vLLM has handlers, fastload's lines reach the root's handlers once each, also a
    handler that sits on the package's logger too (pytest's capture does); after, they go to
    vLLM's handlers and not to the root's."""
    from vllm_fastload.vllm_plugin import register

    register()
    root, tree, vllm_logger = logging.getLogger(), logging.getLogger("vllm_fastload"), logging.getLogger("vllm")
    on_root, on_both, on_vllm = _Records(), _Records(), _Records()
    monkeypatch.setattr(vllm_logger, "handlers", [])
    monkeypatch.setattr(root, "handlers", [on_root, on_both])
    monkeypatch.setattr(tree, "handlers", [*tree.handlers, on_both])
    monkeypatch.setattr(vllm_logger, "propagate", False)
    logging.getLogger("vllm_fastload.executor").warning("before vLLM's logging")
    monkeypatch.setattr(vllm_logger, "handlers", [on_vllm])
    logging.getLogger("vllm_fastload.executor").warning("after vLLM's logging")
    assert on_root.lines == ["before vLLM's logging"]
    assert on_both.lines == ["before vLLM's logging", "after vLLM's logging"]
    assert on_vllm.lines == ["after vLLM's logging"]
