"""``FASTLOAD_TGI=1``: activate tgi_patch in every TGI shard process, from a ``.pth`` line.

``fastload_tgi.pth`` in site-packages runs ``install_if_enabled()`` at every interpreter
start-up, so this module imports only ``os`` and ``sys`` and returns at once when the
variable is unset. When it is set, a ``sys.meta_path`` finder wraps the loader of
``text_generation_server.utils.weights`` so that ``apply()`` runs the moment that module has
executed, before ``utils/__init__.py`` (or anything else) imports ``Weights`` from it: every
later importer gets FastWeights, and ``apply()`` rebinds the (rare) earlier ones.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (at run time this module imports only os and sys, see above)
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

ENV = "FASTLOAD_TGI"
TARGET_MODULE = "text_generation_server.utils.weights"
_OFF = {"", "0", "false", "no", "off"}


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Set and not one of "", 0, false, no, off (any case)."""
    value = (os.environ if environ is None else environ).get(ENV)
    return value is not None and value.strip().lower() not in _OFF


def install_if_enabled() -> None:
    """The ``.pth`` entry point: nothing unless FASTLOAD_TGI is set; never raises into ``site``."""
    if not enabled():
        return
    try:
        install()
    except Exception as exc:  # a failing .pth line would only print a cryptic "Error processing line"
        sys.stderr.write(f"fastload-tgi: FASTLOAD_TGI is set but the import hook failed: {exc!r}\n")


def install() -> None:
    """Patch TGI now if its weights module is loaded, else as soon as it is imported."""
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        _activate(module)
    elif not any(isinstance(f, _WeightsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _WeightsFinder())


def uninstall() -> None:
    """Remove the import hook (``tgi_patch.revert()`` undoes a patch already applied)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WeightsFinder)]


def _activate(module: ModuleType) -> None:
    from tgi_patch.activate import apply

    apply(module)


class _WeightsFinder:
    """Finds TGI's weights module through the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]  # a Loader by its methods
        return spec


class _PatchingLoader:
    """Delegates to the real loader; after the module body has run, calls ``apply(module)``."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _activate(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)
