"""The architecture zoo: vLLM's text-generation models, built tiny, loaded exactly on every rank.

Checkpoints: every architecture of vLLM's registry that transformers ships a class for, built
automatically at two sizes with two shard sizes (``registry``), quantized checkpoints of three of
them (compressed-tensors int8, fp8 and int4, GPTQ, AWQ) and two that do not match their
quantization config. Each is loaded through vLLM's own loader interface, on every rank, by the
default loader and by fastload with the settings users get (``MODES``) and, for some, with the
other reader settings (``READER_MODES``), in rank processes that set up vLLM's distributed state once: the code of
``vllm-fastload verify`` (``vllm_fastload.tools.verify``).

Run: python zoo.py OUT_DIR TP CHECKPOINT_DIR [CHECKPOINT_DIR ...]  (prints the summary per checkpoint)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
import registry

#: quantized family -> (base family, scheme): compressed-tensors checkpoints written here from the
#: base family's bf16 weights, in the format the compressed-tensors library documents.
QUANTIZED: dict[str, tuple[str, str]] = {
    "llama-w8a8-int8": ("LlamaForCausalLM", "int8"),
    "qwen2-w8a8-fp8": ("Qwen2ForCausalLM", "fp8"),
    "mistral-w4a16-int4": ("MistralForCausalLM", "int4"),
    "llama-gptq-int4": ("LlamaForCausalLM", "gptq"),
    "qwen2-awq-int4": ("Qwen2ForCausalLM", "awq"),
}


def build_quantized(name: str, root: Path) -> Path:
    """A quantized checkpoint of a zoo family, several shards (``vllm_fastload.tools.quantize``)."""
    from vllm_fastload.tools.quantize import quantize_checkpoint

    base_name, scheme = QUANTIZED[name]
    return quantize_checkpoint(registry.build(base_name, root, "small"), root / name, scheme)


#: Quantized checkpoints whose tensors do not match their quantization config -> (the zoo
#: checkpoint they are derived from, what is wrong). fastload must stop each with a clear error.
MISMATCHED: dict[str, tuple[str, str]] = {
    "llama-int8-config-bf16-weights": ("LlamaForCausalLM", "the int8 W8A8 config over the unquantized bf16 weights"),
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
    shutil.copytree(registry.build(base_name, root, "small") if base_name not in QUANTIZED else
                    build_quantized(base_name, root), tmp)
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


#: How each rank loads every checkpoint: vLLM's default loader (the reference) and fastload as users get it.
MODES: dict[str, tuple[str, dict]] = {
    "default": ("auto", {}),
    "fastload": ("fastload", {"progress": False}),
}
#: The other reader settings, run on the smaller size of every architecture and on the quantized
#: checkpoints: slices read through their gaps as on network filesystems and object stores (no
#: O_DIRECT, no mapped views), and fastload's path through the model's load_weights.
READER_MODES: dict[str, tuple[str, dict]] = {
    "enclosing": ("fastload", {"progress": False, "strided_min_skip": 1 << 62, "direct_io": "never",
                               "map_cached": False}),
    "whole": ("fastload", {"progress": False, "plan_per_rank": False}),
}
#: Families run at TP=4 too (four rank processes on this machine's two cores, so a chosen few of
#: the larger size): dense, fused-QKV, transposed (Conv1D), interleaved-head, MLA, MoE, state-space.
TP4 = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
       "GPT2LMHeadModel", "BloomForCausalLM", "FalconForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
       "Qwen2MoeForCausalLM", "Mamba2ForCausalLM")


def run(paths: list[Path], tp: int, out_dir: Path, more: dict[Path, dict] | None = None) -> dict[str, dict]:
    """Load every checkpoint on ``tp`` ranks in ``MODES`` (and ``more[path]``); ``summarize``'d per
    checkpoint name."""
    from vllm_fastload.tools.verify import run_ranks

    results = run_ranks([str(p) for p in paths], tp, out_dir, MODES, dtype="bfloat16",
                        timeout=float(os.environ.get("ZOO_TIMEOUT", "1800")), verbose=False,
                        more={str(p): m for p, m in (more or {}).items()})
    return {Path(p).name: summarize(results, str(p)) for p in paths}


def summarize(results: list[dict], path: str) -> dict:
    """{"error", "traceback"} or {"exact": {mode: [per rank]}, "different": {mode: first (rank, name)},
    "planned": [...], "reason", "read_share": [...], "over_read": [bytes read / bytes kept - 1, ...]}
    with fastload's users' settings in "planned", "read_share" and "over_read"."""
    from vllm_fastload.tools.verify import compare

    entries = [r[path] for r in results]
    failed = [e for e in entries if "error" in e]
    if failed:
        return {"error": failed[0]["error"], "traceback": failed[0].get("traceback", "")}
    verdicts = {v.mode: v for v in compare(results, path)}
    reports = [e["fastload"]["report"] for e in entries]
    return {
        "exact": {mode: [not d for d in v.differing] for mode, v in verdicts.items()},
        "different": {mode: v.first_difference for mode, v in verdicts.items() if v.first_difference},
        "planned": [r["planned"] for r in reports],
        "reason": next((r["fallback_reason"] for r in reports if r["fallback_reason"]), None),
        "read_share": [r["bytes_read"] / r["bytes_total"] for r in reports],
        "over_read": [r["bytes_read"] / r["bytes_kept"] - 1 if r["bytes_kept"] else None for r in reports],
        "seconds": [{mode: e[mode]["seconds"] for mode in e} for e in entries],
    }


def backend(path: Path) -> str:
    """Which vLLM implementation serves the checkpoint: its own model class or the Transformers backend."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    # transformers writes its own spelling of some names (PhimoeForCausalLM for vLLM's PhiMoE...)
    module, _ = next(v for k, v in _VLLM_MODELS.items() if k.lower() == arch.lower())
    return "Transformers backend" if module == "transformers" else f"vLLM `{module}`"


