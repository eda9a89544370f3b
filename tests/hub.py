"""Hugging Face Hub ids (``org/name``) where the Hub cannot be reached: a cache layout and a stand-in.

``write_cache`` lays out a revision of a local checkpoint as ``huggingface_hub`` does in its cache
(``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` symlinks into
``../../blobs/``, ``refs/<branch>``). ``StandInHub`` answers the part of the Hub's HTTP API that
vLLM and ``huggingface_hub`` ask at start-up for one repository (repository info, file tree,
paths info, file metadata and downloads), on loopback, through ``HF_ENDPOINT``; it records every
request. A test helper, not shipped: the tests use it, and ``vllm-fastload bench --model org/name
--stand-in-hub`` loads it from a source checkout (``bench/hubbench.py``), so it imports nothing
but the standard library.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

#: A checkpoint directory's own bookkeeping (``make-checkpoint``'s recipe), not part of the model.
_SKIP_PREFIX = ".fastload"


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def etag(path: Path) -> str:
    """The Hub's ETag of a file stored in LFS: the sha256 of its bytes (the cache names blobs by it)."""
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Revision:
    """One commit of the repository: repository path -> the local file that holds its bytes."""

    files: dict[str, Path]

    @classmethod
    def of_directory(cls, directory: str | os.PathLike) -> Revision:
        """Every file directly in ``directory`` (a checkpoint made by ``make-checkpoint``)."""
        root = Path(directory)
        return cls({p.name: p for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(_SKIP_PREFIX)})

    @functools.cached_property
    def commit(self) -> str:
        """A 40-hex commit id derived from the files' names and contents."""
        text = "\n".join(f"{name} {etag(path)}" for name, path in sorted(self.files.items()))
        return hashlib.sha1(text.encode()).hexdigest()


def repo_folder(cache_dir: str | os.PathLike, repo_id: str) -> Path:
    """Where the cache keeps a model repository (``models--org--name``)."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def write_cache(cache_dir: str | os.PathLike, repo_id: str, revision: Revision, *, ref: str = "main",
                link: bool = True) -> Path:
    """Lay ``revision`` out in the cache at ``cache_dir`` and point ``refs/<ref>`` at it; returns its
    snapshot directory. ``link``: blobs are hard links to the files where the filesystem allows
    (no second copy of a large checkpoint), else copies."""
    storage = repo_folder(cache_dir, repo_id)
    snapshot = storage / "snapshots" / revision.commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    for name, source in revision.files.items():
        blob = storage / "blobs" / etag(source)
        if not blob.exists():
            try:
                if not link:
                    raise OSError("copy asked for")
                os.link(source, blob)
            except OSError:
                shutil.copyfile(source, blob)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(os.path.relpath(blob, target.parent))
    (storage / "refs" / ref).write_text(revision.commit)
    return snapshot


@dataclass
class StandInHub:
    """The Hub's HTTP API for one repository, on ``127.0.0.1``; a context manager.

    ``refs`` maps branch names to commits of ``revisions``; a test moves ``main`` to publish a
    new revision. ``requests`` lists ``(method, path)`` of every request answered.
    """

    repo_id: str
    revisions: list[Revision]
    refs: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.refs:
            self.refs = {"main": self.revisions[-1].commit}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "the stand-in Hub is not running"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> StandInHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="stand-in-hub", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def env(self, cache_dir: str | os.PathLike) -> dict[str, str]:
        """The environment that sends ``huggingface_hub`` (and vLLM) here, with this cache, online."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "0",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "10"}

    def publish(self, revision: Revision, ref: str = "main") -> None:
        """Make ``revision`` the head of ``ref`` (a newer commit on the Hub)."""
        with self._lock:
            if revision not in self.revisions:
                self.revisions.append(revision)
            self.refs[ref] = revision.commit

    def downloads(self) -> list[str]:
        """Paths of the files whose bytes were sent (GET of a ``resolve`` URL)."""
        with self._lock:
            return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    # -- what the handler asks ------------------------------------------------------------------
    def _revision(self, rev: str) -> Revision | None:
        commit = self.refs.get(unquote(rev), unquote(rev))
        return next((r for r in self.revisions if r.commit == commit), None)

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))


