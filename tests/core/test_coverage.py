"""Whether the ranks together take every element of each checkpoint tensor they use
(``model.coverage``): the check that makes a checkpoint tensor larger than what the model takes the
same error at every TP. Its uses in real loads: ``tests/vllm/test_checks.py`` (vLLM at TP=2 and 4),
``tests/sglang/test_sglang_plugin.py``, and every multi-rank case of ``tests/vllm/test_geometry.py``."""

from __future__ import annotations

import pytest
import torch

from vllm_fastload import CheckpointError, TensorInfo
from vllm_fastload.model.coverage import UNKNOWN, WHOLE, Use, check_taken_whole, uses
from vllm_fastload.model.probe import Placement
from vllm_fastload.sizes import contiguous_strides

K = "model.layers.0.self_attn.k_proj.weight"


def _info(shape: tuple[int, ...], name: str = K) -> TensorInfo:
    return TensorInfo(name, "/ckpt/model.safetensors", "F32", shape, 0, 4 * int(torch.tensor(shape).prod()))


def _rows(info: TensorInfo, start: int, count: int, param: str = "qkv_proj.weight") -> Placement:
    """A write of rows ``[start, start + count)`` of ``info`` (a narrow along dim 0)."""
    shape = (count, *info.shape[1:])
    strides = contiguous_strides(info.shape)
    return Placement(info.name, torch.empty(shape), param, shape, strides, start * strides[0])


def _ranks(info: TensorInfo, parts: list[tuple[int, int]]) -> tuple[list[dict[str, Use]], dict]:
    writes = [{info.name: (_rows(info, start, count),)} for start, count in parts]
    return [uses(w, {info.name: info}) for w in writes], writes[0]


def test_a_tensor_the_ranks_take_whole_together_passes():
    info = _info((16, 8))
    everyone, mine = _ranks(info, [(0, 8), (8, 8)])
    assert everyone[0][K] == Use(0, ((0, 8),)) and everyone[1][K] == Use(0, ((8, 16),))
    check_taken_whole(everyone, {K: info}, mine, "2 ranks")


def test_rows_too_many_are_refused_naming_file_tensor_and_both_shapes():
    info = _info((24, 8))  # 8 rows more than the two ranks' 8 + 8
    everyone, mine = _ranks(info, [(0, 8), (8, 8)])
    with pytest.raises(CheckpointError) as err:
        check_taken_whole(everyone, {K: info}, mine, "2 ranks of the tensor-parallel group")
    message = str(err.value)
    assert err.value.file == "/ckpt/model.safetensors" and err.value.tensor == K
    assert "shape [24, 8] but the 2 ranks of the tensor-parallel group together take only [0, 16) of its dim 0" \
        in message
    assert "qkv_proj.weight [8, 8]" in message


def test_replicated_kv_heads_cover_the_tensor_and_still_catch_what_is_left_out():
    """TP=4 with two KV heads: ranks 0 and 1 take the first head, 2 and 3 the second."""
    info = _info((8, 4))
    check_taken_whole(_ranks(info, [(0, 4), (0, 4), (4, 4), (4, 4)])[0], {K: info}, {}, "4 ranks")
    bigger = _info((12, 4))
    with pytest.raises(CheckpointError, match=r"take only \[0, 8\) of its dim 0 \(of 12"):
        check_taken_whole(_ranks(bigger, [(0, 4), (0, 4), (4, 4), (4, 4)])[0], {K: bigger}, {}, "4 ranks")


def test_whole_or_unknown_uses_are_not_judged_and_tensors_no_rank_takes_are_left_alone():
    info = _info((16, 8))
    assert check_taken_whole([{K: WHOLE}, {K: Use(0, ((0, 4),))}], {K: info}, {}, "2 ranks") is None
    assert check_taken_whole([{K: UNKNOWN}, {K: Use(0, ((0, 4),))}], {K: info}, {}, "2 ranks") is None
    assert check_taken_whole([{}, {}], {K: info}, {}, "2 ranks") is None
    # parts along different dims (say, a tensor read transposed by one layer and narrowed by another)
    assert check_taken_whole([{K: Use(0, ((0, 4),))}, {K: Use(1, ((0, 2),))}], {K: info}, {}, "2 ranks") is None


def test_a_write_that_is_not_a_narrow_is_unknown_and_a_whole_one_whole():
    info = _info((4, 6))
    transposed = Placement(K, torch.empty(6, 4), "conv.weight", (6, 4), (1, 6), 0)
    whole = Placement(K, torch.empty(4, 6), "w", (4, 6), (6, 1), 0)
    assert uses({K: (transposed,)}, {K: info}) == {K: UNKNOWN}
    assert uses({K: (whole,)}, {K: info}) == {K: WHOLE}
    assert uses({K: (_rows(info, 0, 2), _rows(info, 1, 2))}, {K: info}) == {K: Use(0, ((0, 3),))}
