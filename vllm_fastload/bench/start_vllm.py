"""One benchmark start: ``python -m vllm_fastload.bench.start_vllm MODEL FORMAT TP [EXTRA_JSON [LLM_KWARGS_JSON]]``."""

import json
import os
import sys
import time


def main() -> None:
    from vllm import LLM

    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
    kwargs = {"model_loader_extra_config": extra} if extra else {}
    if len(sys.argv) > 5 and sys.argv[5]:
        kwargs.update(json.loads(sys.argv[5]))  # e.g. {"safetensors_load_strategy": "prefetch"}
    LLM(model=model, load_format=load_format, tensor_parallel_size=tp, max_model_len=128, enforce_eager=True,
        dtype="bfloat16", skip_tokenizer_init=True, distributed_executor_backend="mp" if tp > 1 else None,
        **kwargs)
    # The engine is constructed: ready to serve (wall clock, compared with the bench's start time).
    out = os.environ.get("FASTLOAD_DEV_BENCH_DIR")
    if out:
        with open(os.path.join(out, "ready.json"), "w") as f:
            json.dump({"ready_at": time.time()}, f)


if __name__ == "__main__":
    main()
