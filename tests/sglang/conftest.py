"""Real SGLang (0.5.23, its CPU engine): server starts through ``python -m sglang.launch_server``
(``test_sglang_server.py``), and SGLang's own loading path in-process, in rank processes that set up
its distributed state the way its scheduler processes do (``vllm_fastload.tools.sglang_ranks``),
against SGLang's ``DefaultModelLoader``.

These tests run in the SGLang environment that scripts/test.sh builds (scripts/setup.sh with
FASTLOAD_DEV_SGLANG); in an environment without SGLang they are deselected, and the run says so.

Two test-only stubs stand in for what cannot be installed on this machine (tests/sglang/stubs, put
on ``PYTHONPATH`` for every process these tests start, servers included): SGLang's CPU kernels
(``sgl_kernel``, built from source only), of which SGLang imports a few functions as it starts,
each stub raising if it is ever called (neither loading nor the servers these tests start call
one), and torchvision's fake-kernel registrations (the registry's torchvision is a CUDA build).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

STUBS = Path(__file__).parent / "stubs"
# This process builds the checkpoints with transformers, which imports torchvision: the same stub.
# Its sys.path also goes to the rank processes it spawns (multiprocessing hands it over), so the
# stubs are on it.
runpy.run_path(str(STUBS / "sitecustomize.py"))
if str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))


@pytest.fixture(scope="session", autouse=True)
def sglang_process_env() -> None:
    """Every process the tests start imports the stubs first and uses SGLang's CPU engine."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), os.environ.get("PYTHONPATH", "")) if p)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def sg_env() -> dict[str, str]:
    """The environment for a subprocess of these tests."""
    return dict(os.environ)
