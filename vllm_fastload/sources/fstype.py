"""Which filesystem a checkpoint file lives on, and the reader defaults that suit it.

Why: a network filesystem answers each request after a round trip, so what is fast on a
local disk (a page-cache probe, row-by-row reads of a column slice, few large requests) can
be slow there. The type comes from ``/proc/mounts`` (the longest mount point that contains
the file's real path, the rule the kernel itself uses); no syscall that could hang on a
dead server is made.

``tuned`` applies the defaults ``policy.filesystem_defaults`` gives, only to fields the user left
at their defaults (pydantic's ``model_fields_set``): an explicit setting always wins.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from vllm_fastload import policy

if TYPE_CHECKING:
    from vllm_fastload.config import FastloadConfig

logger = logging.getLogger("vllm_fastload")

#: Filesystem types (as /proc/mounts spells them) whose reads cross a network.
NETWORK = frozenset({
    "nfs", "nfs4", "lustre", "ceph", "fuse.ceph", "fuse.ceph-fuse", "cifs", "smb3", "9p", "fuse.sshfs",
    "glusterfs", "fuse.glusterfs", "beegfs", "gpfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3",
    "fuse.juicefs", "fuse.rclone", "virtiofs", "weka", "wekafs",
})


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem that holds ``path`` (e.g. ``ext4``, ``fuse.sshfs``, ``nfs4``);
    ``""`` where ``/proc/mounts`` cannot be read (not Linux)."""
    resolved = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return ""
    return fstype


def is_network(fstype: str) -> bool:
    """Whether reads on this filesystem type cross a network."""
    return fstype in NETWORK or fstype.startswith("nfs")


def tuned(config: FastloadConfig, path: str | os.PathLike[str]) -> FastloadConfig:
    """``config`` with the defaults for ``path``'s filesystem in the fields the user left unset."""
    network = is_network(filesystem_type(path))
    update = policy.filesystem_defaults(network=network, set_fields=config.model_fields_set)
    if network:
        logger.debug("fastload: network filesystem defaults for %s: %s", path, update or "none (all set)")
    return config.model_copy(update=update) if update else config
