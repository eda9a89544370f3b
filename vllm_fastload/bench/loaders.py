"""Every loader the benchmarks measure, by one name each: how each engine starts it and where it runs.

A name is the one vLLM's own option suggests: ``safetensors`` for the engine's default loader
(``--load-format safetensors``), ``safetensors-prefetch`` for it with ``--safetensors-load-strategy
prefetch``, ``fastload-cuda`` for fastload with ``backend: cuda``. The vLLM, SGLang, GPU and
multi-node benchmarks take their loaders from this one table, so a name means one thing in every
table, JSON document and ``--loaders`` list.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["ENGINES", "LOADERS", "RENAMED", "Loader", "check_known", "runs_on", "why_not"]

#: The engines a loader may run under; ``library``: bench-gpu's calls of the library itself.
ENGINES = ("vllm", "sglang", "library")


def _frozen(**items: Any) -> Mapping[str, Any]:
    return MappingProxyType(items)


@dataclass(frozen=True)
class Loader:
    """One loader: its name, how each engine is told to use it, and what it needs."""

    name: str
    #: vLLM's ``--load-format``; None: not a vLLM loader.
    vllm_format: str | None = None
    #: Its options: vLLM's ``--model-loader-extra-config``, and fastload's config in bench-gpu.
    config: Mapping[str, Any] = field(default_factory=_frozen)
    #: Other ``LLM(...)`` arguments that select it under vLLM.
    vllm_args: Mapping[str, Any] = field(default_factory=_frozen)
    #: SGLang's arguments that select it; None: not an SGLang loader.
    sglang_args: tuple[str, ...] | None = None
    #: bench-gpu calls it directly, without an engine.
    library: bool = False
    #: Runs only where there is a CUDA device.
    cuda_only: bool = False
    #: The module it needs installed, if any.
    needs: str | None = None
    #: Given a Hugging Face Hub id rather than a directory (``bench --model org/name``).
    hub_id: bool = False
    #: Reads a local copy downloaded from the object store right before the start (``--source s3``).
    download: bool = False
    #: Reads no file: a floor the other rows are compared with.
    reference: bool = False

    def engines(self) -> tuple[str, ...]:
        return tuple(e for e, runs in zip(ENGINES, (self.vllm_format is not None, self.sglang_args is not None,
                                                    self.library)) if runs)


_FASTLOAD = "fastload"
_SAFETENSORS = "safetensors"
#: In the order the vLLM benchmark's rows come in.
_TABLE = (
    Loader("fastload", _FASTLOAD, sglang_args=("--load-format", "fastload")),
    Loader("fastload-buffered", _FASTLOAD, _frozen(direct_io="never")),
    # Each rank reads its own columns of row-parallel weights, or shares the reads of whole rows
    # (by default: object stores, and local disks that are cold as the load begins); both without
    # early reads, so that a cold start is still cold when the load begins.
    Loader("fastload-no-exchange", _FASTLOAD, _frozen(row_exchange="never", early_reads="never")),
    Loader("fastload-exchange", _FASTLOAD, _frozen(row_exchange="always", early_reads="never")),
    # Data parallelism with expert parallelism: every replica reads what they hold alike itself.
    Loader("fastload-no-dp-exchange", _FASTLOAD, _frozen(dp_exchange="never")),
    # The path through the model's load_weights (whole tensors from iter_tensors), which fastload
    # takes where its probe cannot describe a model's loading.
    Loader("fastload-whole", _FASTLOAD, _frozen(plan_per_rank=False)),
    # vLLM's post-processing per decoder layer during the read (opt-in); without early reads, so that
    # a cold load reads while it post-processes (compare with fastload-no-early).
    Loader("fastload-post-per-layer", _FASTLOAD, _frozen(post_per_layer=True, early_reads="never")),
    # Early reads (the checkpoint read into the page cache from the moment vLLM has its config):
    # on every filesystem, and never.
    Loader("fastload-early", _FASTLOAD, _frozen(early_reads="always")),
    Loader("fastload-no-early", _FASTLOAD, _frozen(early_reads="never"),
           sglang_args=("--load-format", "fastload", "--model-loader-extra-config", '{"early_reads": "never"}')),
    # The reader on one thread: copies and the destinations' faults in one thread, none ahead.
    Loader("fastload-one-thread", _FASTLOAD, _frozen(threads=1)),
    # The engine's default loader: vLLM's --load-format safetensors, SGLang's auto; bench-gpu's
    # safetensors.safe_open and a copy.
    Loader(_SAFETENSORS, _SAFETENSORS, sglang_args=("--load-format", "auto"), library=True),
    Loader("safetensors-mt", _SAFETENSORS, _frozen(enable_multithread_load=True, num_threads=8)),
    Loader("safetensors-prefetch", _SAFETENSORS, vllm_args=_frozen(safetensors_load_strategy="prefetch")),
    Loader("runai_streamer", "runai_streamer", needs="runai_model_streamer"),
    # vLLM 0.32 reads ``distributed`` only on CUDA/ROCm (each rank fetches part of every file and
    # broadcasts it over the device interconnect).
    Loader("runai_streamer-distributed", "runai_streamer", _frozen(distributed=True), cuda_only=True,
           needs="runai_model_streamer"),
    # The default loader on a local copy, downloaded right before the start (its time is added to
    # load_weights): what users of an object store do without a loader that reads it.
    Loader("safetensors+download", _SAFETENSORS, needs="obstore", download=True),
    # Writes zeros into every parameter: the floor, the cost of touching fresh parameter memory.
    Loader("zerofill", "zerofill", reference=True),
    # Copies into every parameter from a buffer already in memory: the floor for a loader that must
    # deliver the bytes.
    Loader("memcopy", "memcopy", reference=True),
    Loader("fastsafetensors", "fastsafetensors", library=True, cuda_only=True, needs="fastsafetensors"),
    Loader("instanttensor", "instanttensor", library=True, cuda_only=True, needs="instanttensor"),
    # --model org/name: the same loaders given the Hub id (the rows without the suffix get its
    # cached snapshot as a directory).
    Loader("fastload-hub-id", _FASTLOAD, hub_id=True),
    Loader("safetensors-hub-id", _SAFETENSORS, hub_id=True),
    # fastload's backends by name (``backend: auto`` picks one of them).
    Loader("fastload-cuda", _FASTLOAD, _frozen(backend="cuda"), library=True, cuda_only=True),
    Loader("fastload-kvikio", _FASTLOAD, _frozen(backend="kvikio"), library=True, cuda_only=True),
    Loader("fastload-host", _FASTLOAD, _frozen(backend="host"), library=True),
    # SGLang's default loader with its own cold-start aid: it stages the checkpoint's files while
    # CUDA graphs are captured (SGLang refuses it without them: not on a CPU).
    Loader("safetensors-overlap", sglang_args=("--load-format", "auto", "--startup-weight-load-mode", "overlap")),
)
LOADERS: Mapping[str, Loader] = MappingProxyType({loader.name: loader for loader in _TABLE})
#: Other names a saved run or a user may give a loader -> the table's (``bench --report`` translates
#: a saved run's rows; ``--loaders`` answers with the table's name).
RENAMED: Mapping[str, str] = MappingProxyType({
    "zerofill (floor)": "zerofill", "memcopy (copy floor)": "memcopy", "default": "safetensors",
    "default-prefetch": "safetensors-prefetch", "default+overlap": "safetensors-overlap"})


def runs_on(engine: str) -> tuple[str, ...]:
    """The names of the loaders ``engine`` (one of ``ENGINES``) runs, in the table's order."""
    return tuple(name for name, loader in LOADERS.items() if engine in loader.engines())


def check_known(wanted: Iterable[str], engine: str, what: str = "") -> None:
    """End the command where ``wanted`` names a loader that ``engine`` does not run (``what``: for
    which command), naming the known ones and the new name of an old one."""
    known = runs_on(engine)
    unknown = [name for name in wanted if name not in known]
    if unknown:
        renamed = [f"{name} is now {RENAMED[name]}" for name in unknown if name in RENAMED]
        raise SystemExit(f"unknown loader(s) {', '.join(unknown)}{what}; known: {', '.join(known)}"
                         + (f" ({'; '.join(renamed)})" if renamed else ""))


def why_not(loader: Loader, cuda: bool) -> str | None:
    """Why ``loader`` cannot run here (``cuda``: whether there is a CUDA device), or None."""
    if loader.cuda_only and not cuda:
        return "CUDA only: not run without a GPU"
    if loader.needs is not None and importlib.util.find_spec(loader.needs) is None:
        return f"package {loader.needs} not installed"
    return None
