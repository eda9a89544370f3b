"""``apply()`` / ``revert()``: swap TGI's ``Weights`` for FastWeights in a running process.

TGI has no loader plugin, and its modules bind the class at import time
(``from text_generation_server.utils import Weights``), so replacing the attribute of
``utils.weights`` alone would miss every module already imported. ``apply()`` therefore
rebinds the global ``Weights`` of every ``text_generation_server`` module that holds TGI's
class; modules imported later pick up the replacement from ``utils.weights`` themselves.

The replacement subclasses both FastWeights and TGI's class: FastWeights' methods win, and
``isinstance(w, <TGI's Weights>)`` keeps holding for code that checks it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types
from dataclasses import dataclass

from tgi_patch.log import emit
from tgi_patch.weights import FastWeights

PACKAGE = "text_generation_server"
TARGET_MODULE = "text_generation_server.utils.weights"


@dataclass(frozen=True)
class _Patch:
    original: object
    replacement: type


_patch: _Patch | None = None
_lock = threading.RLock()


def apply(module: types.ModuleType | None = None) -> type:
    """Patch TGI (importing ``text_generation_server.utils.weights`` unless given); idempotent.

    Returns the class now bound as ``Weights``. Calling it again also rebinds modules that
    imported TGI's class in the meantime (only possible if something restored it).
    """
    global _patch
    with _lock:
        module = importlib.import_module(TARGET_MODULE) if module is None else module
        current = module.Weights
        first = _patch is None
        if _patch is None or current not in (_patch.original, _patch.replacement):
            _patch = _Patch(current, _replacement_for(current))
        rebound = _rebind(_patch.original, _patch.replacement)
        if first:
            modules = f"{len(rebound)} module{'' if len(rebound) == 1 else 's'}"
            emit(f"fastload-tgi: {TARGET_MODULE}.Weights -> tgi_patch.FastWeights "
                 f"({modules} rebound, pid {os.getpid()})")
        return _patch.replacement


def revert() -> bool:
    """Give every module that holds the replacement TGI's class back; False if nothing was applied."""
    global _patch
    with _lock:
        if _patch is None:
            return False
        _rebind(_patch.replacement, _patch.original)
        _patch = None
        return True


def is_applied() -> bool:
    return _patch is not None


def _replacement_for(original: object) -> type:
    """FastWeights with TGI's class as a second base, or FastWeights itself if that is not a class."""
    if not isinstance(original, type):
        return FastWeights
    return types.new_class("FastWeights", (FastWeights, original), {},
                           lambda ns: ns.update(__module__=__name__, __doc__=FastWeights.__doc__))


def _rebind(old: object, new: object) -> list[str]:
    """Set ``Weights = new`` in every ``text_generation_server`` module whose ``Weights`` is ``old``."""
    rebound = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            continue
        if getattr(mod, "__dict__", {}).get("Weights") is old:
            setattr(mod, "Weights", new)  # noqa: B010 (any module of the package, typed or not)
            rebound.append(name)
    return rebound
