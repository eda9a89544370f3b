"""Fixtures shared by tests/vllm and tests/remote, so that a vLLM start one of them needs (e.g.
the default loader's digests at TP=2) happens once per session, whichever directories run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.conftest import Scenarios, make_checkpoints


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("vllm-runs"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("checkpoints"))
