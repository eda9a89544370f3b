"""Fixtures for the TGI tests (helpers live in tgi_helpers.py, importable by the test modules)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# tgi_helpers sits beside this file; keep it importable under any pytest --import-mode.
sys.path.insert(0, str(Path(__file__).parent))
from tgi_helpers import FILE_A, FILE_B, FakeGroup, Oracle, same, write


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("tgi-ckpt")
    a, b = root / "model-00001-of-00002.safetensors", root / "model-00002-of-00002.safetensors"
    write(a, FILE_A, 0)
    write(b, FILE_B, 100)
    return [a, b]


@pytest.fixture
def make_weights(ckpt: list[Path]) -> Iterator[Callable[..., object]]:
    """``make_weights(world=1, rank=0, **kwargs)``: a FastWeights on the shared checkpoint."""
    from tgi_patch import FastWeights

    made = []

    def make(world: int = 1, rank: int = 0, *, filenames: list | None = None, dtype: torch.dtype = torch.float16,
             loader: object = None, config: dict | None = None, **kwargs: object) -> FastWeights:
        cfg = {"progress": False, **(config or {})}
        w = FastWeights(ckpt if filenames is None else filenames, "cpu", dtype, FakeGroup(rank, world), loader,
                        config=cfg, **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def oracle(ckpt: list[Path]) -> Callable[..., Oracle]:
    return lambda world=1, rank=0, dtype=torch.float16: Oracle(ckpt, world, rank, dtype)


@pytest.fixture
def assert_same() -> Callable[[torch.Tensor, torch.Tensor], None]:
    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert same(got, want), f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"

    return check
