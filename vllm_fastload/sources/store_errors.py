"""What a failed object-store request was, told from the store client's own exception.

obstore raises one exception type per kind of failure it knows: ``FileNotFoundError`` (404),
``PermissionDeniedError`` (403), ``UnauthenticatedError`` (401), ``PreconditionError`` (412, a
failed ``If-Match``), ``NotSupportedError``; everything else is a ``GenericError``: statuses it
has no type for (416, 429 and 5xx once its retries are spent) and transport failures. Its
exceptions carry no fields (obstore 0.12, as its current source): what a ``GenericError`` was is
stated only in its message, the HTTP status in the message's first part (``status code: 503``)
and the transport failure's kind (``Timeout``, ``Connect``, ...) only in the ``Debug source`` dump
appended to it. ``client_facts`` reads those, in this one place; ``tests/remote/test_store_errors``
provokes each kind against a real S3-compatible server and holds what obstore raises for it, so
that a client release that changes any of it fails a test naming the kind.

Every message keeps the store's own words in one line, scrubbed of every credential value
fastload knows of and of URL query strings.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from obstore import exceptions as obstore_errors

from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.errors import (
    AccessDeniedError,
    CheckpointError,
    FileChangedError,
    MissingFileError,
    ReadError,
    StoreUnavailableError,
)

#: Environment variables whose values are credentials (scrubbed from every message).
_SECRET_ENV = re.compile(r"^(AWS|AZURE|GOOGLE|GCS|GCP|OBJECT_STORE)_\w*(SECRET|TOKEN|PASSWORD|KEY|SAS|CREDENTIAL)\w*$")
#: Shorter values are not scrubbed (they would blank out ordinary words).
_MIN_SECRET = 6
#: Where obstore's message ends and its ``Debug`` dump of the Rust error begins.
_DEBUG_DUMP = "\n\nDebug source:"
#: Missing-container codes of the stores (a 404 for the bucket, not the object).
_NO_CONTAINER = ("NoSuchBucket", "ContainerNotFound")


def known_secrets(config: RemoteConfig | None = None) -> list[str]:
    """Credential values fastload knows of: the environment's and the config's."""
    values = [v for k, v in os.environ.items() if _SECRET_ENV.match(k)]
    if config is not None:
        values += config.secrets()
    return sorted({v for v in values if len(v) >= _MIN_SECRET}, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret value replaced by ``***`` and URL query strings dropped."""
    text = re.sub(r"(https?://[^\s?#\"'<>]+)[?#][^\s\"'<>]*", r"\1", text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


@dataclass(frozen=True)
class ClientFacts:
    """What the client's exception says of a failure, beyond its type."""

    #: Its message in one line (the store's XML body and the client's dump left out).
    line: str
    #: The HTTP status the store answered with (None: no answer, or not stated).
    status: int | None = None
    #: The store's error code from its answer (``NoSuchBucket``, ``SlowDown``...).
    code: str | None = None
    #: Why a request got no answer (``Timeout``, ``Connect``, ...; None where it got one).
    transport: str | None = None


def client_facts(exc: BaseException) -> ClientFacts:
    """The status, the store's code and the transport failure's kind from the client's message
    (see the module docstring: obstore states them nowhere else)."""
    full = str(exc)
    message = full.split(_DEBUG_DUMP, 1)[0]
    code = re.search(r"<Code>([^<]{1,64})</Code>", message)
    status = re.search(r"status code: (\d{3})", message)
    dump = full[len(message):]
    kind = re.search(r"HttpError \{\s*kind: (\w+)", dump)
    transport = kind.group(1) if kind else ("Timeout" if re.search(r"\bTimedOut\b|timed out", full) else None)
    line = " ".join(re.sub(r"<\?xml.*", "", message, flags=re.S).split())[:300].rstrip(" :-")
    return ClientFacts(line, int(status.group(1)) if status else None, code.group(1) if code else None, transport)


def classify(exc: BaseException, facts: ClientFacts) -> tuple[type[CheckpointError], str]:
    """Which error a failure is, and what it means in a few words: by the client's exception type,
    and for its ``GenericError`` by the status or the transport failure (a LIST that finds no
    bucket, for one, is a ``GenericError`` with status 404)."""
    generic = isinstance(exc, obstore_errors.GenericError)
    if isinstance(exc, (FileNotFoundError, obstore_errors.NotFoundError)) or (generic and facts.status == 404):
        if facts.code in _NO_CONTAINER:
            return MissingFileError, "bucket or container does not exist"
        return MissingFileError, "object does not exist"
    if isinstance(exc, (obstore_errors.PermissionDeniedError, obstore_errors.UnauthenticatedError)) \
            or (generic and facts.status in (401, 403)):
        return AccessDeniedError, "access denied: the store rejected the credentials or their permissions"
    if isinstance(exc, obstore_errors.PreconditionError) or (generic and facts.status == 412):
        return FileChangedError, ("the object was replaced since it was opened (its ETag no longer matches); "
                                  "refusing to mix bytes")
    if isinstance(exc, TimeoutError):
        return StoreUnavailableError, "no complete answer in time"
    if not generic:
        return ReadError, "request failed"
    return _classify_generic(facts)


def _classify_generic(facts: ClientFacts) -> tuple[type[CheckpointError], str]:
    status = facts.status
    if status == 416:
        return ReadError, "the range starts beyond the end of the object"
    if status is not None and (status >= 500 or status == 429):
        return StoreUnavailableError, f"the store kept failing (HTTP {status}) past the retry limit"
    if facts.transport == "Timeout":
        return StoreUnavailableError, "no complete answer in time"
    if facts.transport == "Connect":
        return StoreUnavailableError, "cannot connect to the store's endpoint"
    if facts.transport is not None:
        return StoreUnavailableError, "the connection failed while sending the request or receiving the body"
    return ReadError, "request failed"


def map_error(exc: BaseException, uri: str, action: str, *, tensor: str | None = None,
              config: RemoteConfig | None = None) -> CheckpointError:
    """The ``CheckpointError`` for a store client's exception: typed, naming ``uri`` and ``tensor``.

    ``action`` says what was being done ("GET bytes 0-1048575"); the store's own words follow
    in one scrubbed line, so the message says both what failed and why.
    """
    if isinstance(exc, CheckpointError):
        return exc
    facts = client_facts(exc)
    cls, what = classify(exc, facts)
    if cls is StoreUnavailableError and config is not None:
        what += (f" (timeout_s={config.timeout_s:g}, max_retries={config.max_retries}, "
                 f"retry_timeout_s={config.retry_timeout_s:g})")
    line = scrub(facts.line, known_secrets(config))
    why = f"{line} [{facts.code}]" if facts.code and facts.code not in line else line
    return cls(f"{action}: {what}; store said: {why}", file=uri, tensor=tensor)
