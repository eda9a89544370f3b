"""Small random Hugging Face checkpoints (config.json + safetensors) for the demo, tests and benchmarks.

The machines we test on have no internet, so every checkpoint we load is made here. Each
architecture is a real transformers config that vLLM builds its real model class from.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "llama"              # llama | qwen2 | phi3 | mixtral | qwen2_moe
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4                   # head_dim = hidden / heads; CPU attention needs 32, 64, 80, ...
    kv_heads: int = 2
    vocab: int = 500                 # not a multiple of 64: exercises vocab padding at TP=2
    tie_embeddings: bool = False
    experts: int = 4
    experts_per_token: int = 2
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama-3-8B's shapes (its layer count is the caller's).
LLAMA3_8B: dict[str, Any] = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)

#: Named presets used by the README command, the tests and the benchmarks.
PRESETS: dict[str, ModelSpec] = {
    "tiny-llama": ModelSpec(),
    "tiny-qwen2": ModelSpec(arch="qwen2"),
    "tiny-tied": ModelSpec(arch="qwen2", tie_embeddings=True),
    "tiny-phi3": ModelSpec(arch="phi3", kv_heads=4),
    "tiny-mixtral": ModelSpec(arch="mixtral"),
    "tiny-gqa1": ModelSpec(kv_heads=1),  # one kv head: replicated across ranks at TP=2
    # TinyLlama's shapes with 16 layers: 1.67 GB in bf16 (the benchmark checkpoint).
    # 55 MB: the small Llama of the tests' vLLM starts.
    "demo": ModelSpec(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=4000),
    "bench-llama": ModelSpec(hidden=2048, intermediate=5632, layers=16, heads=32, kv_heads=4, vocab=32000),
    # Llama-3-8B's shapes with 10 layers: 6.46 GB, how the benchmark's ratios move with size.
    "bench-llama-6g": ModelSpec(**LLAMA3_8B, layers=10),
    # 0.31 GB: the network-filesystem benchmark (small, as sshfs over loopback is slow).
    "netfs-llama": ModelSpec(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000),
    # 0.43 GB: the two-node benchmark's MoE (``--layout dp-ep``): experts are 64% of it.
    "netfs-mixtral": ModelSpec(arch="mixtral", hidden=1024, intermediate=1408, layers=4, heads=16, kv_heads=4,
                               vocab=32000, experts=8),
    # 0.82 GB: the same MoE with Llama-3's vocabulary, where the tensors every replica holds are two
    # thirds of the bytes (``--layout dp-ep --model dp-mixtral``), as in MoEs with few or small experts.
    "dp-mixtral": ModelSpec(arch="mixtral", hidden=1024, intermediate=1408, layers=4, heads=16, kv_heads=4,
                            vocab=128256, experts=8),
}

_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}


def hf_config(spec: ModelSpec) -> dict:
    architecture, model_type = _ARCHITECTURES[spec.arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": str(spec.dtype).removeprefix("torch."),
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if spec.arch == "mixtral":
        config.update(num_local_experts=spec.experts, num_experts_per_tok=spec.experts_per_token)
    if spec.arch == "phi3":
        config.update(original_max_position_embeddings=512, rope_scaling=None, sliding_window=None)
    return config


def tensor_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Checkpoint tensor names and shapes, in the order Hugging Face writes them."""
    h, i, d = spec.hidden, spec.intermediate, spec.head_dim
    q, kv = spec.heads * d, spec.kv_heads * d
    yield "model.embed_tokens.weight", (spec.vocab, h)
    for n in range(spec.layers):
        p = f"model.layers.{n}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        if spec.arch == "phi3":
            yield f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h)
        else:
            yield f"{p}.self_attn.q_proj.weight", (q, h)
            yield f"{p}.self_attn.k_proj.weight", (kv, h)
            yield f"{p}.self_attn.v_proj.weight", (kv, h)
            if spec.arch == "qwen2":
                yield f"{p}.self_attn.q_proj.bias", (q,)
                yield f"{p}.self_attn.k_proj.bias", (kv,)
                yield f"{p}.self_attn.v_proj.bias", (kv,)
        yield f"{p}.self_attn.o_proj.weight", (h, q)
        if spec.arch == "phi3":
            yield f"{p}.mlp.gate_up_proj.weight", (2 * i, h)
            yield f"{p}.mlp.down_proj.weight", (h, i)
        elif spec.arch == "mixtral":
            yield f"{p}.block_sparse_moe.gate.weight", (spec.experts, h)
            for e in range(spec.experts):
                yield f"{p}.block_sparse_moe.experts.{e}.w1.weight", (i, h)
                yield f"{p}.block_sparse_moe.experts.{e}.w2.weight", (h, i)
                yield f"{p}.block_sparse_moe.experts.{e}.w3.weight", (i, h)
        else:
            yield f"{p}.mlp.gate_proj.weight", (i, h)
            yield f"{p}.mlp.up_proj.weight", (i, h)
            yield f"{p}.mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not spec.tie_embeddings:
        yield "lm_head.weight", (spec.vocab, h)


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, is_norm: bool) -> torch.Tensor:
    if is_norm:
        return (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
    std = 1.0 / math.sqrt(shape[-1])
    return (std * torch.randn(shape, generator=generator)).to(dtype)


def write_checkpoint(directory: str | Path, spec: ModelSpec | str = "tiny-llama", *, files: int = 2,
                     seed: int = 0, index: bool = True) -> Path:
    """Write config.json and ``files`` safetensors shards (with an index unless ``index=False``).

    Idempotent: an existing checkpoint written with the same arguments is left as it is.
    """
    spec = PRESETS[spec] if isinstance(spec, str) else spec
    out = Path(directory)
    stamp = out / ".fastload-checkpoint.json"
    recipe = {"spec": {**spec.__dict__, "dtype": str(spec.dtype)}, "files": files, "seed": seed, "index": index}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors*"):
        old.unlink()
    shapes = list(tensor_shapes(spec))
    total = sum(math.prod(s) for _, s in shapes) * torch.finfo(spec.dtype).bits // 8
    per_file = total / max(files, 1)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    names = [f"model-{k + 1:05d}-of-{files:05d}.safetensors" if files > 1 else "model.safetensors"
             for k in range(files)]
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, k = 0, 0
    for name, shape in shapes:
        tensor = _random(shape, spec.dtype, generator, is_norm=name.endswith("norm.weight"))
        if shard and shard_bytes + tensor.nbytes > per_file * 1.0001 and k < files - 1:
            save_file(shard, out / names[k], metadata={"format": "pt"})
            shard, shard_bytes, k = {}, 0, k + 1
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        weight_map[name] = names[k]
    save_file(shard, out / names[k], metadata={"format": "pt"})
    if index and files > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    stamp.write_text(json.dumps(recipe))
    return out



#: safetensors' names for the dtypes a ``ModelSpec`` may use.
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
#: The random block that ``write_random_checkpoint`` rotates: 16 MiB plus an odd tail, so that
#: its period lines up with no page, buffer or tensor boundary.
_RANDOM_BLOCK = (16 << 20) + 4099


#: A tensor of a random checkpoint: name, shape, bytes.
_Shape = tuple[str, tuple[int, ...], int]


def _shards(shapes: list[_Shape], total: int, files: int, max_shard_bytes: int | None) -> list[list[_Shape]]:
    """Shards in order, as Hugging Face writes them: of about equal size, or cut at ``max_shard_bytes``."""
    shards: list[list[_Shape]] = [[]]
    filled = 0
    for item in shapes:
        if max_shard_bytes is not None:
            full = bool(shards[-1]) and filled + item[2] > max_shard_bytes
        else:
            full = bool(shards[-1]) and filled + item[2] > total / max(files, 1) * 1.0001 and len(shards) < files
        if full:
            shards.append([])
            filled = 0
        shards[-1].append(item)
        filled += item[2]
    return shards


def _write_random_file(path: Path, shard: list[_Shape], dtype: str, block: memoryview | None, rng: Any,
                       step: int) -> None:
    """One safetensors file of ``shard``'s tensors, each piece a rotation of ``block`` by a
    multiple of ``step`` bytes (no ``block``: a hole, zeros the disk does not hold), fsynced."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, nbytes in shard:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        left = offset if block is not None else 0
        if block is None:
            f.truncate(8 + len(raw) + offset)
        while block is not None and left:
            n = min(left, len(block))
            k = int(rng.integers(len(block) // step)) * step
            first = min(n, len(block) - k)
            f.write(block[k:k + first])
            if n > first:
                f.write(block[:n - first])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _finite_block(rng, dtype: torch.dtype) -> bytes:
    """``_RANDOM_BLOCK`` bytes (rounded down to whole elements) of finite values of ``dtype``
    with magnitudes 2^-10 to 2^-4: random sign and mantissa, an exponent drawn from six."""
    import numpy as np

    bits = {torch.bfloat16: (16, 8, 7), torch.float16: (16, 5, 10), torch.float32: (32, 8, 23)}
    width, exponent_bits, mantissa_bits = bits[dtype]
    bias = (1 << (exponent_bits - 1)) - 1
    n = _RANDOM_BLOCK // (width // 8)
    kind = np.uint16 if width == 16 else np.uint32
    sign = rng.integers(0, 2, n, dtype=kind) << (width - 1)
    exponent = (rng.integers(bias - 10, bias - 4, n, dtype=kind)) << mantissa_bits
    mantissa = rng.integers(0, 1 << mantissa_bits, n, dtype=kind)
    return (sign | exponent | mantissa).astype(kind).tobytes()


def write_random_checkpoint(directory: str | Path, spec: ModelSpec | str, *, files: int = 4, seed: int = 0,
                            max_shard_bytes: int | None = None, finite: bool = False, sparse: bool = False) -> Path:
    """Write a checkpoint of random bytes at the speed of the disk, for benchmarks of many GB.

    ``write_checkpoint`` draws normal values per tensor, which takes minutes for 8 GB on a few
    cores; a loader benchmark needs no meaningful values. Here every tensor's bytes are
    rotations (by a seeded random offset per 16 MiB piece) of one random block, written
    without copying, so the files are incompressible and no two pieces look alike, while
    writing costs nothing beyond the I/O. Floats may be NaN: compare such tensors bitwise.
    ``finite``: every value is a finite float of magnitude 2^-10 to 2^-4 (random sign, exponent
    and mantissa, rotated by whole elements), so that a model built from it computes finite
    logits and greedy decoding depends on every weight. ``max_shard_bytes``: shards cut as
    ``save_pretrained`` cuts them (a new file when the next tensor would take the current one
    past the limit; the Hub's checkpoints use 5 GB) instead of into ``files`` equal parts.
    ``sparse``: every tensor's bytes are zeros left as a hole in the file, so a checkpoint of any
    size costs no time and no disk, for tests that need its size and not its values.
    The safetensors files are laid out by our own writer (header padded to 8 bytes, tensors in
    Hugging Face order), then fsynced so that their pages are clean and can be evicted.
    Idempotent like ``write_checkpoint``.
    """
    import numpy as np

    spec = PRESETS[spec] if isinstance(spec, str) else spec
    out = Path(directory)
    stamp = out / ".fastload-checkpoint.json"
    recipe = {"kind": "random-bytes", "spec": {**spec.__dict__, "dtype": str(spec.dtype)}, "files": files,
              "seed": seed}
    if max_shard_bytes is not None:
        recipe["max_shard_bytes"] = max_shard_bytes
    if finite:
        recipe["finite"] = True
    if sparse:
        recipe["sparse"] = True
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    for old in out.glob("*.safetensors*"):
        old.unlink()
    itemsize = torch.finfo(spec.dtype).bits // 8
    shapes = [(name, shape, math.prod(shape) * itemsize) for name, shape in tensor_shapes(spec)]
    total = sum(n for _, _, n in shapes)
    shards = _shards(shapes, total, files, max_shard_bytes)
    rng = np.random.default_rng(seed)
    block = None if sparse else memoryview(_finite_block(rng, spec.dtype) if finite else rng.bytes(_RANDOM_BLOCK))
    step = itemsize if finite else 1  # rotations by whole elements keep every value finite
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
             for k in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        _write_random_file(out / file_name, shard, _SAFETENSORS_DTYPES[spec.dtype], block, rng, step)
        weight_map.update((name, file_name) for name, _, _ in shard)
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    stamp.write_text(json.dumps(recipe))
    return out
