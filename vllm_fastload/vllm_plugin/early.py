"""Early reads: start reading the checkpoint while vLLM starts, not when a worker asks for it.

A vLLM start spends tens of seconds (imports, processes, distributed set-up, the model's
construction) before any worker calls ``load_weights``; meanwhile the disk sits idle. The process
that builds vLLM's config knows the checkpoint long before that, but not the model, so not the
per-rank plan: it asks the kernel to read every file of a local checkpoint into the page cache (the
node's ranks share it), in the background, where the checkpoint fits in half of the memory
available, when ``early_reads`` is on (it is off by default). ``load_weights`` then finds the pages
cached and copies them out; pages the kernel has not read yet are read as usual. Nothing stays in
vLLM's processes (each chunk is mapped, populated and unmapped), the reading thread ends with its
process, and a failure here is logged, never raised.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm.fastload")

#: The share of the memory available at start-up that early reads may fill with page cache.
MEMORY_SHARE = 0.5
#: Set in the environment of the process that started early reads, so that the processes it
#: starts (vLLM's engine core and workers, which verify the config again) do not read twice.
STARTED_ENV = "_FASTLOAD_EARLY_READS"


def start(vllm_config: Any) -> None:
    """Read the checkpoint of ``vllm_config`` into the page cache, once per path in a process tree."""
    try:
        _start(vllm_config)
    except Exception as exc:  # best effort: the loader reads at load time regardless
        logger.info("fastload: no early reads (%s: %s)", type(exc).__name__, exc)


def _start(vllm_config: Any) -> None:
    from vllm_fastload.sources.readahead import available_memory, read_ahead

    model_config = vllm_config.model_config
    path = getattr(model_config, "model_weights", "") or model_config.model
    if os.environ.get(STARTED_ENV) == path:
        return
    extra = getattr(vllm_config.load_config, "model_loader_extra_config", None) or {}
    files = files_to_read(path, extra)
    if not files:
        return
    os.environ[STARTED_ENV] = path
    if read_ahead(files, limit=int(available_memory() * MEMORY_SHARE)) is not None:
        logger.info("fastload: early reads: %d checkpoint files (%.2f GB) into the page cache while vLLM starts",
                    len(files), sum(os.path.getsize(f) for f in files) / 1e9)


def files_to_read(path: str, extra: dict[str, Any]) -> list[str]:
    """The checkpoint files to read early for a model at ``path`` loaded with fastload's ``extra``
    config (the environment's ``FASTLOAD_*`` under it); none where early reads are off."""
    from vllm_fastload.checkpoint import Checkpoint
    from vllm_fastload.config import FastloadConfig
    from vllm_fastload.sources import is_remote

    if is_remote(path) or not os.path.isdir(path):
        return []  # object stores and Hugging Face ids: nowhere on this node to read into yet
    if not FastloadConfig.from_env(**extra).early_reads:
        return []
    ckpt = Checkpoint.discover(path)
    files = sorted(ckpt.files)
    ckpt.close()
    return files
