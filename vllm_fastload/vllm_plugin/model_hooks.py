"""The model attributes vLLM's default loader honours, honoured the same way.

- ``allow_patterns_overrides``: the checkpoint is the files of the first pattern that matches
  any (``DefaultModelLoader._prepare_weights``), filtered by the index where the running vLLM
  does that too (before 0.32).
- ``is_unused_checkpoint_weight``: shards in which it accepts every tensor are left out of the
  load (their headers are read to tell), where the running vLLM's default loader drops them too
  (0.32 and later); the plan never reads a tensor the model does not take in any case.
- ``secondary_weights``: further checkpoint sources (other repositories, ``.pt`` files), which
  the loader hands, with the model, to vLLM's default loader.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from vllm_fastload.checkpoint import read_safetensors_file
from vllm_fastload.errors import CheckpointError, MissingFileError, OutsideCheckpointError
from vllm_fastload.format import INDEX_NAME, parse_weight_map
from vllm_fastload.sources import is_remote
from vllm_fastload.vllm_plugin import compat


def secondary_sources(model: nn.Module) -> list[Any]:
    """The model's further checkpoint sources (``DefaultModelLoader.Source`` objects), if any."""
    return list(getattr(model, "secondary_weights", None) or ())


def checkpoint_files(model: nn.Module, path: str) -> list[str] | None:
    """The files to load where one of the model's hooks narrows the checkpoint at ``path``;
    None where none does (every file of the checkpoint, as discovered)."""
    patterns = getattr(model, "allow_patterns_overrides", None)
    unused = (getattr(model, "is_unused_checkpoint_weight", None)
              if compat.default_loader_skips_unused_shards() else None)
    if patterns is None and unused is None:
        return None
    if is_remote(path):
        if patterns is not None:
            raise CheckpointError(f"{type(model).__name__}.allow_patterns_overrides ({patterns}) names local files; "
                              "fastload cannot apply it to an object-store checkpoint", file=path)
        return None  # its unused shards are not read: the plan reads only what load_weights takes
    if os.path.isfile(path):
        return None
    if patterns is not None:
        files = _first_match(path, list(patterns), type(model).__name__)
        if compat.default_loader_filters_overrides_by_index():
            files = _in_index(path, files)
    else:
        from vllm_fastload.checkpoint import Checkpoint

        ckpt = Checkpoint.discover(path)
        files = sorted(ckpt.files)
        ckpt.close()
    return _without_unused_shards(files, unused) if unused is not None else files


def _first_match(root: str, patterns: list[str], model: str) -> list[str]:
    for pattern in patterns:
        files = sorted(glob.glob(os.path.join(root, pattern)))
        outside = [f for f in files if os.path.relpath(f, root).split(os.sep)[0] == ".."]
        if outside:
            raise OutsideCheckpointError(f"{model}.allow_patterns_overrides ({patterns}) selects a file outside the "
                                         "checkpoint's directory; fastload reads only the checkpoint's own files",
                                         file=outside[0])
        if files:
            other = [f for f in files if not f.endswith(".safetensors")]
            if other:
                raise CheckpointError(f"{model}.allow_patterns_overrides ({patterns}) selects files that are not "
                                  "safetensors; fastload reads safetensors only: load this model without "
                                  "--load-format fastload", file=other[0])
            return files
    raise MissingFileError(f"no file matches {model}.allow_patterns_overrides ({patterns})", file=root)


def _in_index(root: str, files: list[str]) -> list[str]:
    """vLLM's rule before 0.32: an index, where there is one, must name only picked files, and
    picked files it does not name are dropped."""
    index = os.path.join(root, INDEX_NAME)
    if not os.path.isfile(index):
        return files
    with open(index, "rb") as f:
        named = {os.path.join(root, name) for name in parse_weight_map(index, f.read()).values()}
    missing = sorted(named - set(files))
    if missing:
        raise MissingFileError(f"{INDEX_NAME} names a file the model's allow_patterns_overrides does not pick "
                               "(as vLLM's default loader on this release, fastload stops)", file=missing[0])
    return [f for f in files if f in named]


def _without_unused_shards(files: list[str], unused: Callable[[str], bool]) -> list[str]:
    """vLLM's rule: drop the shards whose every tensor is unused, unless that would drop them all."""
    kept = []
    for path in files:
        sf = read_safetensors_file(path)
        try:
            if not all(unused(name) for name in sf.tensors):
                kept.append(path)
        finally:
            sf.close()
    return kept or files
