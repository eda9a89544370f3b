"""Objects in S3, GCS, Azure or on an HTTP server, read by ranged GETs through ``obstore``.

obstore is the Python binding of Rust's ``object_store``: it signs requests, reads
credentials from the standard environment, retries 5xx/throttling/timeouts with backoff and
runs requests concurrently without the GIL. This module adds what a checkpoint loader
needs on top:

- every object is pinned at open: its size and ETag are recorded, every ranged GET carries
  ``If-Match`` and every response's size and ETag are compared, so an object replaced
  during the load stops it instead of mixing old and new bytes;
- every failure is a :class:`CheckpointError` subclass naming the URI (and the tensor when
  the caller passes it), in bounded time: per-request timeout, bounded retries, and a
  deadline around each request in case the client itself never returns;
- no secret reaches a message: error text from the store is cut to its first line, stripped
  of query strings and scrubbed of every credential value fastload knows of.

What a failure was is ``store_errors``' to tell; which objects make a checkpoint, and their
headers, ``remote_checkpoint``'s. Requests run on one asyncio loop per process (a daemon thread);
callers get ``concurrent.futures.Future`` objects, like the readers' thread pools give them.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Coroutine, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

try:
    import obstore
    from obstore import exceptions as obstore_errors

    if TYPE_CHECKING:
        from obstore import GetOptions
    from obstore.store import from_url as _obstore_from_url
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("reading s3://, gs://, az:// or http(s):// checkpoints needs obstore: "
                      "pip install 'vllm-fastload[remote]'") from _exc

from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.errors import (
    AccessDeniedError,
    CheckpointError,
    FileChangedError,
    HeaderError,
    ReadError,
    StoreUnavailableError,
)
from vllm_fastload.sizes import ceil_div
from vllm_fastload.sources.base import RangeInto
from vllm_fastload.sources.store_errors import client_facts, known_secrets, map_error, scrub
from vllm_fastload.sources.uri import ObjectURI

T = TypeVar("T")

# --------------------------------------------------------------------------- event loop


class _Loop:
    """The process's asyncio loop for object store requests, on a daemon thread.

    Made on first use and again in a forked child (a loop thread does not survive fork).
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="fastload-objects", daemon=True)
                thread.start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop


def _spawn(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Run ``coro`` on the request loop; a ``concurrent.futures.Future`` for its result."""
    return asyncio.run_coroutine_threadsafe(coro, _Loop.get())


# --------------------------------------------------------------------------- client


@dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing or HEAD describes it."""

    uri: str
    key: str
    size: int
    etag: str | None
    last_modified: datetime | None


def _env_endpoint(family: str) -> str | None:
    names = {"s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"), "gs": ("GOOGLE_BASE_URL",),
             "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")}.get(family, ())
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _store_options(root: ObjectURI, config: RemoteConfig) -> dict[str, Any]:
    """obstore's store config for ``root``: the config's fields on top of the environment."""
    options: dict[str, Any] = {k: v.get_secret_value() for k, v in config.store_options.items()}
    if config.endpoint is not None:
        options["base_url" if root.family == "gs" else "endpoint"] = config.endpoint
    if root.family == "s3":
        if config.region is not None:
            options["region"] = config.region
        if config.virtual_hosted_style is not None:
            options["virtual_hosted_style_request"] = config.virtual_hosted_style
    if config.anonymous and root.family != "http":
        options["skip_signature"] = True
    return options


def _profile_provider(config: RemoteConfig, options: dict[str, Any]) -> Any:
    """A boto3 credential provider when an AWS profile is asked for (object_store reads no profiles)."""
    profile = config.profile
    if profile is None and not config.anonymous and "access_key_id" not in options \
            and not os.environ.get("AWS_ACCESS_KEY_ID"):
        profile = os.environ.get("AWS_PROFILE")
    if not profile:
        return None
    try:
        import boto3  # type: ignore[import-untyped]  # (no type information; an optional credential chain)
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError as exc:
        raise AccessDeniedError(f"AWS profile {profile!r} is selected but reading profiles needs boto3 "
                                f"(pip install boto3): {exc}") from None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception as exc:
        raise AccessDeniedError(f"cannot read AWS profile {profile!r}: {type(exc).__name__}") from None


#: What a store family takes from the environment that a URI cannot say, for set-up errors.
_SETUP_HINTS = {
    "s3": "credentials and endpoint come from AWS_* variables, ~/.aws (profile) or the instance role",
    "gs": "credentials come from GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT(_KEY)",
    "az": "az:// takes the account from AZURE_STORAGE_ACCOUNT_NAME, or use abfss://container@account.dfs.core.windows.net",
    "http": "http(s):// URLs are read unsigned",
}


