"""vLLM integration: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls it once per process (API server, engine core, every worker), so it must be
idempotent and must not fail loudly: vLLM logs and swallows plugin errors, after which
``--load-format fastload`` would only say "not supported".
"""

from __future__ import annotations

import os

LOAD_FORMAT = "fastload"


def register() -> None:
    """Register ``FastloadModelLoader`` under ``--load-format fastload`` (idempotent)."""
    from vllm.model_executor import model_loader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if LOAD_FORMAT not in registry:
        from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(FastloadModelLoader)
        _route_core_logs_to_vllm()
    bench_dir = os.environ.get("FASTLOAD_BENCH_DIR")
    if bench_dir:  # `vllm-fastload bench` measures load_weights inside each worker
        from vllm_fastload.bench.worker_hooks import install

        install(bench_dir)


def _route_core_logs_to_vllm() -> None:
    """The core logs to "vllm_fastload" (it knows nothing of vLLM); show those lines like vLLM's."""
    import logging

    core, host = logging.getLogger("vllm_fastload"), logging.getLogger("vllm")
    if not core.handlers and host.handlers:
        for handler in host.handlers:
            core.addHandler(handler)
        core.setLevel(host.level or logging.INFO)
        core.propagate = False
