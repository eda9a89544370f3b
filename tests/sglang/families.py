"""The SGLang architecture zoo: the vLLM zoo's families (tests/vllm/registry.py) that SGLang 0.5.23
also serves, built tiny by transformers, and what SGLang's CPU engine does with each.

Every family of the vLLM zoo that SGLang's model registry names is listed here exactly once: loaded
(``PLANNED``, ``WHOLE``, ``TP1_ONLY``), refused by fastload (``REFUSED``), or not built with the
reason (``NOT_BUILT``); the tests check that each list still says what happens.
"""

from __future__ import annotations

#: Loaded per rank (the probe describes every write) at TP=1 and TP=2.
PLANNED = (
    "AfmoeForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "Ernie4_5_MoeForCausalLM",
    "GPT2LMHeadModel", "GPTJForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM", "Glm4ForCausalLM",
    "Glm4MoeForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM", "HrmTextForCausalLM", "LagunaForCausalLM", "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM", "LlamaForCausalLM", "MiniCPM3ForCausalLM", "Ministral3ForCausalLM", "MistralForCausalLM",
    "MixtralForCausalLM", "OPTForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "StableLmForCausalLM",
)
_ITEM = "Tensor.item() cannot be called on meta tensors"
_COMPUTED = "a tensor computed from checkpoint data"
_TRANSFORMED = "after checkpoint data was copied into it (a loader that transforms what it loaded)"
_DERIVED = "is computed by copy_ from the checkpoint data copied into"
#: Read whole through SGLang's load_weights (exact, not per rank): family -> why, as fastload logs it.
WHOLE: dict[str, str] = {
    "ApertusForCausalLM": _ITEM,         # its xIELU activation reads its parameters with .item() as it loads
    "DeepseekV3ForCausalLM": _COMPUTED,  # q_a_proj and kv_a_proj_with_mqa concatenated before the copy (MLA)
    "Gemma2ForCausalLM": _DERIVED,       # its norms keep weight + 1 in a buffer, computed from the weight loaded
    "GemmaForCausalLM": _COMPUTED,       # SGLang's Gemma norm loader adds 1 to the checkpoint's weight
    "Glm4MoeLiteForCausalLM": _COMPUTED,  # q_a_proj and kv_a_proj_with_mqa concatenated before the copy
    "HYV3ForCausalLM": _COMPUTED,        # the expert bias converted before the copy
    "MiniMaxM2ForCausalLM": _COMPUTED,   # the router's correction bias converted to float32 before the copy
}
#: Per rank at TP=1, whole at TP=2 (the sliding-window layers' loader reads a value with .item() there).
WHOLE_AT_TP2: dict[str, str] = {"GraniteSWAForCausalLM": _ITEM, "GraniteMoeSWAForCausalLM": _ITEM}
#: Loaded at TP=1 (whole: Mamba's A = -exp(A_log) is computed as it loads); at TP=2 SGLang's own
#: loader fails on these checkpoints (the fragment: its error), with the default loader as with fastload.
TP1_ONLY: dict[str, str] = {
    "FalconH1ForCausalLM": "Padding the loaded weight failed",
    "GraniteMoeHybridForCausalLM": "Padding the loaded weight failed",
}
TP1_ONLY_WHY = _TRANSFORMED
#: fastload stops the load, naming the parameters, where SGLang's default loader silently leaves them
#: as allocated: transformers writes Llama4's experts fused (experts.gate_up_proj), which no
#: parameter of SGLang's Llama4ForCausalLM takes.
REFUSED: dict[str, str] = {
    "Llama4ForCausalLM": "feed_forward.experts.w13_weight",
}
_CONFIG = "SGLang reads a field transformers' config does not have: "
_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
#: Fields SGLang reads that transformers' configs lack and the released checkpoints' configs carry:
#: added to the built checkpoint's config.json (the families above load with them).
CONFIG_ADDITIONS: dict[str, dict] = {
    "Gemma2ForCausalLM": {"hidden_act": "gelu_pytorch_tanh"},  # transformers names it hidden_activation
    # SGLang's CPU rotary embedding for MLA asks for a rope_scaling config (DeepSeek-V3's is YaRN).
    "DeepseekV3ForCausalLM": {"moe_layer_freq": 1, "rope_scaling": _YARN, "rope_parameters": _YARN},
}
#: Not loaded here: SGLang's CPU engine cannot build the model from transformers' config, with its
#: default loader as with fastload (the fragment: SGLang's error).
NOT_BUILT: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("SGLang's CPU rotary embedding for MLA requires a rope_scaling config, and more fields "
                              "of the released configs (moe_layer_freq, scoring_func, ...)", "AssertionError"),
    "Exaone4ForCausalLM": (_CONFIG + "sliding_window_pattern as a list", "object of type 'int' has no len()"),
    "ExaoneMoeForCausalLM": (_CONFIG + "is_moe_layer", "has no attribute 'is_moe_layer'"),
    "Gemma4ForCausalLM": (_CONFIG + "a global head_dim", "'head_dim' is a per-layer attribute"),
    "Mamba2ForCausalLM": (_CONFIG + "intermediate_size", "has no attribute 'intermediate_size'"),
    "Qwen3NextForCausalLM": (_CONFIG + "full_attention_interval", "has no attribute 'full_attention_interval'"),
    "PhiMoEForCausalLM": ("SGLang serves it through its Transformers backend, which finds no block_sparse_moe "
                          "module", "No module or parameter named 'model.layers.0.block_sparse_moe'"),
}
#: vLLM zoo families SGLang 0.5.23's registry does not have (not listed above): AXK1, Bloom, Ernie4_5 (dense),
#: Falcon, FalconMamba, HyperCLOVAX, Jamba, LLaMA (vLLM's alias), Mamba, Nemotron, TeleChat3; and two vLLM
#: aliases of Llama's class (IQuestCoder, InternLM3), which transformers builds as LlamaForCausalLM.

#: Families also built at the larger size (kv heads fewer than heads, a vocab SGLang pads at TP=2).
LARGE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
         "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel", "Phi3ForCausalLM", "GptOssForCausalLM")

#: Quantized checkpoints (tests/vllm/zoo.py writes them) -> whether SGLang's CPU post-processing of
#: them needs its CPU kernels: GPTQ's AMX repacking does, and they cannot be installed here, so it
#: fails in both loads alike (an error naming ``POST_NEEDS_KERNELS``) and the weights are compared as
#: loaded. AWQ loads in float16 (SGLang refuses it in bfloat16), as AutoAWQ's checkpoints say.
QUANTIZED: dict[str, bool] = {"llama-gptq-int4": True, "qwen2-awq-int4": False}
POST_NEEDS_KERNELS = "sgl_kernel"
FLOAT16 = ("qwen2-awq-int4",)
#: Quantized checkpoints SGLang's CPU engine cannot build: compressed-tensors asks CUDA for its capability.
QUANTIZED_NOT_BUILT: dict[str, str] = {
    "llama-w8a8-int8": "Torch not compiled with CUDA enabled",
    "qwen2-w8a8-fp8": "Torch not compiled with CUDA enabled",
    "mistral-w4a16-int4": "Torch not compiled with CUDA enabled",
}