def _make_client(root: ObjectURI, config: RemoteConfig) -> Any:
    options = _store_options(root, config)
    endpoint = config.endpoint or _env_endpoint(root.family) or (root.store_url if root.family == "http" else "")
    client = {"timeout": timedelta(seconds=config.timeout_s),
              "connect_timeout": timedelta(seconds=config.connect_timeout_s),
              # An http:// endpoint is the user's explicit choice (a local or in-cluster store).
              "allow_http": endpoint.startswith("http://")}
    retry = {"max_retries": config.max_retries, "retry_timeout": timedelta(seconds=config.retry_timeout_s),
             "backoff": {"init_backoff": timedelta(milliseconds=100),
                         "max_backoff": timedelta(seconds=min(5.0, config.retry_timeout_s)), "base": 2}}
    kwargs: dict[str, Any] = {"client_options": client, "retry_config": retry}
    if root.family != "http":
        kwargs["config"] = options
    if root.family == "s3":
        provider = _profile_provider(config, options)
        if provider is not None:
            kwargs["credential_provider"] = provider
    try:
        return _obstore_from_url(root.store_url, **kwargs)
    except Exception as exc:
        detail = scrub(client_facts(exc).line, known_secrets(config))
        raise CheckpointError(f"cannot set up the {root.family} client: {detail} ({_SETUP_HINTS[root.family]})",
                              file=root.uri) from None


class Store:
    """A client for one bucket, container or HTTP host, shared by all objects of a checkpoint.

    It holds the connection pool, the credentials and the limit on requests in flight.
    """

    def __init__(self, root: ObjectURI, config: RemoteConfig, in_flight: int) -> None:
        self.root = ObjectURI(root.family, root.store_url, "")
        self.config = config
        self.in_flight = in_flight
        self._client = _make_client(self.root, config)
        #: Whether GETs carry If-Match; a store whose client cannot send it falls back to
        #: comparing each response's ETag (the check that also catches stores ignoring it).
        self.if_match = True
        self._semaphore: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # per loop
        #: Longest a request may take, retries included; past it the request is abandoned.
        self.deadline_s = config.retry_timeout_s + config.timeout_s + config.connect_timeout_s + 5.0

    def uri_of(self, key: str) -> str:
        return f"{self.root.store_url}/{key}"

    def run(self, coro: Coroutine[Any, Any, T], *, uri: str, rounds: int = 1) -> T:
        """Run a request coroutine to completion from a caller's thread.

        Every request inside is already bounded by ``deadline_s``; this outer limit (``rounds``
        requests one after another) only guards against the loop itself not answering.
        """
        future = _spawn(coro)
        try:
            return future.result(timeout=rounds * self.deadline_s + 10.0)
        except FutureTimeout:
            future.cancel()
            raise StoreUnavailableError(f"no answer within {rounds * self.deadline_s + 10.0:g} s", file=uri) from None

    async def _bounded(self, coro: Awaitable[T], uri: str, action: str, tensor: str | None) -> T:
        """``coro`` under the in-flight limit and the deadline, its errors mapped."""
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:  # first use, or a forked child
            self._semaphore = (loop, asyncio.Semaphore(self.in_flight))
        async with self._semaphore[1]:
            try:
                return await asyncio.wait_for(coro, self.deadline_s)
            except asyncio.TimeoutError:
                raise StoreUnavailableError(
                    f"{action}: no answer within {self.deadline_s:g} s, retries included", file=uri,
                    tensor=tensor) from None
            except CheckpointError:
                raise
            except Exception as exc:
                raise map_error(exc, uri, action, tensor=tensor, config=self.config) from None

    # -- requests ----------------------------------------------------------------------

    async def get_range(self, key: str, start: int, end: int, *, pinned: ObjectInfo | None = None,
                        tensor: str | None = None) -> tuple[memoryview, ObjectInfo]:
        """Bytes ``[start, end)`` of ``key`` and the object's identity as the response states it.

        With ``pinned`` (the identity recorded at open) the request carries ``If-Match`` and the
        response must agree on size and ETag (or, without an ETag, on the modification time);
        it must hold every byte asked for.
        """
        uri = self.uri_of(key)
        action = f"GET bytes {start}-{end - 1}"
        options: GetOptions = {"range": (start, end)}
        if pinned is not None and pinned.etag is not None and self.if_match:
            options["if_match"] = pinned.etag

        async def fetch() -> tuple[memoryview, ObjectInfo]:
            try:
                result = await obstore.get_async(self._client, key, options=options)
            except obstore_errors.NotSupportedError:
                if options.pop("if_match", None) is None:
                    raise
                self.if_match = False
                result = await obstore.get_async(self._client, key, options=options)
            data = memoryview(await result.bytes_async())
            return data, _info(uri, key, result.meta)

        data, info = await self._bounded(fetch(), uri, action, tensor)
        if pinned is not None and not _same_object(pinned, info):
            raise FileChangedError(
                f"{action}: the object was replaced since it was opened (size {pinned.size} -> {info.size}, "
                f"ETag {pinned.etag} -> {info.etag}); refusing to mix bytes", file=uri, tensor=tensor)
        wanted = min(end, info.size) - start
        if len(data) != wanted:
            raise ReadError(f"{action}: the store returned {len(data)} of {wanted} bytes", file=uri, tensor=tensor)
        return data, info

    async def head(self, key: str) -> ObjectInfo:
        uri = self.uri_of(key)
        meta = await self._bounded(obstore.head_async(self._client, key), uri, "HEAD", None)
        return _info(uri, key, meta)

    async def get_all(self, key: str) -> bytes:
        """A whole (small) object, e.g. an index."""
        uri = self.uri_of(key)

        async def fetch() -> bytes:
            result = await obstore.get_async(self._client, key)
            return bytes(await result.bytes_async())

        return await self._bounded(fetch(), uri, "GET", None)

    async def list_dir(self, prefix: str) -> list[ObjectInfo]:
        """Objects directly below ``prefix`` (not in deeper "directories"), in key order."""
        uri = self.uri_of(prefix.rstrip("/")) if prefix else self.root.uri
        listing = await self._bounded(
            obstore.list_with_delimiter_async(self._client, prefix or None), uri, "LIST", None)
        return sorted((_info(self.uri_of(m["path"]), m["path"], m) for m in listing["objects"]),
                      key=lambda o: o.key)

    # -- objects -----------------------------------------------------------------------

    def open(self, key: str) -> ObjectSource:
        """Pin ``key`` (one HEAD): later reads fail if it is replaced."""
        return ObjectSource(self, self.run(self.head(key), uri=self.uri_of(key)))

    async def open_with_prefix(self, key: str, length: int) -> tuple[ObjectSource, memoryview]:
        """Pin ``key`` and read its first ``length`` bytes in one GET (the identity comes with the bytes)."""
        try:
            data, info = await self.get_range(key, 0, length)
        except ReadError as exc:
            if type(exc) is not ReadError:
                raise  # the store is unavailable: asking it again would only double the wait
            # An empty object cannot answer a range request (416); say so plainly.
            info = await self.head(key)
            if info.size == 0:
                raise HeaderError("object is empty", file=info.uri) from None
            raise exc
        return ObjectSource(self, info), data

    def close(self) -> None:
        """Nothing to release: the client's connections close when it is collected."""


