"""Where checkpoint bytes come from: a ``Source`` (``sources.base``) is a local file
(``LocalSource``: a descriptor the host reader ``preadv``s) or an object (``ObjectSource``:
ranged GETs through obstore, in ``sources.object_store``; a checkpoint's objects are found by
``sources.remote_checkpoint``, failures told apart by ``sources.store_errors``).

Importing this package costs nothing: obstore is imported only when a URI needs it
(``pip install 'vllm-fastload[remote]'``). ``is_remote`` tells a URI from a local path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.sources.base import Source
from vllm_fastload.sources.local import LocalSource
from vllm_fastload.sources.uri import SCHEMES, ObjectURI, is_remote

if TYPE_CHECKING:
    from vllm_fastload.sources.object_store import ObjectInfo, ObjectSource, Store
    from vllm_fastload.sources.remote_checkpoint import RemoteLayout

__all__ = [
    "SCHEMES",
    "LocalSource",
    "ObjectInfo",
    "ObjectSource",
    "ObjectURI",
    "RemoteConfig",
    "RemoteLayout",
    "Source",
    "Store",
    "discover",
    "is_remote",
    "list_objects",
    "open_store",
    "read_safetensors_header",
    "read_safetensors_headers",
]

#: The names that need obstore, by the module that has them.
_LAZY = {"ObjectInfo": "object_store", "ObjectSource": "object_store", "Store": "object_store",
         "list_objects": "object_store", "open_store": "object_store", "RemoteLayout": "remote_checkpoint",
         "discover": "remote_checkpoint", "read_safetensors_header": "remote_checkpoint",
         "read_safetensors_headers": "remote_checkpoint"}


def __getattr__(name: str) -> Any:
    """Names from the object store modules on first use, so that obstore loads only for a URI."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"vllm_fastload.sources.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
