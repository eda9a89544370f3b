"""The same answer at every TP: a checkpoint tensor larger than the parameter it fills (a ``k_proj``
with 8 rows too many) is refused at TP=1, 2 and 4, on every rank, with an error naming the file,
the tensor and both shapes, where vLLM's default loader narrows it without a word; the matching
checkpoint loads exactly at each of them (at TP=4 its two KV heads are replicated: each rank takes
one of them, as vLLM's own loaders do). Run in ``vllm-fastload verify``'s rank processes: vLLM's
loaders and its tensor-parallel group, as a worker has them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.verify import compare, run_ranks

from .conftest import rewrite

pytestmark = pytest.mark.vllm

K = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("every-tp")
    good = write_checkpoint(root / "good", "tiny-llama", files=1)  # 2 KV heads of 32: k_proj is [64, 128]
    bad = rewrite(good, root / "bad", lambda t: t.__setitem__(K, torch.randn(t[K].shape[0] + 8, t[K].shape[1],
                                                                             dtype=t[K].dtype)))
    return good, bad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_an_oversized_tensor_is_refused_at_every_tp(pair, tmp_path, tp):
    good, bad = pair
    results = run_ranks([str(bad), str(good)], tp, tmp_path / "out", verbose=False)
    for rank, done in enumerate(results):
        entry = done[str(bad)]
        assert "default" in entry, f"vLLM's default loader refused it on rank {rank}: {entry}"  # it narrows silently
        error = entry.get("error", "")
        assert error.startswith("CheckpointError: "), f"rank {rank}: {entry}"
        assert f"tensor '{K}'" in error and str(bad / "model.safetensors") in error, error
        assert "shape [72, 128]" in error, error
        if tp == 1:
            assert "the model takes only 8192 of its 9216 elements" in error and "[64, 128]" in error, error
        else:
            assert f"the {tp} ranks of the tensor-parallel group together take only [0, 64) of its dim 0" in error
            assert "into model.layers.0.self_attn.qkv_proj.weight [32, 128]" in error, error  # its one k head
    (verdict,) = compare(results, str(good))
    assert verdict.exact, verdict.line()