def _same_object(pinned: ObjectInfo, now: ObjectInfo) -> bool:
    """Whether a response describes the object that was opened."""
    if now.size != pinned.size:
        return False
    if pinned.etag is not None:
        return now.etag == pinned.etag
    return pinned.last_modified is None or now.last_modified in (None, pinned.last_modified)


def _info(uri: str, key: str, meta: Any) -> ObjectInfo:
    return ObjectInfo(uri, key, int(meta["size"]), meta.get("e_tag"), meta.get("last_modified"))


def open_store(uri: str | ObjectURI, config: RemoteConfig | dict[str, Any] | None = None, *,
               memory_budget: int | None = None) -> tuple[Store, ObjectURI]:
    """A client for the bucket/container/host of ``uri``, and ``uri`` parsed.

    ``memory_budget`` (the loader's) caps requests in flight, see ``RemoteConfig.in_flight_limit``.
    """
    parsed = uri if isinstance(uri, ObjectURI) else ObjectURI.parse(uri)
    config = RemoteConfig.build(config)
    in_flight = config.max_in_flight if memory_budget is None else config.in_flight_limit(memory_budget)
    return Store(parsed, config, in_flight), parsed


def list_objects(uri: str, config: RemoteConfig | dict[str, Any] | None = None) -> list[ObjectInfo]:
    """Objects directly below the prefix ``uri`` (one LIST; not recursive)."""
    store, parsed = open_store(uri, config)
    return store.run(store.list_dir(parsed.key + "/" if parsed.key else ""), uri=parsed.uri)


# --------------------------------------------------------------------------- one object


