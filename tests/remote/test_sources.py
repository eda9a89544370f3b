"""Object sources against a real S3 server (moto on loopback) behind a counting, faulty proxy.

The oracle for bytes is the local checkpoint the objects were uploaded from; the proxy
counts requests and bytes on the server side. Every fault must end in a ``CheckpointError``
naming the URI (and the tensor the caller named) within a bounded time, with no secret in
anything a log would print.
"""

from __future__ import annotations

import base64
import os
import time
import traceback
from pathlib import Path

import pytest
from obstore import exceptions as obstore_errors

from vllm_fastload.checkpoint import read_safetensors_file
from vllm_fastload.errors import (
    AccessDeniedError,
    CheckpointError,
    FileChangedError,
    HeaderError,
    MissingFileError,
    ReadError,
    StoreUnavailableError,
    TruncatedFileError,
)
from vllm_fastload.sources import ObjectURI, RemoteConfig, is_remote
from vllm_fastload.sources.object_store import coalesce, list_objects, open_store
from vllm_fastload.sources.remote_checkpoint import discover, read_safetensors_header, read_safetensors_headers
from vllm_fastload.sources.store_errors import map_error, scrub

from .s3server import SECRET, free_port

pytestmark = pytest.mark.timeout(60)

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
#: Small limits so that every fault resolves in a few seconds.
FAST = {"timeout_s": 1.0, "connect_timeout_s": 1.0, "max_retries": 2, "retry_timeout_s": 5.0,
        "request_size": 65536}
#: Longest any fault may take with FAST: (retries + 1) attempts of timeout_s, backoff, margin.
BOUND_S = 15.0


def check_error(exc: BaseException, cls: type[CheckpointError], uri: str, tensor: str | None = None) -> None:
    """Typed, names the URI (and tensor), and no secret in anything a log would print."""
    assert isinstance(exc, cls), f"{type(exc).__name__}: {exc}"
    assert exc.file == uri and uri in str(exc)
    if tensor is not None:
        assert exc.tensor == tensor and tensor in str(exc)
    printed = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + repr(exc)
    assert SECRET not in printed


def fail(fn, cls: type[CheckpointError], uri: str, tensor: str | None = None) -> CheckpointError:
    """Run ``fn``; it must raise ``cls`` naming ``uri`` within ``BOUND_S``."""
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        fn()
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    check_error(info.value, cls, uri, tensor)
    return info.value


def local_bytes(checkpoint: Path, name: str) -> bytes:
    return (checkpoint / name).read_bytes()


# --------------------------------------------------------------------------- URIs and config


def test_uri_parsing() -> None:
    assert ObjectURI.parse("s3://bkt/a/b/") == ObjectURI("s3", "s3://bkt", "a/b")
    assert ObjectURI.parse("s3a://bkt") == ObjectURI("s3", "s3a://bkt", "")
    assert ObjectURI.parse("gs://bkt/m.safetensors").key == "m.safetensors"
    assert ObjectURI.parse("az://ctr/p").family == "az"
    assert ObjectURI.parse("abfss://ctr@acct.dfs.core.windows.net/p").store_url == \
        "abfss://ctr@acct.dfs.core.windows.net"
    assert ObjectURI.parse("http://127.0.0.1:9/x/y") == ObjectURI("http", "http://127.0.0.1:9", "x/y")
    assert ObjectURI.parse("s3://bkt/a").child("b.json").uri == "s3://bkt/a/b.json"
    assert is_remote("s3://x") and is_remote("HTTPS://h/p") and not is_remote("/models/x")
    assert not is_remote("C:/models") and not is_remote(Path("s3://x"))


@pytest.mark.parametrize("uri, words", [
    ("ftp://host/x", "unsupported URI scheme"),
    ("s3://bkt/m.safetensors?X-Amz-Signature=" + SECRET, "query strings"),
    ("https://user:" + SECRET + "@host/m", "credentials in the URI"),
    ("s3:///key", "no bucket"),
    ("s3://bkt/a/../b", "'..'"),
])
def test_bad_uris(uri: str, words: str) -> None:
    with pytest.raises(MissingFileError) as info:
        ObjectURI.parse(uri)
    assert words in str(info.value)
    assert SECRET not in str(info.value)


