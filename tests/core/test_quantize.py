"""Quantized copies of a checkpoint (``vllm_fastload.tools.quantize``), as the zoo and ``bench
--model bench-llama-SCHEME`` make them: the layouts vLLM reads, made once per base and scheme."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tools.quantize import GROUP, SCHEMES, quantize_checkpoint


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("base") / "m", "tiny-llama", files=2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_replaces_the_linear_weights_and_keeps_the_rest(base: Path, tmp_path: Path, scheme: str):
    out = quantize_checkpoint(base, tmp_path / scheme, scheme)
    before, after = _tensors(base), _tensors(out)
    config = json.loads((out / "config.json").read_text())
    method = config["quantization_config"]["quant_method"]
    assert method == (scheme if scheme in ("gptq", "awq") else "compressed-tensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(after) and set(index.values()) == {p.name for p in base.glob("*.safetensors")}
    linear = [k for k in before if k.endswith("_proj.weight")]
    assert linear
    if scheme in ("int8", "fp8"):  # the weight keeps its name, in its 8-bit type
        wanted = torch.int8 if scheme == "int8" else torch.float8_e4m3fn
        assert {after[k].dtype for k in linear} == {wanted}
    else:
        assert not set(linear) & set(after)
    for key, tensor in before.items():
        if key not in linear:  # embeddings, norms, LM head: copied as they are
            assert torch.equal(after[key], tensor), key
    q = "model.layers.0.self_attn.q_proj"
    out_f, in_f = before[f"{q}.weight"].shape
    groups = in_f // GROUP
    expected_shapes = {
        "int8": {"weight": (out_f, in_f), "weight_scale": (out_f, 1)},
        "fp8": {"weight": (out_f, in_f), "weight_scale": (out_f, 1)},
        "int4": {"weight_packed": (out_f, in_f // 8), "weight_scale": (out_f, in_f // GROUP), "weight_shape": (2,)},
        "gptq": {"qweight": (in_f // 8, out_f), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)},
        "awq": {"qweight": (in_f, out_f // 8), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)},
    }[scheme]
    assert {k: tuple(after[f"{q}.{k}"].shape) for k in expected_shapes} == expected_shapes
    # Kept as it is when asked again (the bench makes its presets once).
    stamp = (out / "config.json").stat().st_mtime_ns
    assert quantize_checkpoint(base, out, scheme) == out and (out / "config.json").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".*.tmp"))


def test_made_again_when_the_base_or_scheme_changes_and_never_over_other_files(tmp_path: Path):
    base = write_checkpoint(tmp_path / "base", "tiny-llama", files=1, seed=1)
    out = quantize_checkpoint(base, tmp_path / "q", "int8")
    first = _tensors(out)["model.layers.0.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "base", "tiny-llama", files=1, seed=2)  # the base rewritten
    again = _tensors(quantize_checkpoint(base, out, "int8"))["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(first, again)
    assert "weight_packed" in " ".join(_tensors(quantize_checkpoint(base, out, "int4")))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a checkpoint quantize_checkpoint wrote"):
        quantize_checkpoint(base, mine, "int8")
    assert (mine / "notes.txt").read_text() == "keep"


def test_int8_and_int4_values_stand_for_the_weights(base: Path, tmp_path: Path):
    down = "model.layers.1.mlp.down_proj"
    w = _tensors(base)[f"{down}.weight"].float()
    int8 = _tensors(quantize_checkpoint(base, tmp_path / "int8", "int8"))
    row_scale = int8[f"{down}.weight_scale"].float()
    back = int8[f"{down}.weight"].float() * row_scale
    # Within half a step of the row's scale (the scale is stored in bf16: a little more).
    assert ((back - w).abs() <= row_scale * 0.51 + w.abs() * 0.01).all()
    int4 = _tensors(quantize_checkpoint(base, tmp_path / "int4", "int4"))
    packed = int4[f"{down}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(w.shape) - 8
    scale = int4[f"{down}.weight_scale"].float().repeat_interleave(GROUP, dim=1)
    assert ((nibbles * scale - w).abs() <= scale * 0.51 + w.abs() * 0.01).all()
    assert torch.equal(int4[f"{down}.weight_shape"], torch.tensor(list(w.shape)))


def test_an_unknown_scheme_or_a_base_without_linears_is_refused(base: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="unknown scheme 'nf4'; known: int8, fp8, int4, gptq, awq"):
        quantize_checkpoint(base, tmp_path / "x", "nf4")
    mixtral = write_checkpoint(tmp_path / "moe", "tiny-mixtral", files=1)  # experts' w1/w2/w3, no *_proj MLP
    only_attention = quantize_checkpoint(mixtral, tmp_path / "moe-int8", "int8")  # attention's q/k/v/o_proj
    assert "model.layers.0.self_attn.q_proj.weight_scale" in _tensors(only_attention)
    empty = tmp_path / "norms"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    save_file({"model.norm.weight": torch.ones(4)}, empty / "model.safetensors")
    with pytest.raises(ValueError, match="no linear weight named q_proj"):
        quantize_checkpoint(empty, tmp_path / "norms-int8", "int8")
    assert not list(tmp_path.glob(".*.tmp"))
