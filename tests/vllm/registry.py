"""Every text-generation architecture in vLLM's model registry that transformers can build, as tiny
random checkpoints, so that fastload is compared with vLLM's default loader on all of them
(``zoo.py`` runs them).

Each architecture is mapped to the transformers ``model_type`` whose causal-LM class it
names, its config is scaled down automatically (hidden size, heads of 64, two layers, a handful of
experts, small MLA ranks) and the model is built by transformers' own class, every parameter random
(norms too, so that one loaded from the wrong place shows), bf16, in several shards.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Two sizes: "small" splits two heads over TP=2; "large" has kv heads fewer than heads, an
#: intermediate size that is not a power of two and a vocab that is not a multiple of 64 (vLLM pads it).
SIZES: dict[str, dict] = {
    "small": {"shard": "200KB", "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 64, "vocab_size": 300},
    "large": {"shard": "1MB", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 384, "moe_intermediate_size": 96, "vocab_size": 500},
}

#: Set wherever the config has the field (directly or through its ``attribute_map``), whatever the size.
COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0}
#: config field -> the size's value it takes, set wherever the config has the field.
SCALED = {
    "ffn_dim": "intermediate_size", "intermediate_size_mlp": "intermediate_size",
    "vocab_size_per_layer_input": "vocab_size", "hidden_size_per_layer_input": "head_dim",
    # Sliding-window and linear-attention layers with their own head counts: as the others.
    "swa_num_attention_heads": "num_attention_heads", "swa_num_key_value_heads": "num_key_value_heads",
    "swa_head_dim": "head_dim", "linear_num_heads": "num_attention_heads",
    "linear_num_key_heads": "num_attention_heads", "linear_num_value_heads": "num_attention_heads",
    "linear_head_dim": "head_dim", "linear_key_head_dim": "head_dim", "linear_value_head_dim": "head_dim",
    "index_n_heads": "num_attention_heads", "index_head_dim": "head_dim",
}
#: Scaled like ``SCALED`` only where the default config has the feature (not None, not 0).
OPTIONAL = {"shared_expert_intermediate_size": "intermediate_size", "shared_intermediate_size": "intermediate_size",
            "q_lora_rank": "head_dim", "expert_ffn_hidden_size": "moe_intermediate_size"}
#: Expert counts, experts per token, shared experts: few, so that checkpoints stay tiny.
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k_experts")
#: Where the default config has the feature: one shared expert, one group of experts (the real
#: groups do not divide the scaled-down expert count), one dense layer first (so two layers have both kinds).
ONE_IF_PRESENT = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group",
                  "num_expert_group", "first_k_dense_replace", "num_dense_layers")
#: Multi-head latent attention ranks small enough for vLLM-CPU's MLA (latent 64 + rope 32).
MLA = {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64, "qk_head_dim": 64}


class From(str):
    """An override that takes the size's value of another key, e.g. ``From("hidden_size")``."""


#: arch -> config overrides, only where the automatic scaling does not work.
OVERRIDES: dict[str, dict] = {
    "Gemma3nForCausalLM": {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"]},
    # vLLM reads the fields of the released (remote code) configs.
    "AfmoeForCausalLM": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    "AXK1ForCausalLM": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 0},
    "DeepseekV3ForCausalLM": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "Glm4MoeForCausalLM": {"head_dim": 64},
    "Glm4MoeLiteForCausalLM": {"first_k_dense_replace": 1},
    "HYV3ForCausalLM": {"first_k_dense_replace": 1, "expert_hidden_dim": From("moe_intermediate_size"),
                        "qk_norm": True, "route_norm": True},
    "Lfm2ForCausalLM": {"block_dim": From("hidden_size"), "conv_dim": From("hidden_size")},
    "MiniMaxM2ForCausalLM": {"rotary_dim": 64, "scoring_func": "sigmoid", "use_routing_bias": True},
    "Lfm2MoeForCausalLM": {"layer_types": ["conv", "full_attention"]},
    "Mamba2ForCausalLM": {"expand": 1, "num_heads": From("num_attention_heads"), "n_groups": 1},
    "Zamba2ForCausalLM": {"layer_types": ["mamba", "hybrid"]},
    "LongcatFlashForCausalLM": {"num_layers": 1, "zero_expert_num": 2},
    # vLLM-CPU's MoE kernels want at least 64 expert channels per rank.
    "GptOssForCausalLM": {"intermediate_size": 128},
}

