"""An engine's HTTP server in a subprocess: started in a session of its own, waited for until
``/health`` answers, stopped with what it started. vLLM's (``vllm_server``) and SGLang's
(``sglang_server``) differ in their command line and in how they are stopped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


def free_port() -> int:
    """A TCP port on loopback that no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """The server ended during start-up."""


class EngineServer:
    """``with Server(...) as srv: ...``: ``start`` on entering (``stop`` too if it fails), ``stop`` on leaving."""

    #: The engine's name, as messages say it.
    engine = "engine"
    #: Seconds between two asks of ``/health``: the time to ready is measured by that loop.
    poll_s = 0.1

    def __init__(self, *, log_path: str | os.PathLike, startup_timeout: float, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.env = env
        #: The command line, which the engine's class makes (it names ``self.port``).
        self.cmd: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None
        #: Seconds from the process's start to ready (``/health`` answering 200), once ready.
        self.ready_s: float | None = None
        #: Where it ended during start-up: seconds from its start, and when (``time.time()``).
        self.exited_after_s: float | None = None
        self.exited_at: float | None = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it answers ``/health``; ``ServerExited`` where it ends
        first, ``TimeoutError`` (stopped) where it takes longer than allowed."""
        self._log = self.log_path.open("wb")
        started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while time.monotonic() < started + self.startup_timeout:
            if self.proc.poll() is not None:
                self.exited_after_s, self.exited_at = time.monotonic() - started, time.time()
                raise ServerExited(f"{self.engine} server exited with code {self.proc.returncode} during start-up "
                                   f"after {self.exited_after_s:.1f} s; last lines of {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(self.poll_s)
        self.stop()
        raise TimeoutError(f"{self.engine} server not ready after {self.startup_timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """End the server and what it started; close its log."""
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
