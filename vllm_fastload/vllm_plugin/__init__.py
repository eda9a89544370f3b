"""vLLM integration: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls it once per process (API server, engine core, every worker), so it must be
idempotent, and it must never stop a vLLM that does not load with fastload: an exception raised
here would end every start of every model. So ``register`` only warns where it cannot register,
and the loader, once chosen, stops start-up over anything else missing (``compat.require``).
"""

from __future__ import annotations

import logging

LOAD_FORMAT = "fastload"


def register() -> None:
    """Register ``FastloadModelLoader`` under ``--load-format fastload`` (idempotent).

    On a vLLM outside the supported range it logs one line; where vLLM lacks what registering
    needs it logs which (``--load-format fastload`` is then unknown to vLLM); other missing
    interfaces stop the load when the loader is created, before anything is read.
    """
    from vllm_fastload.vllm_plugin import compat

    compat.note_release()
    if compat.REGISTRATION & set(compat.missing_interfaces()):
        try:
            compat.require()
        except compat.UnsupportedVllmError as exc:
            compat.logger.warning("%s", exc)
        return
    from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

    if compat.register_loader(LOAD_FORMAT, FastloadModelLoader):
        _route_core_logs_to_vllm()
    compat.allow_object_storage(LOAD_FORMAT, _is_object_uri)
    from vllm_fastload.vllm_plugin import early

    compat.on_config(LOAD_FORMAT, early.start)


def _is_object_uri(weights: object) -> bool:
    from vllm_fastload.sources import is_remote

    return isinstance(weights, str) and is_remote(weights)


def _route_core_logs_to_vllm() -> None:
    """The core logs to "vllm_fastload" (it knows nothing of vLLM); show those lines like vLLM's.

    Routed when each line is logged, not now: vLLM may configure its logging after loading plugins
    (0.32 does it lazily), and lines logged before that, or with vLLM's logging off, go where any
    library's would."""
    core = logging.getLogger("vllm_fastload")
    if not any(isinstance(f, _ToVllm) for f in core.filters):
        core.addFilter(_ToVllm())
        if core.level == logging.NOTSET:
            from vllm import envs

            core.setLevel(getattr(logging, str(envs.VLLM_LOGGING_LEVEL).upper(), logging.INFO))


class _ToVllm:
    """A filter on the core's logger that hands each record to "vllm.fastload" once vLLM's
    logging has handlers, and drops it there (vLLM's loggers do not propagate to the root)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.getLogger("vllm").handlers:
            return True
        logging.getLogger("vllm.fastload").handle(record)
        return False
