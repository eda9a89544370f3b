"""The engine-free API: read a checkpoint (or one rank's slices of it) into tensors you own.

    python examples/engine_free.py [CHECKPOINT_DIR]
"""

import sys
import time

import torch

import vllm_fastload
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.tp_rules import rank_requests


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(write_checkpoint(".fastload/example-model", "tiny-llama"))
    config = vllm_fastload.FastloadConfig(on_layer_ready=[lambda e: print(f"  {e.name} ready")], progress=False)
    with vllm_fastload.open(model, config=config) as ckpt:
        # 1. Everything, in layer order, copied into tensors we allocated (as an engine does).
        params = {name: torch.empty(ckpt.info(name).shape, dtype=torch.bfloat16) for name in ckpt.keys()}
        start = time.perf_counter()
        for name, tensor in ckpt.iter_tensors():
            params[name].copy_(tensor)  # the view stays valid while held; copying and dropping recycles it
        print(f"iter_tensors: {time.perf_counter() - start:.3f} s")

        # 2. Straight into our tensors, no intermediate buffer.
        stats = ckpt.read_into(params)
        print(f"read_into: {stats.bytes_read / 1e6:.1f} MB read")

        # 3. What rank 1 of 2 would need, and only that.
        plan = ckpt.plan(rank_requests(ckpt.tensors, tp=2, rank=1))
        print(plan.summary())


if __name__ == "__main__":
    main()
