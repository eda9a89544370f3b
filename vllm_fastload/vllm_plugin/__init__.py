"""vLLM integration: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls it once per process (API server, engine core, every worker), so it must be
idempotent and must not fail loudly: vLLM logs and swallows plugin errors, after which
``--load-format fastload`` would only say "not supported".
"""

from __future__ import annotations

LOAD_FORMAT = "fastload"


def register() -> None:
    """Register ``FastloadModelLoader`` under ``--load-format fastload`` (idempotent)."""
    from vllm.model_executor import model_loader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if LOAD_FORMAT not in registry:
        from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(FastloadModelLoader)
        _route_core_logs_to_vllm()
    _allow_object_storage()


def _allow_object_storage() -> None:
    """Let ``--load-format fastload`` load ``s3://``/``gs://``/``az://`` models (idempotent).

    vLLM 0.32 refuses every load format but its own streamers for a model whose weights are in
    object storage (``VllmConfig.try_verify_and_update_config``, an inline tuple of names). For
    fastload only, the check runs with ``model_config.model_weights`` blanked and restored after,
    so it sees a local model; everything else the method does is unchanged. tests/remote
    fails loudly if a vLLM upgrade moves the check.
    """
    try:
        from vllm.config.vllm import VllmConfig

        original = VllmConfig.try_verify_and_update_config
    except (ImportError, AttributeError) as exc:  # local checkpoints must keep loading regardless
        import logging

        logging.getLogger("vllm.fastload").warning(
            "fastload: cannot find vLLM's object-storage check (%s); s3:// models stay refused for "
            "--load-format fastload until vllm_plugin is updated for this vLLM", exc)
        return
    if getattr(original, "_fastload_wrapped", False):
        return

    def try_verify_and_update_config(self) -> None:
        model_config = getattr(self, "model_config", None)
        weights = getattr(model_config, "model_weights", "") if model_config is not None else ""
        load_format = str(getattr(getattr(self, "load_config", None), "load_format", "")).lower()
        if load_format != LOAD_FORMAT or not _is_object_uri(weights):
            return original(self)
        model_config.model_weights = ""
        try:
            return original(self)
        finally:
            model_config.model_weights = weights

    try_verify_and_update_config._fastload_wrapped = True
    try_verify_and_update_config.__wrapped__ = original
    try_verify_and_update_config.__doc__ = original.__doc__
    VllmConfig.try_verify_and_update_config = try_verify_and_update_config


def _is_object_uri(weights: object) -> bool:
    from vllm_fastload.sources import is_remote

    return isinstance(weights, str) and is_remote(weights)


def _route_core_logs_to_vllm() -> None:
    """The core logs to "vllm_fastload" (it knows nothing of vLLM); show those lines like vLLM's."""
    import logging

    core, host = logging.getLogger("vllm_fastload"), logging.getLogger("vllm")
    if not core.handlers and host.handlers:
        for handler in host.handlers:
            core.addHandler(handler)
        core.setLevel(host.level or logging.INFO)
        core.propagate = False
