"""What obstore raises for each kind of store failure, against a real S3 server (moto behind the
fault proxy), and what fastload makes of it.

``sources.store_errors`` tells failures apart by obstore's exception types, and a ``GenericError``
by the status or transport failure its message states (obstore puts no fields on its
exceptions). Each test here provokes one kind through the client fastload builds and holds both
what obstore raised (type, status, store code, transport kind) and the ``CheckpointError`` it
becomes: an obstore release that changes any of them fails the test of that kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import obstore
import pytest
from obstore import exceptions as obstore_errors

from vllm_fastload.errors import (
    AccessDeniedError,
    CheckpointError,
    FileChangedError,
    MissingFileError,
    ReadError,
    StoreUnavailableError,
)
from vllm_fastload.sources.object_store import open_store
from vllm_fastload.sources.store_errors import ClientFacts, client_facts, map_error

from .s3server import free_port

pytestmark = pytest.mark.timeout(60)

SHARD = "model-00001-of-00002.safetensors"
#: One retry, short timeouts: every kind resolves in a few seconds.
QUICK = {"timeout_s": 1.0, "connect_timeout_s": 1.0, "max_retries": 1, "retry_timeout_s": 4.0}


def raw_failure(s3, request: Callable[[Any, str], object], uri: str | None = None) -> BaseException:
    """What obstore raises for ``request(client, key)`` on the client fastload builds for ``uri``."""
    store, root = open_store(uri or s3.uri(SHARD), QUICK)
    with pytest.raises(Exception) as info:
        request(store._client, root.key)  # the client itself: what fastload maps comes from here
    return info.value


def mapped(exc: BaseException, uri: str = "s3://b/k") -> CheckpointError:
    return map_error(exc, uri, "GET")


def get(client: Any, key: str, **options: Any) -> object:
    return obstore.get(client, key, options=options or None).bytes()


def test_a_missing_object(s3) -> None:
    exc = raw_failure(s3, get, s3.uri("absent.safetensors"))
    assert isinstance(exc, FileNotFoundError)
    assert client_facts(exc).status == 404 and client_facts(exc).code == "NoSuchKey"
    assert isinstance(mapped(exc), MissingFileError) and "object does not exist" in str(mapped(exc))


def test_a_missing_bucket(s3) -> None:
    exc = raw_failure(s3, get, f"s3://no-such-bucket-{os.getpid()}/x.safetensors")
    assert isinstance(exc, FileNotFoundError) and client_facts(exc).code == "NoSuchBucket"
    assert isinstance(mapped(exc), MissingFileError) and "bucket or container does not exist" in str(mapped(exc))


def test_a_listing_of_a_missing_bucket(s3) -> None:
    """A LIST is a ``GenericError`` whatever the status: only the status its message states says 404."""
    exc = raw_failure(s3, lambda client, key: obstore.list_with_delimiter(client, "model/"),
                      f"s3://no-such-bucket-{os.getpid()}/model")
    assert type(exc) is obstore_errors.GenericError
    assert (client_facts(exc).status, client_facts(exc).code) == (404, "NoSuchBucket")
    assert isinstance(mapped(exc), MissingFileError) and "bucket or container does not exist" in str(mapped(exc))


@pytest.mark.parametrize("status, kind", [(403, obstore_errors.PermissionDeniedError),
                                          (401, obstore_errors.UnauthenticatedError)])
def test_denied_credentials(s3, status: int, kind: type[Exception]) -> None:
    s3.proxy.inject("status", status=status, code="AccessDenied", applies=lambda m, p, h: True)
    exc = raw_failure(s3, get)
    assert type(exc) is kind and client_facts(exc) == ClientFacts(client_facts(exc).line, status, "AccessDenied")
    assert isinstance(mapped(exc), AccessDeniedError)


def test_an_object_replaced_since_it_was_opened(s3) -> None:
    exc = raw_failure(s3, lambda client, key: get(client, key, if_match='"not-its-etag"'))
    assert isinstance(exc, obstore_errors.PreconditionError) and client_facts(exc).status == 412
    assert isinstance(mapped(exc), FileChangedError)


def test_a_range_beyond_the_end(s3) -> None:
    exc = raw_failure(s3, lambda client, key: get(client, key, range=(1 << 40, (1 << 40) + 10)))
    assert type(exc) is obstore_errors.GenericError and client_facts(exc).status == 416
    assert type(mapped(exc)) is ReadError and "beyond the end of the object" in str(mapped(exc))


@pytest.mark.parametrize("status, code", [(503, "SlowDown"), (429, "TooManyRequests")])
def test_a_store_that_keeps_failing(s3, status: int, code: str) -> None:
    s3.proxy.inject("status", status=status, code=code)
    exc = raw_failure(s3, get)
    assert type(exc) is obstore_errors.GenericError
    assert (client_facts(exc).status, client_facts(exc).code, client_facts(exc).transport) == (status, code, None)
    assert isinstance(mapped(exc), StoreUnavailableError) and f"HTTP {status}" in str(mapped(exc))


def test_no_answer_in_time(s3) -> None:
    s3.proxy.inject("stall")
    exc = raw_failure(s3, get)
    assert type(exc) is obstore_errors.GenericError
    assert (client_facts(exc).status, client_facts(exc).transport) == (None, "Timeout")
    assert isinstance(mapped(exc), StoreUnavailableError) and "no complete answer in time" in str(mapped(exc))


def test_no_connection(s3, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens there
    exc = raw_failure(s3, get)
    assert type(exc) is obstore_errors.GenericError
    assert (client_facts(exc).status, client_facts(exc).transport) == (None, "Connect")
    assert isinstance(mapped(exc), StoreUnavailableError) and "cannot connect" in str(mapped(exc))


def test_a_connection_that_breaks_in_the_body(s3) -> None:
    s3.proxy.inject("truncate")  # every answer promises the whole body, sends half and hangs up
    exc = raw_failure(s3, get)
    assert type(exc) is obstore_errors.GenericError
    assert (client_facts(exc).status, client_facts(exc).transport) == (None, "Interrupted")
    assert isinstance(mapped(exc), StoreUnavailableError) and "while sending the request or receiving the body" \
        in str(mapped(exc))
