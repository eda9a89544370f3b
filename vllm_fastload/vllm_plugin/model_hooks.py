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

import vllm_fastload
from vllm_fastload import CheckpointError, MissingFileError, OutsideCheckpointError, is_remote
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
        with vllm_fastload.open(path) as ckpt:
            files = sorted(ckpt.files)
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
    weight_map = vllm_fastload.read_index(root)
    if weight_map is None:
        return files
    named = {os.path.join(root, name) for name in weight_map.values()}
    missing = sorted(named - set(files))
    if missing:
        raise MissingFileError("model.safetensors.index.json names a file the model's allow_patterns_overrides does "
                               "not pick (as vLLM's default loader on this release, fastload stops)", file=missing[0])
    return [f for f in files if f in named]


def _without_unused_shards(files: list[str], unused: Callable[[str], bool]) -> list[str]:
    """vLLM's rule: drop the shards whose every tensor is unused, unless that would drop them all."""
    kept = [path for path in files if not all(unused(name) for name in vllm_fastload.read_header(path).tensors)]
    return kept or files
