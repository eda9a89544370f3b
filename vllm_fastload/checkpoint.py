"""A checkpoint: its files (local or in an object store), opened and parsed, and the routing
table from tensor name to ``TensorInfo``; and the two reads of a checkpoint's metadata that need no
open checkpoint (``read_header``, ``read_index``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.errors import (
    CheckpointError,
    HeaderError,
    IndexMismatchError,
    MissingFileError,
    TensorNotFoundError,
)
from vllm_fastload.format import (
    INDEX_NAME,
    SafetensorsFile,
    SafetensorsHeader,
    TensorInfo,
    header_length,
    parse_file,
    parse_weight_map,
)
from vllm_fastload.frozen import FrozenMap
from vllm_fastload.sources.local import LocalSource
from vllm_fastload.sources.uri import is_remote


def read_safetensors_file(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Open and validate one local file. The descriptor stays open (see SafetensorsFile)."""
    source = LocalSource(path)
    try:
        size = source.size
        first8 = source.read_exact(0, 8, "header length") if size >= 8 else b""
        n = header_length(source.path, first8, size)
        return parse_file(source, source.read_exact(8, n, "header"))
    except BaseException:
        source.close()
        raise


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """The header of one local safetensors file, validated (the file is closed again).

    Raises:
        MissingFileError: there is no such file.
        HeaderError: its header is unreadable or invalid (``TensorMetadataError``: an entry).
        TruncatedFileError: the file is shorter than its header says.
    """
    sf = read_safetensors_file(path)
    sf.close()
    return sf.header


def read_index(directory: str | os.PathLike[str]) -> FrozenMap[str, str] | None:
    """The weight map of the directory's ``model.safetensors.index.json`` (tensor -> file name, each
    normalised inside the checkpoint: ``OutsideCheckpointError`` otherwise); None without one.

    Raises:
        HeaderError: the index is unreadable or has no weight map.
        OutsideCheckpointError: an entry names a file outside the directory.
    """
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        text = index.read_bytes()
    except OSError as exc:
        raise HeaderError(f"cannot read index: {exc}", file=index) from exc
    return FrozenMap(parse_weight_map(str(index), text))


