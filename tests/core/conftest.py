"""Fixtures for the engine-independent core tests (helpers live in ``_util``)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_fastload_env(monkeypatch):
    """Tests pass their config explicitly; stray FASTLOAD_* variables must not leak in."""
    for key in list(os.environ):
        if key.startswith("FASTLOAD_"):
            monkeypatch.delenv(key)
