"""Quantized copies of a bf16 Llama-family checkpoint, for the tests and the benchmarks.

The machines we test on have no internet, so quantized checkpoints are written here from a
checkpoint's own weights, in the formats vLLM reads: compressed-tensors W8A8 (int8 or fp8
weights, one scale per output channel, dynamic per-token activations) or W4A16 (int4 packed
eight to an int32, one scale per ``GROUP`` inputs), and the GPTQ and AWQ int4 layouts (AutoGPTQ's
and AutoAWQ's tensors; GPTQ without ``g_idx``, which vLLM 0.32 has no parameter for). The linear
layers of the decoder are quantized (by their Llama names, ``q_proj`` ... ``down_proj``; a
checkpoint without them is refused); the embeddings, norms and the LM head are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: Group size of the int4 schemes (scales per 32 input channels).
GROUP = 32
#: The schemes ``quantize_checkpoint`` writes.
SCHEMES = ("int8", "fp8", "int4", "gptq", "awq")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: What an output was made from (the scheme, and the base's own stamp).
_STAMP = ".fastload-quantized.json"
#: ``tools.checkpoints.write_checkpoint``'s stamp in the base directory.
_BASE_STAMP = ".fastload-checkpoint.json"


def quantize_checkpoint(base: str | Path, out: str | Path, scheme: str) -> Path:
    """Write ``base`` quantized with ``scheme`` to ``out`` (same shards, an index).

    Idempotent: an ``out`` made from the same ``base`` (as its ``write_checkpoint`` stamp says)
    and scheme is kept; one made from another is made again; a directory this function did not
    write is refused. Written to a temporary directory first, so a stopped run leaves none.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    base, out = Path(base), Path(out)
    source = base / _BASE_STAMP
    recipe = {"scheme": scheme, "base": json.loads(source.read_text()) if source.exists() else str(base.resolve())}
    stamp = out / _STAMP
    if stamp.exists():
        if json.loads(stamp.read_text()) == recipe:
            return out
        shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty and not a checkpoint quantize_checkpoint wrote; not overwritten")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = _config(scheme)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    index: dict = {"metadata": {}, "weight_map": {}}
    quantized = 0
    for shard in sorted(base.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for key, t in load_file(shard).items():
            if key.endswith(".weight") and key.split(".")[-2] in _LINEARS:
                tensors.update(_quantize(scheme, key.removesuffix(".weight"), t.float()))
                quantized += 1
            else:
                tensors[key] = t
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    if not quantized:
        shutil.rmtree(tmp)
        raise ValueError(f"{base}: no linear weight named {', '.join(_LINEARS)} to quantize")
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp / _STAMP).write_text(json.dumps(recipe))
    if out.exists():
        out.rmdir()  # empty, checked above
    tmp.rename(out)
    return out


def _config(scheme: str) -> dict:
    if scheme == "gptq":  # static activation order (desc_act false): vLLM 0.32 refuses the other
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                "lm_head": False}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if scheme == "int4":
        group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": GROUP, "dynamic": False}}
        fmt = "pack-quantized"
    else:
        kind = {"int8": "int", "fp8": "float"}[scheme]
        group = {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel", "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token",
                                       "dynamic": True}}
        fmt = f"{kind}-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": group}}


def _quantize(scheme: str, prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that stand for the float weight ``w`` (out, in) under ``scheme``."""
    if scheme in ("gptq", "awq"):
        return _int4_layout(scheme, prefix, w)
    if scheme == "int4":
        return _pack_int4(prefix, w)
    if scheme == "int8":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 127
        q = (w / scale).round().clamp(-128, 127).to(torch.int8)
    else:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.to(torch.bfloat16)}


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values (0..15) per int32 along ``dim``, lowest nibble first."""
    moved = values.movedim(dim, -1)
    nibbles = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 8, 8) << (4 * torch.arange(8))
    packed = nibbles.sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _pack_int4(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: signed int4 values + 8, packed along the input dim,
    ``weight_scale`` (out, in / GROUP), ``weight_shape`` [out, in]."""
    out_f, in_f = w.shape
    groups = w.reshape(out_f, in_f // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-6) / 7).to(torch.bfloat16)
    q = (groups / scale.float()).round().clamp(-8, 7).to(torch.int64).reshape(out_f, in_f) + 8
    return {f"{prefix}.weight_packed": _pack(q, 1), f"{prefix}.weight_scale": scale.squeeze(2).contiguous(),
            f"{prefix}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}


def _int4_layout(scheme: str, prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ or AWQ int4 tensors of ``w`` (out, in), group-wise along the input dim.

    Both store the weight transposed, (in, out). GPTQ packs eight 4-bit values per int32 down the
    input dim (``qweight`` (in / 8, out)) and its zero points across the output dim; AWQ packs both
    across the output dim (``qweight`` (in, out / 8)). ``scales`` are fp16 (in / GROUP, out), cast by
    the loader to the model's bf16. Nibbles are packed in plain order (AutoAWQ interleaves them)
    and the zero points are random: what matters here is loading exactly and running, not what
    the model computes.
    """
    out_f, in_f = w.shape
    groups = w.t().reshape(in_f // GROUP, GROUP, out_f)
    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 7
    q = ((groups / scale).round().clamp(-8, 7) + 8).to(torch.int64).reshape(in_f, out_f)  # 0..15
    # Zero points vary (a constant would load the same whatever block a rank took).
    zeros = torch.randint(0, 16, (in_f // GROUP, out_f), generator=torch.Generator().manual_seed(out_f + in_f))
    return {f"{prefix}.qweight": _pack(q, 0 if scheme == "gptq" else 1), f"{prefix}.qzeros": _pack(zeros, 1),
            f"{prefix}.scales": scale.squeeze(1).to(torch.float16).contiguous()}
