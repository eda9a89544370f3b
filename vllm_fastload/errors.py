"""One exception hierarchy for everything that can be wrong with a checkpoint.

Every message names the file, and the tensor where there is one, so that a failed
server start-up says what to fix without a debugger.
"""

from __future__ import annotations

import os


class ConfigError(ValueError):
    """A configuration value is unknown or invalid; the message names the field."""


class CheckpointError(Exception):
    """Base class: something about the checkpoint (or reading it) is wrong."""

    def __init__(self, message: str, *, file: str | os.PathLike[str] | None = None,
                 tensor: str | None = None) -> None:
        self.file = os.fspath(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(f"file {self.file!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.reason = message


class HeaderError(CheckpointError):
    """The safetensors header is unreadable: length, UTF-8, JSON or structure."""


class TensorMetadataError(HeaderError):
    """One tensor's entry is invalid: dtype, shape, offsets or size."""


class TruncatedFileError(CheckpointError):
    """The file ends before the data its header promises."""


class MissingFileError(CheckpointError):
    """A file the checkpoint (or its index) names does not exist or cannot be opened."""


class OutsideCheckpointError(CheckpointError):
    """An index names a file outside its checkpoint (``..``, an absolute path, another scheme or
    bucket). Refused before anything is opened: a checkpoint from a third party must not make the
    loader read the host's other files."""


class IndexMismatchError(CheckpointError):
    """The index and the files disagree, or two files hold the same tensor."""


class TensorNotFoundError(CheckpointError, KeyError):
    """A requested tensor is in no file of the checkpoint."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return Exception.__str__(self)


class InvalidRequestError(CheckpointError, ValueError):
    """A slice request does not fit the tensor (dim, start, length) or its destination."""


class ReadError(CheckpointError):
    """I/O failed mid-read (EOF, EIO); the message names the offset."""


class StalledReadError(ReadError):
    """A read made no progress for ``stall_timeout_s``: the storage stopped answering. The thread
    that issued it cannot be taken back; the load is given up."""


class FileChangedError(CheckpointError):
    """The file's size or mtime changed while it was being read: its bytes can't be trusted."""


class AccessDeniedError(CheckpointError):
    """The object store refused the request: credentials missing, wrong or expired, or lacking permission."""


class PlanError(CheckpointError):
    """fastload's own plan for a rank failed a check before or while it ran: a bug in fastload, not
    in the checkpoint. The message names the parameter; ``plan_per_rank: false`` loads without the plan."""


class StoreUnavailableError(ReadError):
    """The object store could not be reached, or kept failing (timeouts, throttling, 5xx) past the retry limit."""
