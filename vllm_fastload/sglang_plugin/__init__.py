"""SGLang integration: ``register()`` is the ``sglang.srt.plugins`` entry point.

SGLang's ``load_plugins()`` runs every entry point of that group, then applies the hooks they
registered, in each process it starts that may need them: the launching process
(``sglang.launch_server``, ``sglang serve``, ``sglang.Engine``) and every scheduler process, which
is where each tensor-parallel rank builds and loads the model. So ``--load-format fastload`` is
accepted where the arguments are parsed and loads with fastload where the weights are loaded.
``SGLANG_PLUGINS``, where set, must name ``fastload``.

``register`` must be cheap and idempotent, and must never stop an SGLang that does not load with
fastload: it only warns where it cannot register (``--load-format fastload`` is then refused by
SGLang as an invalid choice); the loader, once chosen, stops over anything else missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_fastload.model import EarlyStart

LOAD_FORMAT = "fastload"
_registered = False


def register() -> None:
    """Accept ``--load-format fastload`` and route it to ``FastloadModelLoader`` (idempotent); start
    early reads where SGLang resolves its arguments."""
    global _registered
    if _registered:
        return
    from vllm_fastload.sglang_plugin import compat

    compat.note_release()
    missing = compat.missing_interfaces(compat.REGISTRATION)
    if missing:
        compat.logger.warning("fastload: cannot register --load-format %s on SGLang %s: it lacks %s", LOAD_FORMAT,
                              compat.sglang_version(), ", ".join(missing))
        return
    _registered = True
    compat.accept_load_format(LOAD_FORMAT, _loader_class)
    compat.on_server_args(LOAD_FORMAT, _start_early_reads)


def _loader_class() -> type:
    from vllm_fastload.sglang_plugin.loader import FastloadModelLoader

    return FastloadModelLoader


def _start_early_reads(server_args: Any) -> None:
    """Early reads (``vllm_fastload.early``) from the first process that resolves SGLang's arguments
    (the launcher). This runs after every ``resolve_once`` in every process (``compat.on_server_args``);
    the early reads' environment guard makes the later calls, the schedulers' among them, read nothing."""
    from vllm_fastload.model import start_early_reads

    start_early_reads("SGLang", lambda: _early_settings(server_args))


def _early_settings(server_args: Any) -> EarlyStart:
    import json

    from vllm_fastload.model import EarlyStart
    from vllm_fastload.sglang_plugin import compat

    extra = server_args.model_loader_extra_config or {}
    # SGLang's start-up keeps every core busy until the load (its scheduler and detokenizer
    # processes start together, each rank's threads bound to all the cores it has): on idle CPU
    # time alone the reads would not finish before it.
    return EarlyStart(path=str(server_args.model_path), extra=json.loads(extra) if isinstance(extra, str) else extra,
                      local_ranks=compat.local_ranks(server_args), revision=getattr(server_args, "revision", None),
                      download_dir=getattr(server_args, "download_dir", None), idle_cpu=False)
