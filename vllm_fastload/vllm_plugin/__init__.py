"""vLLM integration: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls it once per process (API server, engine core, every worker), so it must be
idempotent, and it must never stop a vLLM that does not load with fastload: an exception raised
here would end every start of every model. So ``register`` only warns where it cannot register,
and the loader, once chosen, stops start-up over anything else missing (``compat.require``).

Logging: every logger of the package is named after the package it logs for: "vllm_fastload" for
the engine-independent code (one logger, so that one level shows or hides all of it), and
"vllm_fastload.vllm_plugin", "vllm_fastload.sglang_plugin" for the adapters. Once registered, this
adapter shows that whole tree in vLLM's log, with vLLM's handlers and format (``_route_logs_to_vllm``).
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

    _route_logs_to_vllm()  # first: the lines below belong in vLLM's log too
    compat.note_release()
    if compat.REGISTRATION & set(compat.missing_interfaces()):
        try:
            compat.require()
        except compat.UnsupportedVllmError as exc:
            compat.logger.warning("%s", exc)
        return
    from vllm_fastload.vllm_plugin.loader import FastloadModelLoader

    compat.register_loader(LOAD_FORMAT, FastloadModelLoader)
    compat.allow_object_storage(LOAD_FORMAT, _is_object_uri)
    from vllm_fastload.vllm_plugin import early

    compat.on_config(LOAD_FORMAT, early.start)


def _is_object_uri(weights: object) -> bool:
    from vllm_fastload import is_remote

    return isinstance(weights, str) and is_remote(weights)


def _route_logs_to_vllm() -> None:
    """Show the lines of the "vllm_fastload" tree (the engine-independent code knows nothing of
    vLLM, the adapter's own are under it) like vLLM's own, at vLLM's level unless one is set.

    Routed when each line is logged, not now: vLLM may configure its logging after loading plugins
    (0.32 does it lazily), and lines logged before that, or with vLLM's logging off, go where any
    library's would."""
    tree = logging.getLogger("vllm_fastload")
    if not any(isinstance(h, _ToVllm) for h in tree.handlers):
        tree.addHandler(_ToVllm())
        tree.propagate = False  # _ToVllm hands on what vLLM does not take, as propagating would
        if tree.level == logging.NOTSET:
            try:
                from vllm import envs

                level = getattr(logging, str(envs.VLLM_LOGGING_LEVEL).upper(), logging.INFO)
            except (ImportError, AttributeError):  # a vLLM without it: its default
                level = logging.INFO
            tree.setLevel(level)


class _ToVllm(logging.Handler):
    """On the "vllm_fastload" logger: each record of its tree to the handlers of vLLM's "vllm"
    logger (so vLLM's format applies, and the record goes no further, as vLLM's own do not) once
    vLLM's logging has handlers; before that to the root's handlers, where it would have
    propagated. A handler that is on the tree as well (pytest's log capture attaches itself to
    every logger that does not propagate) already has the record and is skipped."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_handlers = logging.getLogger("vllm").handlers
        root = logging.getLogger()
        if not vllm_handlers and not root.handlers:  # as an unconfigured program would: Python's last resort
            if logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)
            return
        tree = logging.getLogger("vllm_fastload").handlers
        for handler in vllm_handlers or root.handlers:
            if handler not in tree and record.levelno >= handler.level:
                handler.handle(record)
