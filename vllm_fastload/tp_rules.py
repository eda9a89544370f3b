"""Name-based tensor-parallel slicing for inspection (``vllm-fastload plan --tp``) and benchmarks.

The vLLM loader does not use this: it learns each rank's slices from the model itself. This
is the usual Megatron layout by Hugging Face tensor names, good enough to see what a rank
would read: column-parallel weights (and their biases) split along dim 0, row-parallel
weights along dim 1, everything else (norms, row-parallel biases, routers) whole.
"""

from __future__ import annotations

from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.plan import TensorRequest
from vllm_fastload.sizes import ceil_div

COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "w1", "w3",
          "embed_tokens", "lm_head", "query_key_value", "c_fc", "fc1", "wte")
ROW = ("o_proj", "down_proj", "w2", "dense", "c_proj", "fc2", "out_proj")


def split_dim(name: str, ndim: int) -> int | None:
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else parts[0]
    if module in COLUMN:
        return 0
    if module in ROW and parts[-1] == "weight" and ndim == 2:
        return 1
    return None


def rank_requests(checkpoint: Checkpoint, tp: int, rank: int) -> list[TensorRequest]:
    """This rank's share of every tensor: ceil-sized blocks, the last one possibly short."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in [0, {tp})")
    requests = []
    for name, info in checkpoint.tensors.items():
        dim = split_dim(name, len(info.shape)) if tp > 1 and info.shape else None
        if dim is None:
            requests.append(TensorRequest(name))
            continue
        size = info.shape[dim]
        block = ceil_div(size, tp)
        start = min(size, rank * block)
        requests.append(TensorRequest(name, dim=dim, start=start, length=min(size, start + block) - start))
    return requests
