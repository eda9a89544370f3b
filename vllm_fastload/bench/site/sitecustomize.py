"""The benchmark's timers inside the vLLM it starts: ``vllm-fastload bench`` puts this folder on the
``PYTHONPATH`` of that vLLM only, so every one of its processes installs ``worker_hooks`` right after
vLLM loads its plugins. The loader itself never imports benchmark code."""

import os

if os.environ.get("FASTLOAD_DEV_BENCH_DIR"):
    import vllm.plugins as _plugins

    _load_general_plugins = _plugins.load_general_plugins

    def load_general_plugins() -> None:
        _load_general_plugins()
        from vllm_fastload.bench.worker_hooks import install

        install(os.environ["FASTLOAD_DEV_BENCH_DIR"])

    _plugins.load_general_plugins = load_general_plugins
