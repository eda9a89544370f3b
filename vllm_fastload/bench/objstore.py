"""An S3-compatible server on loopback for ``vllm-fastload bench --source s3``, and what the
benchmark measures around it: bytes served per rank, the server's own limit, a download.

The server is the npm package ``s3rver`` (several times faster for ranged GETs than moto; see
docs/benchmarks.md), installed into ``.fastload/s3rver`` with
``npm install --prefix .fastload/s3rver s3rver@3.7.1`` (``ensure_s3rver`` does it where npm is
available), never globally. Every client reaches it through a ``CountingProxy``: one per TP
rank (the worker hook points each rank's ``AWS_ENDPOINT_URL`` at its own proxy), so bytes
served per rank are counted on the server side, not reported by the loader being measured.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_fastload.tools.processes import stop_process_group
from vllm_fastload.tools.servers import free_port

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

HOST = "127.0.0.1"
BUCKET = "fastload-bench"
#: s3rver's built-in account.
ACCESS_KEY_ID = SECRET = "S3RVER"
S3RVER_VERSION = "3.7.1"
S3RVER_DIR = Path(".fastload/s3rver")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def s3rver_script(prefix: Path = S3RVER_DIR) -> Path | None:
    script = prefix / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    return script if script.exists() else None


def ensure_s3rver(prefix: Path = S3RVER_DIR) -> Path:
    """The s3rver entry script, installed with npm into ``prefix`` first if it is not there."""
    script = s3rver_script(prefix)
    if script is not None:
        return script
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        raise RuntimeError("--source s3 needs node and npm (apt-get install nodejs npm) to install s3rver into "
                           f"{prefix}")
    prefix.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                           f"s3rver@{S3RVER_VERSION}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    script = s3rver_script(prefix)
    if proc.returncode != 0 or script is None:
        raise RuntimeError(f"npm install s3rver@{S3RVER_VERSION} into {prefix} failed:\n{proc.stdout[-2000:]}")
    return script


class S3rver:
    """``node s3rver.js`` on 127.0.0.1:<free port> with one bucket, data in a temporary directory."""

    def __init__(self, script: Path, startup_timeout_s: float = 30.0) -> None:
        self.script = script
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._timeout = startup_timeout_s
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> S3rver:
        self._tmp = tempfile.TemporaryDirectory(prefix="fastload-s3rver-")
        self._proc = subprocess.Popen(
            [shutil.which("node") or "node", str(self.script), "-d", self._tmp.name, "-a", HOST, "-p", str(self.port),
             "--silent", "--configure-bucket", BUCKET], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.__exit__()
                raise RuntimeError(f"s3rver exited at start-up: {err.strip()[-1000:]}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
                conn.request("HEAD", f"/{BUCKET}")
                status = conn.getresponse().status
                conn.close()
                if status < 500:
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"s3rver did not answer on {self.url} within {self._timeout} s")

    @property
    def data_dir(self) -> str:
        assert self._tmp is not None, "s3rver is not running"
        return self._tmp.name

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        stop_process_group(proc)  # the server and any children it forked
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1, serving from a daemon thread while the context is open.

    The base of the benchmark's counting proxy and of the tests' fault-injecting proxy.
    """

    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = ThreadingHTTPServer((HOST, 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True, name=name)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


#: What a rate-limited proxy sends at a time: small enough that concurrent responses share the link.
_LINK_PIECE = 256 << 10


class CountingProxy(LoopbackServer):
    """A forwarding HTTP/1.1 proxy on 127.0.0.1 that counts the response body bytes it served.

    ``rate``: bytes per second that all its responses together may send, a node's link to the
    store; on loopback the store is otherwise never the bottleneck that a cluster's nodes share.
    """

    def __init__(self, upstream_port: int, name: str = "", rate: float | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate {rate}: bytes per second, more than 0")
        self.name = name
        self.upstream_port = upstream_port
        self.rate = rate
        self.bytes = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._link_free_at = 0.0
        super().__init__(self._handler(), f"count-proxy-{name}")

    def _hold(self, size: int) -> None:
        """Wait until the link has sent what went before, and this piece at ``rate``."""
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._link_free_at = max(now, self._link_free_at) + size / self.rate
            done = self._link_free_at
        time.sleep(max(0.0, done - time.monotonic()))

    def take(self) -> tuple[int, int]:
        """(body bytes, requests) served since the last call."""
        with self._lock:
            out, self.bytes, self.requests = (self.bytes, self.requests), 0, 0
        return out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            _upstream: http.client.HTTPConnection | None

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = getattr(self, "_upstream", None)
                if conn is None:
                    conn = self._upstream = http.client.HTTPConnection(HOST, proxy.upstream_port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    self._upstream = None
                    raise
                # counted before the client has it, so a caller that has its answer reads the count
                with proxy._lock:
                    proxy.requests += 1
                self.send_response(resp.status, resp.reason)
                streamed = resp.getheader("Content-Length") is not None
                for key, value in resp.getheaders():
                    if key.lower() not in _HOP and (streamed or key.lower() != "content-length"):
                        self.send_header(key, value)
                if streamed:  # forwarded as it arrives, in 1 MiB pieces
                    self.end_headers()
                    while self.command != "HEAD" and (piece := resp.read(1 << 20)):
                        self._send(piece)
                    resp.read()  # a HEAD's (empty) body too: the upstream connection is reused
                else:
                    data = resp.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self._send(data)

            def _send(self, piece: bytes) -> None:
                if self.command == "GET":
                    with proxy._lock:
                        proxy.bytes += len(piece)
                view = memoryview(piece)
                for start in range(0, len(view), _LINK_PIECE):
                    proxy._hold(len(view[start:start + _LINK_PIECE]))
                    self.wfile.write(view[start:start + _LINK_PIECE])

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        return Handler


def s3_env(endpoint: str) -> dict[str, str]:
    """What fastload (obstore) and vLLM's Run:ai streamer need to reach the server."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_ALLOW_HTTP": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


def _store(endpoint: str, prefix: str = ""):
    from obstore.store import S3Store

    return S3Store(BUCKET, prefix=prefix or None, endpoint=endpoint, access_key_id=ACCESS_KEY_ID,
                   secret_access_key=SECRET, region="us-east-1", virtual_hosted_style_request=False,
                   client_options={"allow_http": True, "timeout": "300s"})


def upload(directory: Path, endpoint: str, prefix: str) -> list[str]:
    """Put every file of ``directory`` under ``prefix/``; the keys of the safetensors files."""
    import obstore

    store = _store(endpoint)
    keys = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            obstore.put(store, f"{prefix}/{path.name}", path.read_bytes())
            if path.suffix == ".safetensors":
                keys.append(f"{prefix}/{path.name}")
    return keys


def server_limit_gbps(endpoint: str, sizes: dict[str, int], concurrency: int = 16, piece: int = 8 << 20) -> float:
    """GB/s of parallel ranged GETs of every object into memory: what the server can serve."""
    import obstore

    store = _store(endpoint)
    ranges = [(key, off, min(piece, size - off)) for key, size in sizes.items() for off in range(0, size, piece)]

    def get(item: tuple[str, int, int]) -> int:
        key, off, n = item
        return len(obstore.get_range(store, key, start=off, length=n))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(get, ranges))
    return total / (time.perf_counter() - start) / 1e9


def download(endpoint: str, prefix: str, dest: Path, concurrency: int = 8) -> float:
    """Copy every object under ``prefix/`` into ``dest`` (parallel GETs); the seconds it took."""
    import obstore

    store = _store(endpoint)
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    keys = [meta["path"] for batch in obstore.list(store, prefix=prefix) for meta in batch]

    def fetch(key: str) -> None:
        (dest / key.rsplit("/", 1)[-1]).write_bytes(bytes(obstore.get(store, key).bytes()))

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(fetch, keys))
    return time.perf_counter() - start
