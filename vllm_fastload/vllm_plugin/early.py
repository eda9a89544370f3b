"""Early reads while vLLM starts (the mechanism, engine-independent, is ``model.early``).

vLLM verifies its config (``VllmConfig.try_verify_and_update_config``) in the API server's or
``LLM(...)``'s process long before the workers load weights: ``start`` is called there
(``compat.on_config``) and reads the checkpoint into the page cache for the ranks of this node.
"""

from __future__ import annotations

from typing import Any

from vllm_fastload.model import early
from vllm_fastload.model.early import files_to_read

__all__ = ["files_to_read", "start"]


def start(vllm_config: Any) -> None:
    """Read the checkpoint of ``vllm_config`` into the page cache, once per path in a process tree."""
    early.start("vLLM", lambda: _settings(vllm_config))


def _settings(vllm_config: Any) -> early.Start:
    model_config, load_config = vllm_config.model_config, vllm_config.load_config
    return early.Start(path=getattr(model_config, "model_weights", "") or model_config.model,
                       extra=getattr(load_config, "model_loader_extra_config", None) or {},
                       local_ranks=_local_ranks(vllm_config), revision=getattr(model_config, "revision", None),
                       download_dir=getattr(load_config, "download_dir", None))


def _local_ranks(vllm_config: Any) -> int:
    """How many ranks load on this node (each leaves its marks): the node's share of the
    tensor- and pipeline-parallel group, for each data-parallel engine the node runs."""
    parallel = vllm_config.parallel_config
    ranks = getattr(parallel, "local_world_size", None)
    if ranks is None:  # vLLM before 0.32
        ranks = max(int(parallel.world_size) // max(int(getattr(parallel, "nnodes", 1) or 1), 1), 1)
    engines = getattr(parallel, "data_parallel_size_local", 1)
    return int(ranks) * int(1 if engines is None else engines)