def build(name: str, root: Path) -> Path:
    """A zoo checkpoint (``ARCH-SIZE``, a quantized or a mismatched one), built once below ``root``."""
    if name in MISMATCHED:
        return build_mismatched(name, root)
    if name in QUANTIZED:
        return build_quantized(name, root)
    arch, size = name.rsplit("-", 1)
    return registry.build(arch, root, size)


def markdown_table(summary: dict[str, dict], paths: dict[str, Path], tp4: dict[str, dict]) -> str:
    """The docs' model-families table, generated from a run of the zoo tests."""
    lines = ["| checkpoint | served by | TP=2 ranks bit-exact (users' settings; other reader settings) | TP=4 | "
             "how fastload loads it | share of the checkpoint read per rank |",
             "|---|---|---|---|---|---|"]
    for name, s in sorted(summary.items()):
        if "error" in s:
            lines.append(f"| {name} | {backend(paths[name])} | error: {s['error'][:80]} | | | |")
            continue
        exact = "yes" if all(s["exact"]["fastload"]) else "NO"
        others = [m for m in READER_MODES if m in s["exact"]]
        if others:
            exact += f" ({', '.join(m + (': yes' if all(s['exact'][m]) else ': NO') for m in others)})"
        four = tp4.get(name)
        four_text = "" if four is None else "error" if "error" in four else (
            "yes" if all(four["exact"]["fastload"]) else "NO")
        how = "per rank" if all(s["planned"]) else f"whole, through load_weights: {s['reason']}"
        share = " / ".join(f"{x:.2f}" for x in s["read_share"])
        lines.append(f"| {name} | {backend(paths[name])} | {exact} | {four_text} | {how} | {share} |")
    return "\n".join(lines)


def main() -> None:
    out_dir, tp, paths = Path(sys.argv[1]), int(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    summary = run(paths, tp, out_dir, {p: READER_MODES for p in paths})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
