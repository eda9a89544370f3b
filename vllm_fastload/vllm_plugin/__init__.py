"""vLLM integration: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls it once per process (API server, engine core, every worker), so it must be
idempotent. vLLM logs and swallows a plugin's errors, after which ``--load-format fastload``
would only say "not supported": so ``register`` raises only where it cannot register at all, and
the loader itself stops start-up over anything else missing (``compat.require``).
"""

from __future__ import annotations

LOAD_FORMAT = "fastload"


def register() -> None:
    """Register ``FastloadModelLoader`` under ``--load-format fastload`` (idempotent).

    On a vLLM outside the supported range it logs one line; where vLLM lacks the loader registry
    itself it raises, naming it (vLLM logs that); other missing interfaces stop the load when the
    loader is created, before anything is read (``compat.require``).
    """
    from vllm_fastload.vllm_plugin import compat

    compat.note_release()
    if compat.REGISTRATION & set(compat.missing_interfaces()):
        compat.require()
    from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

    if compat.register_loader(LOAD_FORMAT, FastloadModelLoader):
        _route_core_logs_to_vllm()
    compat.allow_object_storage(LOAD_FORMAT, _is_object_uri)


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
