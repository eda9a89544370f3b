"""Fixtures for the network-filesystem tests: a tiny checkpoint served over a real sshfs mount.

The mount needs ``sshd``, ``ssh-keygen``, ``sshfs``, ``fusermount`` and ``/dev/fuse``
(Debian: ``apt-get install openssh-server sshfs``; ``scripts/setup-netsources.sh``, run by
``scripts/test.sh``, installs them where it may run apt). Where one is missing the tests skip
and the reason names what is missing and how to get it: never a silent skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_fastload.bench import netfs
from vllm_fastload.tools.checkpoints import write_checkpoint


@pytest.fixture(autouse=True)
def _no_fastload_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("FASTLOAD_"):
            monkeypatch.delenv(key)


def require_sshfs() -> None:
    lacking = netfs.missing()
    if lacking:
        pytest.skip("no sshfs mount possible on this machine, missing: " + "; ".join(lacking))


@pytest.fixture(scope="session")
def local_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("netfs") / "ckpt", "tiny-llama", files=2)


@pytest.fixture(scope="session")
def mounted(local_checkpoint: Path) -> Iterator[Path]:
    """The checkpoint directory as seen through sshfs (one mount for the session)."""
    require_sshfs()
    with netfs.sshfs_mount(local_checkpoint) as mountpoint:
        yield mountpoint
