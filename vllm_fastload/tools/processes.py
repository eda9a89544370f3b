"""Stopping the helper servers the tests and benchmarks start (s3rver, moto, sshd)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session=True``), SIGKILL
    it if it has not exited within ``timeout`` s; nothing if it is None or already gone."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
