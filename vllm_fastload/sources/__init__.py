"""Where checkpoint bytes come from: a ``Source`` (``sources.base``) is a local file
(``LocalSource``: a descriptor the host reader ``preadv``s) or an object (``ObjectSource``:
ranged GETs through obstore, in ``sources.object_store``).

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
    from vllm_fastload.sources.object_store import (
        ObjectInfo,
        ObjectSource,
        RemoteLayout,
        Store,
    )

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

_LAZY = {"ObjectInfo", "ObjectSource", "RemoteLayout", "Store", "discover",
         "list_objects", "open_store", "read_safetensors_header", "read_safetensors_headers"}


def __getattr__(name: str) -> Any:
    """Names from ``object_store`` on first use, so that obstore loads only for a URI."""
    if name in _LAZY:
        from vllm_fastload.sources import object_store

        return getattr(object_store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
