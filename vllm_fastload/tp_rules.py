"""Name-based tensor-parallel slicing for inspection (``vllm-fastload plan --tp``) and benchmarks.

The vLLM loader does not use this: it learns each rank's slices from the model itself. This
is the usual Megatron layout by Hugging Face tensor names, good enough to see what a rank
would read: column-parallel weights (and their biases) split along dim 0, row-parallel
weights along dim 1, everything else (norms, row-parallel biases, routers) whole. The rules
themselves live with the early reads of a multi-node start, which estimate a node's slices by
them too (``early.node_share.split_dim``).
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_fastload import TensorInfo, TensorRequest
from vllm_fastload.early.node_share import split_dim
from vllm_fastload.sizes import ceil_div


def rank_requests(tensors: Mapping[str, TensorInfo], tp: int, rank: int) -> list[TensorRequest]:
    """This rank's share of every tensor of ``tensors`` (``FastCheckpoint.tensors``): ceil-sized
    blocks, the last one possibly short."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in [0, {tp})")
    requests = []
    for name, info in tensors.items():
        dim = split_dim(name, len(info.shape)) if tp > 1 and info.shape else None
        if dim is None:
            requests.append(TensorRequest(name))
            continue
        size = info.shape[dim]
        block = ceil_div(size, tp)
        start = min(size, rank * block)
        requests.append(TensorRequest(name, dim=dim, start=start, length=min(size, start + block) - start))
    return requests
