"""Object store URIs: which store, which bucket or container, which key.

Parsed here, without obstore, so that ``vllm_fastload.open(path)`` can tell a local path from
an object URI at no import cost. A URI never carries a secret: query strings (presigned
URLs, SAS tokens) and passwords in the authority are refused, because every error message
names the URI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from vllm_fastload.errors import MissingFileError

#: Scheme as written -> the store family obstore opens for it.
SCHEMES: dict[str, str] = {
    "s3": "s3", "s3a": "s3",
    "gs": "gs",
    "az": "az", "azure": "az", "abfs": "az", "abfss": "az",
    "http": "http", "https": "http",
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_remote(path: object) -> bool:
    """Whether ``path`` is a URI fastload reads through an object store (not a local path)."""
    if not isinstance(path, str):
        return False
    match = _SCHEME.match(path)
    return match is not None and match.group(1).lower() in SCHEMES


@dataclass(frozen=True)
class ObjectURI:
    """One location in an object store: ``store_url`` (what a client is opened on) + ``key``.

    ``store_url`` is the bucket or container root (``s3://bucket``, ``http://host:port``), so one
    client serves every object of a checkpoint; ``key`` has no leading or trailing slash.
    """

    family: str
    store_url: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> ObjectURI:
        """Split ``uri``; an unsupported or unsafe URI is a ``MissingFileError`` naming it."""
        match = _SCHEME.match(uri) if isinstance(uri, str) else None
        scheme = match.group(1).lower() if match else ""
        if scheme not in SCHEMES:
            raise MissingFileError(f"unsupported URI scheme {scheme or 'none'!r} (fastload reads local paths "
                                   f"and {', '.join(s + '://' for s in SCHEMES)})", file=_safe(uri))
        parts = urlsplit(uri)
        if parts.query or parts.fragment:
            raise MissingFileError("query strings and fragments are not supported in object URIs (a presigned "
                                   "URL or SAS token would put a secret into every message); configure "
                                   "credentials through the environment instead", file=_safe(uri))
        if parts.password is not None:
            raise MissingFileError("credentials in the URI are not supported; use the environment",
                                   file=_safe(uri))
        netloc = parts.netloc
        if not netloc:
            raise MissingFileError("URI names no bucket, container or host", file=uri)
        key = parts.path.strip("/")
        if re.search(r"(^|/)\.{1,2}(/|$)", key) or "//" in key:
            raise MissingFileError("object keys with empty, '.' or '..' segments are not supported", file=uri)
        return cls(SCHEMES[scheme], f"{scheme}://{netloc}", key)

    @property
    def uri(self) -> str:
        """The URI as fastload names it in messages (no trailing slash)."""
        return f"{self.store_url}/{self.key}" if self.key else self.store_url

    def child(self, name: str) -> ObjectURI:
        """The object ``name`` below this prefix."""
        key = f"{self.key}/{name}" if self.key else name
        return ObjectURI(self.family, self.store_url, key)

    def __str__(self) -> str:
        return self.uri


def _safe(uri: object) -> str:
    """A URI for an error message: the query string, fragment and password dropped."""
    text = str(uri)
    try:
        parts = urlsplit(text)
    except ValueError:
        return "<unparseable URI>"
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    if parts.scheme:
        return f"{parts.scheme}://{netloc}{parts.path}"
    return parts.path
