"""Test-only: makes the vLLM of every process started with this directory on ``PYTHONPATH`` look
like a release fastload does not know, version 0.99.0 without ``DefaultModelLoader.track_weights_loading``,
just before vLLM calls fastload's plugin entry point (tests/vllm/test_compat.py)."""

import vllm_fastload.vllm_plugin as _plugin

_register = _plugin.register


def _register_on_an_unknown_vllm() -> None:
    import vllm
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    vllm.__version__ = "0.99.0"
    if "track_weights_loading" in vars(DefaultModelLoader):
        del DefaultModelLoader.track_weights_loading
    _register()


_plugin.register = _register_on_an_unknown_vllm