def test_config_validates_and_hides_secrets() -> None:
    cfg = RemoteConfig.build({"store_options": {"secret_access_key": SECRET}, "request_size": "16MiB"})
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.model_dump())
    assert cfg.request_size == 16 << 20
    assert cfg.in_flight_limit(1 << 30) == 16  # a quarter of 1 GiB in 16 MiB requests
    assert RemoteConfig().in_flight_limit(1 << 20) == 1
    with pytest.raises(ValueError, match="max_in_flight") as info:
        RemoteConfig.build({"max_in_flight": 0, "store_options": {"x": SECRET}})
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError, match="endpoint"):
        RemoteConfig.build({"endpoint": "127.0.0.1:9000"})
    with pytest.raises(ValueError, match="unknown_field"):
        RemoteConfig.build({"unknown_field": 1})


def test_clients_for_every_family(monkeypatch) -> None:
    """Setting a client up sends nothing; a store that lacks a setting says which, without secrets."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(key)
    azure_key = base64.b64encode(SECRET.encode()).decode()  # Azure keys are base64
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", azure_key)
    for uri in ("gs://bkt/p", "abfss://ctr@acct.dfs.core.windows.net/p", "http://127.0.0.1:9/x", "s3://bkt/p"):
        store, parsed = open_store(uri)
        assert store.root.store_url == parsed.store_url
    with pytest.raises(CheckpointError) as info:
        open_store("az://ctr/p")
    check_error(info.value, CheckpointError, "az://ctr")
    assert "AZURE_STORAGE_ACCOUNT_NAME" in str(info.value) and azure_key not in str(info.value)


def test_store_errors_are_typed_and_scrubbed(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", SECRET)
    exc = map_error(obstore_errors.PermissionDeniedError(
        f"Error performing GET http://h/b/k?X-Amz-Security-Token={SECRET} - Server returned non-2xx status code: "
        f"403 Forbidden: <Error><Code>ExpiredToken</Code><Token>{SECRET}</Token></Error>\n\nDebug source: {SECRET}"),
        "s3://b/k", "GET bytes 0-9", tensor="w")
    check_error(exc, AccessDeniedError, "s3://b/k", "w")
    assert "ExpiredToken" in str(exc)
    assert isinstance(map_error(FileNotFoundError("gone"), "s3://b/k", "HEAD"), MissingFileError)
    timeout = obstore_errors.GenericError("Generic S3 error: error sending request\n\nDebug source:\n HttpError {\n"
                                          " kind: Timeout,")
    assert isinstance(map_error(timeout, "s3://b/k", "GET"), StoreUnavailableError)


def test_scrub() -> None:
    text = f"GET http://h/b/k?sig={SECRET}&x=1 failed: token {SECRET}"
    out = scrub(text, [SECRET])
    assert SECRET not in out and "http://h/b/k" in out


def test_coalesce_splits_and_merges() -> None:
    bufs = [memoryview(bytearray(n)) for n in (10, 10, 300)]
    reqs = coalesce([(0, bufs[0]), (15, bufs[1]), (1000, bufs[2])], gap=8, request_size=128)
    assert [(r.start, r.end) for r in reqs] == [(0, 25), (1000, 1128), (1128, 1256), (1256, 1300)]
    assert [len(r.parts) for r in reqs] == [2, 1, 1, 1]


# --------------------------------------------------------------------------- reading


def test_ranged_reads_equal_local_bytes(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), FAST)
    want = local_bytes(local_checkpoint, SHARD1)
    src = store.open(root.child(SHARD1).key)
    assert (src.size, src.uri) == (len(want), s3.uri(SHARD1)) and src.etag
    assert bytes(src.read(0, 100)) == want[:100]
    assert bytes(src.read(len(want) - 7, 7)) == want[-7:]
    s3.proxy.clear()
    whole = bytearray(len(want))
    src.read_into(0, memoryview(whole))
    assert whole == want
    # request_size splits the read; the server sent each byte once, in ranges of at most 64 KiB.
    gets = s3.proxy.gets(SHARD1)
    assert len(gets) == -(-len(want) // FAST["request_size"])
    assert s3.proxy.bytes_served() == len(want)
    assert all(r.range.startswith("bytes=") for r in gets)


def test_ranges_coalesce_into_one_request(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), {**FAST, "coalesce_gap": 4096})
    want = local_bytes(local_checkpoint, SHARD2)
    src = store.open(root.child(SHARD2).key)
    spans = [(5000, 100), (5200, 300), (8000, 50), (60000, 10)]  # first three within 4 KiB of each other
    bufs = [bytearray(n) for _, n in spans]
    s3.proxy.clear()
    src.submit_ranges_into([(o, memoryview(b)) for (o, _), b in zip(spans, bufs)], tensor="t").result(30)
    for (offset, n), buf in zip(spans, bufs):
        assert buf == want[offset:offset + n]
    assert [r.range for r in s3.proxy.gets(SHARD2)] in (
        ["bytes=5000-8049", "bytes=60000-60009"], ["bytes=60000-60009", "bytes=5000-8049"])


def test_in_flight_limit_is_respected(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), {**FAST, "request_size": 4096, "max_in_flight": 3})
    src = store.open(root.child(SHARD1).key)
    buf = bytearray(src.size)
    src.read_into(0, memoryview(buf))
    assert buf == local_bytes(local_checkpoint, SHARD1)
    assert 1 <= s3.proxy.max_active <= 3


def test_header_in_one_request(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), FAST)
    s3.proxy.clear()
    remote = read_safetensors_header(store, root.child(SHARD1).key)
    assert len(s3.proxy.records) == 1 and s3.proxy.records[0].range == "bytes=0-1048575"
    local = read_safetensors_file(local_checkpoint / SHARD1)
    try:
        assert remote.header.data_offset == local.header.data_offset and remote.header.metadata == local.header.metadata
        assert {n: (t.dtype, t.shape, t.start, t.end) for n, t in remote.header.tensors.items()} == \
            {n: (t.dtype, t.shape, t.start, t.end) for n, t in local.header.tensors.items()}
        assert {t.file for t in remote.header.tensors.values()} == {s3.uri(SHARD1)}
    finally:
        local.close()


def test_large_header_takes_a_second_request(s3) -> None:
    store, root = open_store(s3.uri(), {**FAST, "header_prefetch": 64})
    s3.proxy.clear()
    remote = read_safetensors_header(store, root.child(SHARD1).key)
    ranges = [r.range for r in s3.proxy.records]
    assert ranges == ["bytes=0-63", f"bytes=64-{remote.header.data_offset - 1}"]


def test_headers_of_many_objects(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    layout = discover(store, root)
    headers = read_safetensors_headers(store, layout.keys)
    names = {n for h in headers for n in h.header.tensors}
    assert names == set(layout.weight_map)


def test_discovery_rules(s3, s3_client, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), FAST)
    layout = discover(store, root)
    assert layout.index_key == f"{s3.prefix}/model.safetensors.index.json"
    assert layout.keys == (f"{s3.prefix}/{SHARD1}", f"{s3.prefix}/{SHARD2}")
    single = ObjectURI.parse(s3.uri(SHARD2))
    assert discover(store, single).keys == (single.key,)
    # Without an index: every *.safetensors directly below the prefix, in name order.
    for name in (SHARD2, SHARD1, "nested/deeper.safetensors"):
        s3_client.put_object(Bucket=s3.bucket, Key=f"noindex/{name}", Body=local_bytes(local_checkpoint, SHARD1))
    plain = discover(store, ObjectURI.parse(f"s3://{s3.bucket}/noindex"))
    assert plain.keys == (f"noindex/{SHARD1}", f"noindex/{SHARD2}") and plain.weight_map is None
    assert [o.key for o in list_objects(f"s3://{s3.bucket}/noindex", FAST)] == list(plain.keys)


def test_index_naming_a_missing_object(s3, s3_client, local_checkpoint) -> None:
    index = (local_checkpoint / "model.safetensors.index.json").read_bytes()
    s3_client.put_object(Bucket=s3.bucket, Key="halfgone/model.safetensors.index.json", Body=index)
    s3_client.put_object(Bucket=s3.bucket, Key=f"halfgone/{SHARD1}", Body=local_bytes(local_checkpoint, SHARD1))
    store, root = open_store(f"s3://{s3.bucket}/halfgone", FAST)
    exc = fail(lambda: discover(store, root), MissingFileError, f"s3://{s3.bucket}/halfgone/{SHARD2}")
    assert exc.tensor is not None


def test_http_uri_reads_through_the_index(s3, s3_client, local_checkpoint) -> None:
    """An HTTP server cannot be listed: the index is fetched by name (moto serves public objects unsigned)."""
    for name in ("model.safetensors.index.json", SHARD1, SHARD2):
        s3_client.put_object(Bucket=s3.bucket, Key=f"public/{name}", Body=local_bytes(local_checkpoint, name),
                             ACL="public-read")
    uri = f"{s3.proxy.url}/{s3.bucket}/public"
    store, root = open_store(uri, FAST)
    layout = discover(store, root)
    assert [k.rsplit("/", 1)[-1] for k in layout.keys] == [SHARD1, SHARD2]
    remote = read_safetensors_header(store, layout.keys[1])
    t = next(iter(remote.header.tensors.values()))
    assert bytes(remote.source.read(t.start, t.nbytes)) == local_bytes(local_checkpoint, SHARD2)[t.start:t.end]


# --------------------------------------------------------------------------- faults


def test_missing_bucket(s3) -> None:
    store, root = open_store(f"s3://no-such-bucket-{os.getpid()}/model", FAST)
    exc = fail(lambda: discover(store, root), MissingFileError, root.uri)
    assert "bucket" in str(exc)


def test_missing_object(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    uri = s3.uri("absent.safetensors")
    fail(lambda: read_safetensors_header(store, root.child("absent.safetensors").key), MissingFileError, uri)
    fail(lambda: store.open(root.child("absent.safetensors").key), MissingFileError, uri)


def test_empty_prefix(s3) -> None:
    store, root = open_store(f"s3://{s3.bucket}/nothing-here", FAST)
    fail(lambda: discover(store, root), MissingFileError, root.uri)


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_access_denied(s3, code: str) -> None:
    store, root = open_store(s3.uri(), FAST)
    s3.proxy.inject("status", status=403, code=code, applies=lambda m, p, h: True)
    exc = fail(lambda: read_safetensors_header(store, root.child(SHARD1).key), AccessDeniedError, s3.uri(SHARD1))
    assert code in str(exc)


def test_access_denied_mid_load_names_the_tensor(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.inject("status", status=403, code="ExpiredToken")
    fail(lambda: src.read_into(0, memoryview(bytearray(1000)), tensor="model.norm.weight"),
         AccessDeniedError, s3.uri(SHARD1), "model.norm.weight")


def test_endpoint_unreachable(s3, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens there
    store, root = open_store(s3.uri(), FAST)
    exc = fail(lambda: discover(store, root), StoreUnavailableError, root.uri)
    assert "connect" in str(exc)


def test_object_shorter_than_its_header_says(s3, s3_client, local_checkpoint) -> None:
    data = local_bytes(local_checkpoint, SHARD2)
    s3_client.put_object(Bucket=s3.bucket, Key="broken/short.safetensors", Body=data[:-1000])
    store, root = open_store(f"s3://{s3.bucket}/broken/short.safetensors", FAST)
    exc = fail(lambda: read_safetensors_header(store, root.key), TruncatedFileError, root.uri)
    assert exc.tensor is not None


def test_object_too_short_for_a_header(s3, s3_client) -> None:
    s3_client.put_object(Bucket=s3.bucket, Key="broken/tiny.safetensors", Body=b"\x05\x00")
    s3_client.put_object(Bucket=s3.bucket, Key="broken/empty.safetensors", Body=b"")
    store, _ = open_store(f"s3://{s3.bucket}/broken", FAST)
    fail(lambda: read_safetensors_header(store, "broken/tiny.safetensors"), HeaderError,
         f"s3://{s3.bucket}/broken/tiny.safetensors")
    fail(lambda: read_safetensors_header(store, "broken/empty.safetensors"), HeaderError,
         f"s3://{s3.bucket}/broken/empty.safetensors")


def test_read_past_the_end(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    fail(lambda: src.read(src.size - 10, 20, tensor="x"), ReadError, src.uri, "x")


def _mutable_copy(s3, s3_client, local_checkpoint, name: str) -> tuple[str, bytes]:
    key = f"mutable/{name}"
    data = local_bytes(local_checkpoint, SHARD1)
    s3_client.put_object(Bucket=s3.bucket, Key=key, Body=data)
    return key, data


@pytest.mark.parametrize("server_checks_if_match", [True, False])
def test_object_replaced_during_load(s3, s3_client, local_checkpoint, server_checks_if_match: bool) -> None:
    """Replaced after open: the store refuses If-Match (412), or, if it ignores If-Match, the
    response's ETag differs from the one recorded at open. Either way the load stops."""
    key, data = _mutable_copy(s3, s3_client, local_checkpoint, f"swap-{server_checks_if_match}.safetensors")
    store, root = open_store(f"s3://{s3.bucket}/{key}", {**FAST, "max_in_flight": 1})
    remote = read_safetensors_header(store, key)
    replaced = bytes(reversed(data))  # same size, other bytes
    s3.proxy.inject("swap", after=1, times=1, on_swap=lambda: s3_client.put_object(
        Bucket=s3.bucket, Key=key, Body=replaced))
    s3.proxy.ignore_if_match = not server_checks_if_match
    buf = bytearray(remote.source.size)
    exc = fail(lambda: remote.source.read_into(0, memoryview(buf), tensor="model.layers.0.mlp.up_proj.weight"),
               FileChangedError, root.uri, "model.layers.0.mlp.up_proj.weight")
    # Who noticed: the store (412 to If-Match), or fastload comparing the response's ETag.
    assert ("412" in str(exc)) == server_checks_if_match
    assert (f"ETag {remote.source.etag} -> " in str(exc)) != server_checks_if_match
    with pytest.raises(FileChangedError):
        remote.source.check_unchanged(refresh=True)


