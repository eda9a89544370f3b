"""A real S3-compatible server on loopback, and a counting, fault-injecting proxy in front of it.

``MotoServer`` runs PyPI ``moto[server]`` as a child process on 127.0.0.1 (its own process
group, killed at the end). ``FaultProxy`` listens on 127.0.0.1 too and forwards every request
to moto, recording what it served (method, key, range, status, body bytes), so tests count
requests and bytes on the server side. ``inject`` makes it misbehave the way stores do:
throttling, 5xx, access denied, answering nothing, truncated or short bodies, an object
replaced mid-load, a server that ignores ``If-Match``. Nothing here talks to any other host.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from vllm_fastload.bench.objstore import LoopbackServer
from vllm_fastload.tools.processes import stop_process_group

HOST = "127.0.0.1"
BUCKET = "fastload-test"
PREFIX = "tiny-llama"
#: A distinctive secret: no message may ever contain it.
SECRET = "fastload-test-SECRET-4f9c2e71"
ACCESS_KEY_ID = "FASTLOADTESTKEYID"
#: Hop-by-hop headers a proxy must not forward.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1, started and stopped as a context manager."""

    def __init__(self, startup_timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._timeout = startup_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited at start-up with status {self._proc.returncode}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"moto server did not answer on {self.url} within {self._timeout} s")

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        stop_process_group(proc)  # the server and any children it forked


@dataclass
class Record:
    """One request as the proxy saw and answered it."""

    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    fault: str | None


@dataclass
class Fault:
    """What the proxy does to the requests ``applies`` selects, after ``after`` of them passed."""

    mode: str  # status | stall | truncate | short | swap
    after: int = 0
    times: int | None = None
    status: int = 503
    code: str = "SlowDown"
    applies: Callable[[str, str, dict[str, str]], bool] = lambda method, path, headers: method == "GET"
    on_swap: Callable[[], None] | None = None
    seen: int = 0
    fired: int = 0


_XML_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
              '<Resource>{path}</Resource><RequestId>fastload-test</RequestId></Error>')


class FaultProxy(LoopbackServer):
    """HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` (a loopback URL)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.hostname != HOST:
            raise ValueError("the test proxy only forwards to 127.0.0.1")
        self.upstream = (parts.hostname, parts.port)
        self.records: list[Record] = []
        self.faults: list[Fault] = []
        self.release = threading.Event()  # set at close: stalled handlers give up
        #: Drop ``If-Match`` from every request, like a server that ignores it.
        self.ignore_if_match = False
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()
        super().__init__(self._handler_class(), "fault-proxy")

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        super().__exit__(*exc)

    def inject(self, mode: str, **kwargs) -> Fault:
        """Add a fault (see ``Fault``); faults are tried in the order they were added."""
        fault = Fault(mode, **kwargs)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.records.clear()
            self.max_active = self.active

    def gets(self, key_suffix: str = "") -> list[Record]:
        """GET requests answered, optionally only for keys ending in ``key_suffix``."""
        with self._lock:
            return [r for r in self.records if r.method == "GET" and r.path.endswith(key_suffix)]

    def bytes_served(self) -> int:
        with self._lock:
            return sum(r.body_bytes for r in self.records)

    def _choose(self, method: str, path: str, headers: dict[str, str]) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if not fault.applies(method, path, headers):
                    continue
                fault.seen += 1
                if fault.seen <= fault.after or (fault.times is not None and fault.fired >= fault.times):
                    continue
                fault.fired += 1
                return fault
        return None

    def _record(self, *args) -> None:
        with self._lock:
            self.records.append(Record(*args))

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._handle()

            def do_HEAD(self) -> None:
                self._handle()

            def do_PUT(self) -> None:
                self._handle()

            def do_POST(self) -> None:
                self._handle()

            def do_DELETE(self) -> None:
                self._handle()

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.active += 1
                    proxy.max_active = max(proxy.max_active, proxy.active)
                try:
                    self._serve()
                finally:
                    with proxy._lock:
                        proxy.active -= 1

            def _serve(self) -> None:
                path = unquote(urlsplit(self.path).path)
                headers = {k.lower(): v for k, v in self.headers.items()}
                length = int(headers.get("content-length", 0) or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._choose(self.command, path, headers)
                mode = fault.mode if fault else None
                rng = headers.get("range")
                if mode == "stall":
                    proxy._record(self.command, path, rng, 0, 0, mode)
                    proxy.release.wait(120)
                    self.close_connection = True
                    return
                if mode == "status":
                    self._send_error(fault.status, fault.code, path, rng, mode)
                    return
                if mode == "swap" and fault.on_swap is not None and fault.fired == 1:
                    fault.on_swap()
                if proxy.ignore_if_match:
                    headers.pop("if-match", None)
                status, reason, out_headers, data = self._forward(headers, body)
                self._relay(status, reason, out_headers, data, path, rng, mode)

            def _forward(self, headers: dict[str, str], body: bytes):
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    send = {k: v for k, v in headers.items() if k not in _HOP}
                    conn.request(self.command, self.path, body=body or None, headers=send)
                    resp = conn.getresponse()
                    data = resp.read()
                    return resp.status, resp.reason, resp.getheaders(), data
                finally:
                    conn.close()

            def _relay(self, status, reason, out_headers, data, path, rng, mode) -> None:
                sent = data
                declared = len(data)
                if mode == "truncate" and self.command == "GET" and len(data) > 1:
                    sent = data[:len(data) // 2]       # promise all, send half, hang up
                elif mode == "short" and self.command == "GET" and len(data) > 1:
                    sent = data[:len(data) // 2]       # a consistent but short answer
                    declared = len(sent)
                self.send_response(status, reason)
                head = self.command == "HEAD"  # no body; Content-Length states the object's
                for name, value in out_headers:
                    if name.lower() not in _HOP and (head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(declared))
                if mode == "truncate":
                    self.send_header("Connection", "close")
                proxy._record(self.command, path, rng, status, 0 if head else len(sent), mode)
                self.end_headers()
                if not head:
                    self.wfile.write(sent)
                    self.wfile.flush()
                if mode == "truncate":
                    self.close_connection = True

            def _send_error(self, status: int, code: str, path: str, rng, mode) -> None:
                payload = _XML_ERROR.format(code=code, message=f"injected {code}", path=path).encode()
                proxy._record(self.command, path, rng, status, 0, mode)
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

        return Handler


@dataclass
class S3Env:
    """What a test needs: the proxy to point clients at, and a direct boto3 client to moto."""

    moto: MotoServer
    proxy: FaultProxy
    bucket: str
    prefix: str
    env: dict[str, str] = field(default_factory=dict)

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}" + (f"/{name}" if name else "")