class Checkpoint:
    """All files of a checkpoint and a routing table ``tensor name -> TensorInfo``.

    Accepts a directory with ``model.safetensors.index.json``, a directory of
    ``*.safetensors`` without an index, or a single file. Files listed by an index are
    cross-checked against it; a tensor in two files is an error (as in TGI and vLLM).
    """

    def __init__(self, files: Iterable[SafetensorsFile], *, source: str) -> None:
        self.source = source
        #: Whether the files are objects in a store (read by ranged GETs, no descriptors).
        self.is_remote = False
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        files = list(files)
        try:
            for sf in files:
                self.add_file(sf)
        except BaseException:
            # A failed constructor must not leak the descriptors of the files it was given.
            for sf in files:
                sf.close()
            raise

    @classmethod
    def discover(cls, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 remote: RemoteConfig | Mapping[str, Any] | None = None,
                 memory_budget: int | None = None) -> Checkpoint:
        """The checkpoint at a local path or an object store URI (``s3://bucket/prefix``, ...), or
        exactly the local files listed (a caller that chose them, e.g. by a model's own patterns).

        ``remote`` configures the object store client and ``memory_budget`` bounds its requests
        in flight; both are ignored for local paths.
        """
        if not isinstance(path, (str, os.PathLike)):
            files = [Path(p) for p in path]
            if not files:
                raise MissingFileError("no checkpoint files were given", file="")
            return cls(_read_all(files), source=os.path.commonpath([str(f.parent) for f in files]))
        if is_remote(path):
            return cls._discover_remote(str(path), remote, memory_budget)
        root = Path(path)
        if root.is_file():
            return cls([read_safetensors_file(root)], source=str(root))
        if not root.exists():
            raise MissingFileError("checkpoint path does not exist", file=root)
        index = root / INDEX_NAME
        if not index.exists():
            indexes = sorted(root.glob("*.safetensors.index.json"))
            index = indexes[0] if len(indexes) == 1 else index
        if index.exists():
            return cls._from_index(root, index)
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise MissingFileError("no *.safetensors files in directory", file=root)
        return cls(_read_all(shards), source=str(root))

    @classmethod
    def _discover_remote(cls, uri: str, remote: RemoteConfig | Mapping[str, Any] | None,
                         memory_budget: int | None) -> Checkpoint:
        """Objects found by the same rules as a directory; all headers fetched concurrently."""
        from vllm_fastload.sources import object_store, remote_checkpoint  # obstore loads only for a URI

        store, root = object_store.open_store(uri, dict(remote) if isinstance(remote, Mapping) else remote,
                                              memory_budget=memory_budget)
        layout = remote_checkpoint.discover(store, root)
        ckpt = cls(remote_checkpoint.read_safetensors_headers(store, layout.keys), source=root.uri)
        if layout.weight_map is not None and layout.index_key is not None:
            index = layout.index_key.rsplit("/", 1)[-1]
            ckpt._check_index(index, layout.weight_map, lambda f: store.uri_of(root.child(f).key))
        return ckpt

    @classmethod
    def _from_index(cls, root: Path, index: Path) -> Checkpoint:
        try:
            text = index.read_bytes()
        except OSError as exc:
            raise HeaderError(f"cannot read index: {exc}", file=index) from exc
        weight_map = parse_weight_map(str(index), text)
        wanted_files: dict[str, str] = {}
        for name, filename in weight_map.items():
            wanted_files.setdefault(filename, name)
        for filename, example in wanted_files.items():
            if not (root / filename).is_file():
                raise MissingFileError(
                    f"index {index.name} maps tensors to this file but it does not exist",
                    file=root / filename, tensor=example)
        ckpt = cls(_read_all(root / f for f in wanted_files), source=str(root))
        ckpt._check_index(index.name, weight_map, lambda f: str(root / f))
        return ckpt

    def _check_index(self, index: str, weight_map: Mapping[str, str], expected_of: Callable[[str], str]) -> None:
        """Every tensor the index names is in the file it names (``expected_of(file name)``);
        on failure the checkpoint is closed, so no descriptor outlives it."""
        try:
            for name, filename in weight_map.items():
                info = self.tensors.get(name)
                expected = expected_of(filename)
                if info is None:
                    raise IndexMismatchError(
                        f"index {index} says this tensor is in {filename} but that file does not hold it",
                        file=expected, tensor=name)
                if info.file != expected:
                    raise IndexMismatchError(
                        f"index {index} maps this tensor to {filename} but it is in {_basename(info.file)}",
                        file=info.file, tensor=name)
        except BaseException:
            self.close()
            raise

    def add_file(self, sf: SafetensorsFile) -> None:
        """Add a file (also after construction: TGI adds speculator files to its routing)."""
        if sf.path in self.files:
            return
        for name in sorted(sf.header.tensors):  # the first clash by name, as TGI's own check finds it
            other = self.tensors.get(name)
            if other is not None:
                raise IndexMismatchError(
                    f"tensor is in two files: {other.file} and {sf.path}", file=sf.path, tensor=name)
        self.files[sf.path] = sf
        self.tensors.update(sf.header.tensors)
        self.is_remote = self.is_remote or not sf.is_local

    def file_for(self, path: str) -> SafetensorsFile:
        """The parsed file at ``path``, parsing it on first use."""
        path = os.fspath(path)
        sf = self.files.get(path)
        if sf is None:
            if is_remote(path):
                raise MissingFileError("object is not part of this checkpoint (objects are found when it "
                                       "is opened)", file=path)
            sf = read_safetensors_file(path)
            try:
                self.add_file(sf)
            except BaseException:
                sf.close()  # rejected (e.g. a tensor already in another file): keep no descriptor
                raise
        return sf

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorNotFoundError(
                f"no tensor of this name in the checkpoint ({len(self.tensors)} tensors in "
                f"{len(self.files)} files)", file=self.source, tensor=name) from None

    def check_unchanged(self, paths: Iterable[str] | None = None) -> None:
        for path in (self.files if paths is None else paths):
            self.files[path].check_unchanged()

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _read_all(paths: Iterable[Path | str]) -> list[SafetensorsFile]:
    opened: list[SafetensorsFile] = []
    try:
        for p in paths:
            opened.append(read_safetensors_file(p))
    except CheckpointError:
        for sf in opened:
            sf.close()
        raise
    return opened