def _entry(name: str, path: Path) -> dict:
    size = path.stat().st_size
    return {"type": "file", "path": name, "size": size, "oid": hashlib.sha1(name.encode()).hexdigest(),
            "lfs": {"oid": etag(path), "size": size, "pointerSize": 134}}


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    repo = re.escape(hub.repo_id)
    return type("Handler", (_HubHandler,), {
        "hub": hub,
        "api": re.compile(r"^/api/models/" + repo + r"(?:/revision/([^/]+))?/?$"),
        "tree": re.compile(r"^/api/models/" + repo + r"/tree/([^/]+)(?:/(.*))?$"),
        "paths_info": re.compile(r"^/api/models/" + repo + r"/paths-info/([^/]+)$"),
        "resolve": re.compile(r"^/" + repo + r"/resolve/([^/]+)/(.+)$"),
    })


class _HubHandler(BaseHTTPRequestHandler):
    """The stand-in Hub's answers; ``_handler`` binds it to a hub and its URL patterns."""

    protocol_version = "HTTP/1.1"
    hub: StandInHub
    api: re.Pattern[str]
    tree: re.Pattern[str]
    paths_info: re.Pattern[str]
    resolve: re.Pattern[str]

    def log_message(self, *args: object) -> None:  # quiet: the hub records requests itself
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = urlsplit(self.path).path
        self.hub._record("POST", path)
        match = self.paths_info.match(path)
        revision = self.hub._revision(match.group(1)) if match else None
        if revision is None:
            return self._error(404, "RevisionNotFound" if match else "RepoNotFound")
        if "json" in (self.headers.get("Content-Type") or ""):
            wanted = json.loads(body or b"{}").get("paths", [])
        else:
            wanted = parse_qs(body.decode()).get("paths", [])
        entries = [_entry(p, revision.files[p]) for p in wanted if p in revision.files]
        self._json(entries)

    def _answer(self, *, head: bool) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        self.hub._record("HEAD" if head else "GET", path)
        if match := self.api.match(path):
            revision = self.hub._revision(match.group(1) or "main")
            if revision is None:
                return self._error(404, "RevisionNotFound")
            siblings = [{"rfilename": name, "size": p.stat().st_size} for name, p in sorted(revision.files.items())]
            return self._json({"id": self.hub.repo_id, "modelId": self.hub.repo_id, "sha": revision.commit,
                               "private": False, "disabled": False, "gated": False, "tags": [],
                               "siblings": siblings}, head=head)
        if match := self.tree.match(path):
            revision = self.hub._revision(match.group(1))
            if revision is None:
                return self._error(404, "RevisionNotFound")
            prefix = (match.group(2) or "").strip("/")
            names = sorted(n for n in revision.files if not prefix or n.startswith(prefix + "/"))
            return self._json([_entry(n, revision.files[n]) for n in names], head=head)
        if match := self.resolve.match(path):
            revision = self.hub._revision(match.group(1))
            name = match.group(2)
            if revision is None:
                return self._error(404, "RevisionNotFound")
            if name not in revision.files:
                return self._error(404, "EntryNotFound", commit=revision.commit)
            return self._file(revision, name, head=head)
        return self._error(404, "RepoNotFound")

    def _file(self, revision: Revision, name: str, *, head: bool) -> None:
        source = revision.files[name]
        size = source.stat().st_size
        start, end = 0, size - 1
        ranged = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range") or "")
        if ranged:
            start, end = int(ranged.group(1)), min(int(ranged.group(2) or size - 1), size - 1)
        self.send_response(206 if ranged else 200)
        tag = f'"{etag(source)}"'
        self.send_header("ETag", tag)
        self.send_header("X-Linked-Etag", tag)
        self.send_header("X-Linked-Size", str(size))
        self.send_header("X-Repo-Commit", revision.commit)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1 if size else 0))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head or not size:
            return
        with open(source, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left:
                block = f.read(min(left, 1 << 22))
                if not block:
                    break
                self.wfile.write(block)
                left -= len(block)

    def _json(self, doc: object, *, head: bool = False) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, *, commit: str | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", code)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