#: arch -> why it is not loaded here (beyond those transformers has no class for, see ``reason``):
#: each fails in vLLM-CPU itself, with the default loader as with fastload.
_CPU = "vLLM-CPU cannot run it: "
_REMOTE = "vLLM reads fields of the released config (remote code) that transformers' config lacks: "
SKIPPED: dict[str, str] = {
    "DeepseekV32ForCausalLM": _CPU + "sparse attention is not supported on CPU",
    "GlmMoeDsaForCausalLM": _CPU + "sparse attention is not supported on CPU",
    "HYV4ForCausalLM": _CPU + "no sparse MLA attention backend on CPU",
    "KimiLinearForCausalLM": _CPU + "its kernels import the CUDA-only cutlass package",
    "OlmoHybridForCausalLM": _CPU + "its kernels need a GPU build of triton (triton.set_allocator)",
    "Qwen3_5ForCausalLM": _CPU + "vLLM fails to inspect the architecture on CPU",
    "Qwen3_5MoeForCausalLM": _CPU + "vLLM fails to inspect the architecture on CPU",
    "Qwen4ExpForCausalLM": _CPU + "vLLM fails to inspect the architecture on CPU",
    "NemotronHForCausalLM": _CPU + "its non-gated MoE activation (is_act_and_mul=False) is GPU-only",
    "NemotronHPuzzleForCausalLM": _CPU + "its non-gated MoE activation (is_act_and_mul=False) is GPU-only",
    "DbrxForCausalLM": "vLLM's loader expects the released checkpoints' expert tensor names, which transformers' "
                       "class no longer writes",
    "DeepseekV4ForCausalLM": "transformers' config rejects its own default on reload (mlp_layer_types 'hash_moe')",
    "InklingForCausalLM": _REMOTE + "padded_vocab_size",
    "LongcatFlashForCausalLM": _REMOTE + "mla_scale_q_lora",
    "MiMoV2FlashForCausalLM": _REMOTE + "hybrid_layer_pattern",
    "Zamba2ForCausalLM": "vLLM's Zamba2 rejects the transformers config at both of the zoo's sizes "
                         "(attention_hidden_size must be divisible by num_attention_heads)",
}
NO_CLASS = "transformers ships no class for it (remote code only)"


def reason(arch: str) -> str | None:
    """Why ``arch`` is not loaded here, or None when it is."""
    if arch in SKIPPED:
        return SKIPPED[arch]
    return NO_CLASS if model_type(arch) is None else None


def describe(size: str) -> str:
    """A size in words, for the docs' table."""
    s = SIZES[size]
    return (f"hidden {s['hidden_size']}, {s['num_attention_heads']} heads ({s['num_key_value_heads']} kv) of "
            f"{s['head_dim']}, vocab {s['vocab_size']}, {s['shard']} shards")


class Unsupported(Exception):
    """An architecture that cannot be built or loaded here; the message says why."""


def architectures() -> list[str]:
    """vLLM's text-generation architectures, sorted."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    return sorted(_TEXT_GENERATION_MODELS)


def model_type(arch: str) -> str | None:
    """The transformers ``model_type`` whose causal-LM class is ``arch`` (or the vLLM class serving it,
    for vLLM's aliases such as ``LLaMAForCausalLM``); None when transformers has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS
    except ImportError:  # an environment without vLLM (tests/sglang): the architecture's own name only
        _TEXT_GENERATION_MODELS = {arch: ("", arch)}
    module, cls = _TEXT_GENERATION_MODELS[arch]
    for name in (arch, cls):
        found = [t for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if c.lower() == name.lower()]
        if found:
            # A composite config (vision + text) and its text part share the class: take the text one.
            return min(found, key=lambda t: (not t.endswith("_text"), t != module.rsplit(".", 1)[-1], t))
    return None


def _resolve(value, sized: dict):
    if isinstance(value, From):
        return sized[value]
    if isinstance(value, dict):
        return {k: _resolve(v, sized) for k, v in value.items()}
    return value


def tiny_config(arch: str, size: str):
    """``arch``'s transformers config scaled down to ``size``; raises ``Unsupported`` where impossible."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    why = reason(arch)
    if why:
        raise Unsupported(why)
    mt = model_type(arch)
    config_class = CONFIG_MAPPING[mt]
    names = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    defaults = config_class()
    sized = {k: v for k, v in SIZES[size].items() if k != "shard"}

    def present(key: str) -> bool:
        return bool(getattr(defaults, key, None))

    wanted = {**COMMON, **sized, **{k: sized[v] for k, v in SCALED.items()}}
    wanted.update({k: sized[v] for k, v in OPTIONAL.items() if present(k)})
    if "kv_lora_rank" in names:
        wanted.update(MLA)
    if any(present(k) for k in EXPERTS):
        wanted.update(dict.fromkeys(EXPERTS, 4))
        wanted.update(dict.fromkeys(EXPERTS_PER_TOKEN, 2))
        if "moe_intermediate_size" not in names:  # the experts' size: that of the other MoE families
            wanted["intermediate_size"] = sized["moe_intermediate_size"]
    wanted.update({k: 1 for k in ONE_IF_PRESENT if present(k)})
    kwargs = {k: v for k, v in wanted.items() if k in names}
    kwargs.update(_resolve(OVERRIDES.get(arch, {}), sized))
    config = AutoConfig.for_model(mt, **kwargs)
    config.architectures = [arch]
    config.dtype = torch.bfloat16
    return config


def build(arch: str, root: Path, size: str, seed: int = 0) -> Path:
    """``root / f"{arch}-{size}"``: a tiny random checkpoint built by transformers, once (bf16, sharded)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = root / f"{arch}-{size}"
    if (out / "config.json").exists():
        return out
    config = tiny_config(arch, size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    saved = set(model.state_dict())
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n in saved and b.is_floating_point())]
    with torch.no_grad():  # random norms and saved buffers too, so one loaded from the wrong place shows
        for t in tensors:
            t.normal_(0, 0.5)
    model.config.architectures = [arch]
    tmp = root / f".{arch}-{size}.tmp"
    model.save_pretrained(tmp, max_shard_size=SIZES[size]["shard"], safe_serialization=True)
    tmp.rename(out)
    return out
