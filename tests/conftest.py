"""Fixtures shared by tests/vllm and tests/remote, so that a vLLM start one of them needs (e.g.
the default loader's digests at TP=2) happens once per session, whichever directories run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.cpu_shm import remove_stale_cpu_shm
from tests.vllm.conftest import Scenarios, make_checkpoints


@pytest.fixture(scope="session", autouse=True)
def no_stale_cpu_shm() -> None:
    """Remove the vLLM-CPU shared-memory files that killed workers of earlier vLLM starts on this
    machine left behind (no process using them, a minute old): a test's start that drew the same
    port would fail with errno 17. Each start the tests make removes its own when it ends."""
    removed = remove_stale_cpu_shm(min_age_s=60)
    if removed:
        print(f"removed {len(removed)} shared-memory files earlier vLLM starts left in /dev/shm")


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("vllm-runs"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under FASTLOAD_DEV_TEST_NO_SKIPS=1 (scripts/test.sh, for the oldest supported vLLM) a skipped test
    fails: an environment that cannot run a check must not pass as one that did."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("FASTLOAD_DEV_TEST_NO_SKIPS") == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, which FASTLOAD_DEV_TEST_NO_SKIPS=1 does not allow: {reason}"


def pytest_collection_modifyitems(config, items) -> None:
    """The SGLang tests (marker ``sglang``) need SGLang, which has its own environment (its pins
    differ from vLLM's; scripts/test.sh builds it and runs them there, where none may skip). In an
    environment without SGLang they are deselected, and the summary says so."""
    if importlib.util.find_spec("sglang") is not None:
        return
    chosen = [item for item in items if item.get_closest_marker("sglang") is not None]
    if chosen:
        items[:] = [item for item in items if item.get_closest_marker("sglang") is None]
        config.hook.pytest_deselected(items=chosen)
        config.stash[_SGLANG_DESELECTED] = len(chosen)


_SGLANG_DESELECTED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config) -> None:
    left = config.stash.get(_SGLANG_DESELECTED, 0)
    if left:
        terminalreporter.write_line(f"{left} SGLang tests deselected: SGLang is not installed in this environment; "
                                    "scripts/test.sh runs them in the SGLang one (.venv-sglang)")