def test_check_unchanged_when_untouched(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    src.check_unchanged()
    src.check_unchanged(refresh=True)


def test_transient_throttling_and_5xx_are_retried(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.clear()
    s3.proxy.inject("status", status=503, code="SlowDown", times=2)
    s3.proxy.inject("status", status=500, code="InternalError", times=1)
    buf = bytearray(src.size)
    src.read_into(0, memoryview(buf))
    assert buf == local_bytes(local_checkpoint, SHARD1)
    assert sum(r.status >= 500 for r in s3.proxy.records) == 3


@pytest.mark.parametrize("status, code", [(503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests")])
def test_persistent_throttling_gives_up(s3, status: int, code: str) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.clear()
    s3.proxy.inject("status", status=status, code=code)
    exc = fail(lambda: src.read_into(0, memoryview(bytearray(100)), tensor="t"), StoreUnavailableError, src.uri, "t")
    assert f"HTTP {status}" in str(exc) and code in str(exc)
    assert len(s3.proxy.records) == FAST["max_retries"] + 1  # bounded retries


def test_server_stops_answering_mid_load(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.inject("stall", after=2)
    exc = fail(lambda: src.read_into(0, memoryview(bytearray(src.size)), tensor="model.embed_tokens.weight"),
               StoreUnavailableError, src.uri, "model.embed_tokens.weight")
    assert "in time" in str(exc)


def test_truncated_body_is_resumed_once_and_fails_when_persistent(s3, local_checkpoint) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.inject("truncate", times=1)
    buf = bytearray(src.size)
    src.read_into(0, memoryview(buf))
    assert buf == local_bytes(local_checkpoint, SHARD1)
    s3.proxy.clear()
    s3.proxy.inject("truncate")
    fail(lambda: src.read_into(0, memoryview(bytearray(100)), tensor="t"), StoreUnavailableError, src.uri, "t")


def test_short_answer_is_an_error(s3) -> None:
    store, root = open_store(s3.uri(), FAST)
    src = store.open(root.child(SHARD1).key)
    s3.proxy.inject("short", times=1)
    exc = fail(lambda: src.read_into(0, memoryview(bytearray(5000)), tensor="t"), ReadError, src.uri, "t")
    assert "returned 2500 of 5000 bytes" in str(exc)


def test_failed_read_waits_for_every_request(s3) -> None:
    """One request fails: the future completes only after the others finished writing."""
    store, root = open_store(s3.uri(), {**FAST, "request_size": 4096})
    src = store.open(root.child(SHARD1).key)
    s3.proxy.inject("status", status=403, code="AccessDenied", times=1)
    future = src.submit_ranges_into([(0, memoryview(bytearray(65536)))], tensor="t")
    with pytest.raises(AccessDeniedError):
        future.result(BOUND_S)
    n = len(s3.proxy.records)
    time.sleep(0.3)
    assert len(s3.proxy.records) == n  # nothing still in flight after the error was reported


def test_store_without_if_match_still_checks_etags(s3, s3_client, local_checkpoint, monkeypatch) -> None:
    """A client that cannot send If-Match: reads go on unconditioned, and a replaced object is
    still caught by the ETag of the response."""
    import obstore
    from obstore import exceptions as obstore_errors

    real_get = obstore.get_async

    async def get_without_if_match(store, path, *, options=None):
        if options and options.get("if_match"):
            raise obstore_errors.NotSupportedError("if_match not supported by this store")
        return await real_get(store, path, options=options)

    monkeypatch.setattr(obstore, "get_async", get_without_if_match)
    key, data = _mutable_copy(s3, s3_client, local_checkpoint, "no-if-match.safetensors")
    store, root = open_store(f"s3://{s3.bucket}/{key}", {**FAST, "max_in_flight": 1})
    src = store.open(key)
    buf = bytearray(src.size)
    src.read_into(0, memoryview(buf))
    assert buf == data and store.if_match is False
    s3_client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(reversed(data)))
    fail(lambda: src.read_into(0, memoryview(buf), tensor="w"), FileChangedError, root.uri, "w")