class ObjectSource:
    """One object, pinned to the size and ETag it had when opened.

    Reads are ranged GETs of at most ``request_size`` bytes, at most ``in_flight`` at once per
    store; each carries ``If-Match`` and its response is checked against the pinned identity.
    """

    def __init__(self, store: Store, info: ObjectInfo) -> None:
        self.store = store
        self.info = info

    @property
    def uri(self) -> str:
        return self.info.uri

    @property
    def key(self) -> str:
        return self.info.key

    @property
    def size(self) -> int:
        return self.info.size

    @property
    def etag(self) -> str | None:
        return self.info.etag

    @property
    def fd(self) -> None:
        """No descriptor: readers fill buffers through ``submit_ranges_into``."""
        return None

    def __repr__(self) -> str:
        return f"ObjectSource({self.uri!r}, size={self.size}, etag={self.etag!r})"

    def read(self, offset: int, length: int, *, tensor: str | None = None) -> memoryview:
        """``length`` bytes from ``offset`` in one GET (no copy: the view keeps the response alive)."""
        self._check_bounds(offset, length, tensor)
        if length == 0:
            return memoryview(b"")
        return self.store.run(self._get(offset, offset + length, tensor), uri=self.uri)[0]

    def read_into(self, offset: int, view: memoryview, *, tensor: str | None = None) -> None:
        """Fill ``view`` with the bytes from ``offset`` (in ``request_size`` GETs) and wait."""
        view = _writable(view)
        self._check_bounds(offset, len(view), tensor)
        requests = ceil_div(len(view), int(self.store.config.request_size)) or 1
        rounds = ceil_div(requests, self.store.in_flight)
        self.store.run(self._fill(coalesce([RangeInto(offset, view)], 0, int(self.store.config.request_size)), tensor),
                       uri=self.uri, rounds=rounds)

    def submit_ranges_into(self, ranges: Sequence[RangeInto], *,
                           tensor: str | None = None) -> Future[None]:
        """Start filling each range; ranges closer than ``coalesce_gap`` share a GET.

        The future completes once every request has finished (also after one failed, so that
        no request still writes into a buffer its caller gave up), then raises the first error.
        """
        views = [RangeInto(offset, _writable(view)) for offset, view in ranges]
        for offset, view in views:
            self._check_bounds(offset, len(view), tensor)
        cfg = self.store.config
        requests = coalesce(views, int(cfg.coalesce_gap), int(cfg.request_size))
        return _spawn(self._fill(requests, tensor))

    def check_unchanged(self, *, refresh: bool = False) -> None:
        """Raise FileChangedError if the object is no longer the one opened.

        Every response is already checked (``If-Match``, size, ETag), so the bytes read so far
        are known to be the opened object's; ``refresh=True`` also asks the store now (a HEAD).
        """
        if not refresh:
            return
        now = self.store.run(self.store.head(self.key), uri=self.uri)
        if not _same_object(self.info, now):
            raise FileChangedError(
                f"the object was replaced since it was opened (size {self.size} -> {now.size}, "
                f"ETag {self.etag} -> {now.etag})", file=self.uri)

    def close(self) -> None:
        """Nothing to release per object (the store owns the connections)."""

    # -- internals ---------------------------------------------------------------------

    def _check_bounds(self, offset: int, length: int, tensor: str | None) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ReadError(f"range [{offset}, {offset + length}) reaches past the end of the "
                            f"{self.size}-byte object", file=self.uri, tensor=tensor)

    async def _get(self, start: int, end: int, tensor: str | None) -> tuple[memoryview, ObjectInfo]:
        return await self.store.get_range(self.key, start, end, pinned=self.info, tensor=tensor)

    async def _fill(self, requests: list[Request], tensor: str | None) -> None:
        results = await asyncio.gather(*(self._fill_one(r, tensor) for r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _fill_one(self, request: Request, tensor: str | None) -> None:
        data, _ = await self._get(request.start, request.end, tensor)
        source = np.frombuffer(data, dtype=np.uint8)
        for offset, view in request.parts:
            at = offset - request.start
            np.copyto(np.frombuffer(view, dtype=np.uint8), source[at:at + len(view)])


def _writable(view: memoryview | bytearray) -> memoryview:
    view = memoryview(view)
    if view.readonly:
        raise ValueError("read_into needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass(frozen=True)
class Request:
    """One ranged GET ``[start, end)`` and where its pieces go."""

    start: int
    end: int
    parts: tuple[RangeInto, ...]


def coalesce(ranges: Sequence[RangeInto], gap: int, request_size: int) -> list[Request]:
    """GETs for ``ranges``: each range split at ``request_size``, then neighbours closer than ``gap``
    merged while the GET stays within ``request_size`` (a byte in a gap costs less than a request)."""
    pieces: list[RangeInto] = []
    for offset, view in ranges:
        for done in range(0, len(view), request_size):
            pieces.append(RangeInto(offset + done, view[done:done + request_size]))
    pieces.sort(key=lambda p: p[0])
    spans: list[tuple[int, int, list[RangeInto]]] = []  # (start, end, parts) as they grow
    for offset, view in pieces:
        end = offset + len(view)
        if spans and offset - spans[-1][1] <= gap and offset >= spans[-1][0] \
                and max(end, spans[-1][1]) - spans[-1][0] <= request_size:
            start, last_end, parts = spans[-1]
            parts.append(RangeInto(offset, view))
            spans[-1] = (start, max(last_end, end), parts)
        else:
            spans.append((offset, end, [RangeInto(offset, view)]))
    return [Request(start, end, tuple(parts)) for start, end, parts in spans]
