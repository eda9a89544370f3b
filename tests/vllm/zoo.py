"""The architecture zoo: many model families through vLLM's own loader interface, cheaply.

A full ``LLM(...)`` start costs ~1 min, so a zoo of 20+ families x 2 formats would take most of
CI's budget. Instead ONE pair of processes (TP=2, gloo on CPU) sets up vLLM's distributed state
once, the way vLLM's CPU workers do (``init_distributed_environment`` +
``ensure_model_parallel_initialized`` under ``set_current_vllm_config``), and then, per family:
``EngineArgs(...).create_engine_config()`` -> ``get_model_loader(load_config)`` ->
``loader.load_model(vllm_config=..., model_config=...)`` with vLLM's default loader (``auto``),
with ``fastload`` (registered through the ``vllm.general_plugins`` entry point) and with fastload's
path through the model's ``load_weights`` (``plan_per_rank`` false), digesting every parameter and
buffer on each rank.

Run: python zoo.py OUT_DIR TP CHECKPOINT_DIR [CHECKPOINT_DIR ...]
Writes OUT_DIR/rank{r}.json: {family: {"auto": digests, "fastload": digests, "whole": digests,
"report:fastload" and "report:whole": fastload's per-rank reports, "seconds": {...}}
or {"error": ..., "traceback": ...}}.
Checkpoints are built by ``build_family`` (transformers' own model classes, several shards).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Common tiny sizes: head size 64 (vLLM-CPU attention supports 32, 64, 80, 96, ...), two heads so
#: TP=2 splits them, vocab not a multiple of 64 so vLLM pads it.
BASE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

#: family -> (transformers model_type, config overrides, what it exercises).
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "llama": ("llama", {"num_key_value_heads": 1}, "GQA, one kv head replicated on both ranks"),
    "mistral": ("mistral", {}, "dense, sliding window config"),
    "qwen2": ("qwen2", {}, "qkv biases"),
    "qwen3": ("qwen3", {"head_dim": 64}, "q/k norms"),
    "gemma": ("gemma", {"head_dim": 64}, "tied embeddings, (1+w) norms"),
    "gemma2": ("gemma2", {"head_dim": 64, "query_pre_attn_scalar": 64}, "extra pre/post feed-forward norms"),
    "gemma3": ("gemma3_text", {"head_dim": 64, "query_pre_attn_scalar": 64}, "extra norms, q/k norms"),
    "olmo2": ("olmo2", {}, "post-norms, q/k norms over all heads"),
    "cohere": ("cohere", {}, "parallel attention/MLP, tied embeddings, norms without bias"),
    "granite": ("granite", {}, "scaled residuals"),
    "phi3": ("phi3", {}, "pre-fused qkv_proj and gate_up_proj"),
    "phi": ("phi", {"partial_rotary_factor": 0.5}, "biases everywhere, dense layer norm"),
    "stablelm": ("stablelm", {}, "layer norms with bias"),
    "starcoder2": ("starcoder2", {}, "biases, plain MLP"),
    "gpt_neox": ("gpt_neox", {}, "fused per-head interleaved query_key_value"),
    "gptj": ("gptj", {"n_embd": 128, "n_head": 2, "n_layer": 2, "rotary_dim": 32}, "parallel block, lm_head bias"),
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2},
               "fused per-group interleaved query_key_value"),
    "bloom": ("bloom", {"n_embed": 128, "n_head": 2, "n_layer": 2}, "fused per-head interleaved qkv, ALiBi"),
    "gpt2": ("gpt2", {"n_embd": 128, "n_head": 2, "n_layer": 2, "n_positions": 256}, "Conv1D (transposed) weights"),
    "gpt_bigcode": ("gpt_bigcode", {"n_embd": 128, "n_head": 2, "n_layer": 2, "n_positions": 256,
                                    "multi_query": True}, "multi-query fused c_attn"),
    "mixtral": ("mixtral", MOE, "MoE"),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "shared_expert_intermediate_size": 128}, "MoE with a gated shared expert"),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "head_dim": 64}, "MoE, q/k norms"),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}, "MoE, q/k norms"),
    "deepseek_v2": ("deepseek_v2", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                    "moe_intermediate_size": 64, "first_k_dense_replace": 1, "kv_lora_rank": 64,
                                    "q_lora_rank": None, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
                                    "v_head_dim": 64, "n_group": 1, "topk_group": 1},
                    "MLA attention, shared experts, first layer dense"),
}

#: Each shard is at most this big, so every family has several files.
SHARD_SIZE = "200KB"


def build_family(name: str, root: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``name`` built by transformers' own model class (bf16, sharded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, _ = FAMILIES[name]
    out = root / name
    if (out / "config.json").exists():
        return out
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # random norms too, so a norm loaded from the wrong place shows
        for p in model.parameters():
            p.normal_(0, 0.5)
    tmp = root / f".{name}.tmp"
    model.save_pretrained(tmp, max_shard_size=SHARD_SIZE, safe_serialization=True)
    tmp.rename(out)
    return out


#: quantized family -> (base family, scheme): compressed-tensors checkpoints written here from the
#: base family's bf16 weights, in the format the compressed-tensors library documents.
QUANTIZED: dict[str, tuple[str, str]] = {
    "llama-w8a8-int8": ("llama", "int8"),
    "qwen2-w8a8-fp8": ("qwen2", "fp8"),
    "mistral-w4a16-int4": ("mistral", "int4"),
    "llama-gptq-int4": ("llama", "gptq"),
    "qwen2-awq-int4": ("qwen2", "awq"),
}
#: Group size of the int4 scheme (scales per 32 input channels).
GROUP = 32
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_quantized(name: str, root: Path) -> Path:
    """A quantized checkpoint of a zoo family, several shards: compressed-tensors W8A8 (int8 or fp8
    weights, one scale per output channel, dynamic per-token activations) or W4A16, or the GPTQ
    or AWQ int4 layout (AutoGPTQ's / AutoAWQ's tensors; GPTQ without ``g_idx``, which vLLM 0.32 has
    no parameter for)."""
    import torch
    from safetensors.torch import load_file, save_file

    base_name, scheme = QUANTIZED[name]
    base = build_family(base_name, root)
    out = root / name
    if (out / "config.json").exists():
        return out
    tmp = root / f".{name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    config = json.loads((base / "config.json").read_text())
    if scheme in ("gptq", "awq"):
        config["quantization_config"] = _int4_layout_config(scheme)
    elif scheme == "int4":  # weights only, packed eight to an int32, one scale per GROUP inputs
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
    if scheme not in ("gptq", "awq"):
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                         "config_groups": {"group_0": group}}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    index = {"metadata": {}, "weight_map": {}}
    for shard in sorted(base.glob("*.safetensors")):
        tensors = {}
        for key, t in load_file(shard).items():
            if key.endswith(".weight") and key.split(".")[-2] in _LINEARS:
                w = t.float()
                if scheme in ("gptq", "awq"):
                    tensors.update(_int4_layout(scheme, key.removesuffix(".weight"), w))
                    continue
                if scheme == "int4":
                    tensors.update(_pack_int4(key.removesuffix(".weight"), w))
                    continue
                if scheme == "int8":
                    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 127
                    q = (w / scale).round().clamp(-128, 127).to(torch.int8)
                else:
                    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 448
                    q = (w / scale).to(torch.float8_e4m3fn)
                tensors[key] = q
                tensors[key.removesuffix("weight") + "weight_scale"] = scale.to(torch.bfloat16)
            else:
                tensors[key] = t
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    tmp.rename(out)
    return out


#: Quantized checkpoints whose tensors do not match their quantization config -> (the zoo
#: checkpoint they are derived from, what is wrong). fastload must stop each with a clear error.
MISMATCHED: dict[str, tuple[str, str]] = {
    "llama-int8-config-bf16-weights": ("llama", "the int8 W8A8 config over the unquantized bf16 weights"),
    "llama-w8a8-int8-no-scales": ("llama-w8a8-int8", "the int8 W8A8 checkpoint without its weight_scale tensors"),
}


def build_mismatched(name: str, root: Path) -> Path:
    """A checkpoint from ``MISMATCHED``: its config promises tensors it does not have."""
    from safetensors.torch import load_file, save_file

    base_name, _ = MISMATCHED[name]
    out = root / name
    if (out / "config.json").exists():
        return out
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(build(base_name, root), tmp)
    if base_name in QUANTIZED:  # drop the scales, from the shards and from the index
        index = json.loads((tmp / "model.safetensors.index.json").read_text())
        for shard in sorted(tmp.glob("*.safetensors")):
            kept = {k: t for k, t in load_file(shard).items() if not k.endswith("weight_scale")}
            save_file(kept, shard, metadata={"format": "pt"})
        index["weight_map"] = {k: f for k, f in index["weight_map"].items() if not k.endswith("weight_scale")}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    else:  # the quantized sibling's config over these plain weights
        config = json.loads((tmp / "config.json").read_text())
        quantized = build_quantized("llama-w8a8-int8", root)
        config["quantization_config"] = json.loads((quantized / "config.json").read_text())["quantization_config"]
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out


def _pack_int4(prefix: str, w) -> dict:
    """compressed-tensors pack-quantized: signed int4 values + 8, eight per int32 along the input
    dim (lowest nibble first), ``weight_scale`` (out, in / GROUP), ``weight_shape`` [out, in]."""
    import torch

    out_f, in_f = w.shape
    groups = w.reshape(out_f, in_f // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-6) / 7).to(torch.bfloat16)
    q = (groups / scale.float()).round().clamp(-8, 7).to(torch.int64).reshape(out_f, in_f) + 8
    nibbles = q.reshape(out_f, in_f // 8, 8) << (4 * torch.arange(8))
    packed = nibbles.sum(dim=2)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale.squeeze(2).contiguous(),
            f"{prefix}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}


def _int4_layout_config(scheme: str) -> dict:
    if scheme == "gptq":  # static activation order (desc_act false): vLLM 0.32 refuses the other
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                "lm_head": False}
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def _int4_layout(scheme: str, prefix: str, w) -> dict:
    """GPTQ or AWQ int4 tensors of ``w`` (out, in), group-wise along the input dim.

    Both store the weight transposed, (in, out). GPTQ packs eight 4-bit values per int32 down the
    input dim (``qweight`` (in / 8, out)) and its zero points across the output dim; AWQ packs both
    across the output dim (``qweight`` (in, out / 8)). ``scales`` are fp16 (in / GROUP, out), cast by
    the loader to the model's bf16. The exact nibble order does not matter here: the test compares
    loaded bytes, and what vLLM computes with them only has to run.
    """
    import torch

    out_f, in_f = w.shape
    groups = w.t().reshape(in_f // GROUP, GROUP, out_f)
    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 7
    q = ((groups / scale).round().clamp(-8, 7) + 8).to(torch.int64).reshape(in_f, out_f)  # 0..15

    def pack(values, dim: int):
        moved = values.movedim(dim, -1)
        nibbles = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 8, 8) << (4 * torch.arange(8))
        packed = nibbles.sum(dim=-1)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return packed.movedim(-1, dim).contiguous()

    # Zero points vary (a constant would load the same whatever block a rank took).
    zeros = torch.randint(0, 16, (in_f // GROUP, out_f), generator=torch.Generator().manual_seed(out_f + in_f))
    return {f"{prefix}.qweight": pack(q, 0 if scheme == "gptq" else 1), f"{prefix}.qzeros": pack(zeros, 1),
            f"{prefix}.scales": scale.squeeze(1).to(torch.float16).contiguous()}


#: What each rank loads every family with: vLLM's default loader, fastload's per-rank plan and
#: fastload's path through the model's load_weights (the one it falls back to).
MODES: dict[str, tuple[str, dict]] = {
    "auto": ("auto", {}),
    # Row slices never read through the gaps between rows (the reader does that when gaps are
    # small, as they are in tiny models), so bytes read measure the plan itself.
    "fastload": ("fastload", {"strided_min_skip": 0, "progress": False}),
    "whole": ("fastload", {"plan_per_rank": False, "progress": False}),
}


def _engine_config(path: str, tp: int, mode: str):
    from vllm.engine.arg_utils import EngineArgs

    load_format, extra = MODES[mode]
    return EngineArgs(model=path, model_loader_extra_config=extra, tensor_parallel_size=tp, dtype="bfloat16",
                      load_format=load_format, enforce_eager=True, max_model_len=128, skip_tokenizer_init=True, seed=0,
                      distributed_executor_backend="mp" if tp > 1 else None).create_engine_config()


def _load(path: str, tp: int, mode: str) -> tuple[dict, dict | None, float]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_fastload.vllm_plugin.digests import parameter_digests

    config = _engine_config(path, tp, mode)
    loaded: dict[str, str] = {}
    start = time.perf_counter()
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        load_weights = loader.load_weights

        def load_weights_and_digest(model, model_config) -> None:
            # Right after the loader, before vLLM's post-processing (which e.g. repacks int8
            # weights into kernel handles that are no longer parameters).
            load_weights(model, model_config)
            loaded.update({f"loaded:{k}": v for k, v in parameter_digests(model).items()})

        loader.load_weights = load_weights_and_digest
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
    seconds = time.perf_counter() - start
    digests = {**loaded, **parameter_digests(model)}
    report = dict(getattr(loader, "report", None) or {}) or None
    del model
    return digests, report, seconds


def rank_main(rank: int, tp: int, port: int, out_dir: str, paths: list[str]) -> None:
    """One TP rank: set vLLM's distributed state up once, then load every family in every mode."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.plugins import load_general_plugins

    torch.set_num_threads(1)
    load_general_plugins()  # registers "fastload" through the entry point, as in vLLM's workers
    results: dict = {}
    # What vLLM's CPU worker does before loading: torch.accelerator calls become no-ops (the
    # loader calls empty_cache), the shared-memory group is named after the rendezvous port.
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    os.environ["VLLM_DIST_IDENT"] = str(port)
    first = _engine_config(paths[0], tp, "auto")
    first.model_config = None  # so initialize_model_parallel also creates the expert-parallel group
    with set_current_vllm_config(first):
        init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        ensure_model_parallel_initialized(tp, 1)
    for path in paths:
        family = Path(path).name
        entry: dict = {"seconds": {}}
        try:
            for mode in MODES:
                digests, report, seconds = _load(path, tp, mode)
                entry[mode] = digests
                entry["seconds"][mode] = round(seconds, 3)
                if mode != "auto":
                    entry[f"report:{mode}"] = report
        except BaseException as exc:  # recorded per family; the others still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
        results[family] = entry
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def backend(path: Path) -> str:
    """Which vLLM implementation serves the checkpoint: its own model class or the Transformers backend."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    module, _ = _VLLM_MODELS[arch]
    return "Transformers backend" if module == "transformers" else f"vLLM `{module}`"


def summarize(out_dir: Path, tp: int) -> dict[str, dict]:
    """family -> {"error"} or {"exact": [per rank], "planned": [...], "reason", "read_share": [...],
    "over_read": [bytes read / bytes kept - 1, per rank]} from the per-rank result files."""
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(tp)]
    out: dict[str, dict] = {}
    for family in ranks[0]:
        entries = [r.get(family, {"error": "no result on this rank"}) for r in ranks]
        errors = [e["error"] for e in entries if "error" in e]
        if errors:
            out[family] = {"error": errors[0], "traceback": next(e.get("traceback", "") for e in entries)}
            continue
        reports = [e["report:fastload"] for e in entries]
        out[family] = {
            "exact": [e["auto"] == e["fastload"] for e in entries],
            "different": [[n for n in e["auto"] if e["fastload"].get(n) != e["auto"][n]] for e in entries],
            "same_names": [e["auto"].keys() == e["fastload"].keys() for e in entries],
            # Through load_weights (plan_per_rank false): exact too, and never planned.
            "exact_whole": [e["auto"] == e["whole"] and not e["report:whole"]["planned"] for e in entries],
            "planned": [r["planned"] for r in reports],
            "reason": next((r["fallback_reason"] for r in reports if r["fallback_reason"]), None),
            "read_share": [r["bytes_read"] / r["bytes_total"] for r in reports],
            "over_read": [r["bytes_read"] / r["bytes_kept"] - 1 if r["bytes_kept"] else None for r in reports],
            "seconds": [e["seconds"] for e in entries],
        }
    return out


def describe(family: str) -> str:
    if family in QUANTIZED:
        base, scheme = QUANTIZED[family]
        if scheme == "int4":
            return f"compressed-tensors W4A16 int4 packed in int32, group size {GROUP} scales, of {base}"
        if scheme in ("gptq", "awq"):
            packed = "down the input dim" if scheme == "gptq" else "across the output dim"
            return (f"{scheme.upper()} int4 (transposed, packed in int32 {packed}; zero points, fp16 group-{GROUP} "
                    f"scales) of {base}")
        return f"compressed-tensors W8A8 {scheme} (per-channel weight scales) of {base}"
    return FAMILIES[family][2]


def build(name: str, root: Path) -> Path:
    """A zoo checkpoint, plain or quantized, built once below ``root``."""
    if name in MISMATCHED:
        return build_mismatched(name, root)
    return build_quantized(name, root) if name in QUANTIZED else build_family(name, root)


def markdown_table(summary: dict[str, dict], paths: dict[str, Path], tp: int) -> str:
    """The README's zoo table, generated from a run (``python zoo.py --table OUT_DIR TP CKPT...``)."""
    lines = [f"| family | served by | what it exercises | TP={tp} ranks bit-exact | how fastload loads it | "
             "share of the checkpoint read per rank | read beyond what the rank keeps |",
             "|---|---|---|---|---|---|---|"]
    for family, s in sorted(summary.items()):
        what = describe(family)
        if "error" in s:
            lines.append(f"| {family} | {backend(paths[family])} | {what} | error: {s['error'][:80]} | | | |")
            continue
        exact = "yes" if all(s["exact"]) else "NO"
        how = "per rank" if all(s["planned"]) else f"fallback: {s['reason']}"
        share = " / ".join(f"{x:.2f}" for x in s["read_share"])
        over = " / ".join("-" if x is None else f"{100 * x:.1f}%" for x in s["over_read"])
        lines.append(f"| {family} | {backend(paths[family])} | {what} | {exact} | {how} | {share} | {over} |")
    return "\n".join(lines)


def main() -> None:
    import multiprocessing as mp
    import socket

    if sys.argv[1] == "--table":
        out_dir, tp, paths = Path(sys.argv[2]), int(sys.argv[3]), [Path(p) for p in sys.argv[4:]]
        print(markdown_table(summarize(out_dir, tp), {p.name: p for p in paths}, tp))
        return
    out_dir, tp, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, tp, port, out_dir, paths)) for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + float(os.environ.get("ZOO_TIMEOUT", "900"))
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    for p in procs:  # a rank stuck (e.g. in a collective the other rank never reached) must not hang CI
        if p.is_alive():
            p.kill()
            p.join()
    sys.exit(max(abs(p.exitcode or 0) for p in procs))


if __name__ == "__main__":
    main()
