"""The public API, in safetensors' vocabulary: ``with vllm_fastload.open(path) as ckpt: ...``.

Users read tensors (``get_tensor``, ``iter_tensors``, ``read_into``); an engine adapter loads a
rank through ``read_into`` with its ``ReadHooks`` (docs/design.md, "Writing an engine adapter").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_fastload import machine, policy
from vllm_fastload.buffers import BufferPool
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import ConfigFacts, FastloadConfig, resolve
from vllm_fastload.errors import InvalidRequestError, StalledReadError
from vllm_fastload.events import LoadProgress, resolve_callback
from vllm_fastload.executor import Delivered, LoadStats, PlanExecutor
from vllm_fastload.format import SafetensorsHeader, TensorInfo
from vllm_fastload.plan import LayerGroup, Plan, PlannedTensor, TensorRequest, build_plan, plan_requests, plan_tensor
from vllm_fastload.readers import Reader, make_reader, pagecache, reader_traits
from vllm_fastload.readers.memory import Prefault
from vllm_fastload.tensors import CASTABLE, cast, torch_dtype, torch_shape

RequestLike = str | TensorRequest
#: Destinations by request: tensor names, ``TensorRequest`` slices, or both.
Targets = Mapping[str, torch.Tensor] | Mapping[TensorRequest, torch.Tensor] | Mapping[RequestLike, torch.Tensor]


class ReadHooks:
    """What an engine adapter does as its read goes (``FastCheckpoint.read_into(..., hooks=)``).

    Override what you need; each default does nothing. They run on the thread that called
    ``read_into``, in this order: ``check`` once, then per layer group ``on_tensor`` for each of its
    ``extra`` requests and ``on_layer_end``, then the group's layer event. What a hook raises stops
    the read, and ``read_into`` raises it.
    """

    def check(self, plan: Plan) -> None:
        """The plan, before a byte is read (an adapter's own checks of what will be read)."""

    def on_tensor(self, request: TensorRequest, tensor: torch.Tensor) -> None:
        """The bytes of one of ``read_into``'s ``extra`` requests, as a view valid during the call
        only (copy what you keep): for what the adapter places itself, such as a tensor the model
        takes in slabs or transposed."""

    def on_layer_end(self, group: LayerGroup) -> None:
        """Every tensor of a layer group delivered, before its layer event fires (to finish its
        parameters, e.g. the row exchange's swap of columns)."""


_NO_HOOKS = ReadHooks()


class TensorStream(Iterator[tuple[str, torch.Tensor]]):
    """What ``iter_tensors`` returns: ``(key, tensor)`` pairs in layer order, and ``stats``, what
    the read did (complete once the stream is exhausted). Nothing is planned or read before the
    first pair is asked for."""

    def __init__(self, ckpt: FastCheckpoint, names: Iterable[RequestLike] | None, dtype: torch.dtype | None,
                 config: FastloadConfig) -> None:
        self._ckpt, self._names, self._dtype, self._config = ckpt, names, dtype, config
        self._executor: PlanExecutor | None = None
        self._delivered: Generator[Delivered, None, None] | None = None

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._delivered is None:
            plan = self._ckpt.plan(self._names)
            self._executor = self._ckpt._executor(self._config)
            self._delivered = self._ckpt._execute(self._executor, plan)
        delivered = next(self._delivered)
        return delivered.planned.key, cast(delivered.tensor, self._dtype)

    @property
    def stats(self) -> LoadStats:
        """What the read did so far."""
        return LoadStats() if self._executor is None else self._executor.stats

    def close(self) -> None:
        """Stop early: reads in flight finish and their buffers go back (as a generator's ``close``)."""
        if self._delivered is not None:
            self._delivered.close()


class FastCheckpoint:
    """An open checkpoint: headers parsed and validated, files held open, nothing read yet.

    What it is, known when it opens: ``files``, ``tensors`` (``keys``, ``info``), ``source``,
    ``is_remote``, ``total_bytes``; the config it reads with (``config``: the caller's, with the
    defaults ``resolve`` gives for this checkpoint), and its reader's traits (``backend``,
    ``strided_min_skip``). No thread starts before the first read.

    Tensor lifetime, precisely:
    - ``get_tensor`` / ``get_slice`` return tensors the caller owns.
    - ``iter_tensors`` yields views into reused read buffers, or (host reader, local files,
      ``map_cached``) views of a private, copy-on-write mapping of the chunk, as safetensors'
      ``safe_open`` gives. A view stays valid for as long as the caller holds it: a buffer is
      reused only once no tensor references it, a mapping is unmapped once none does. Copy what
      you need and drop the view, and memory is recycled; keep the view, and its buffer or
      mapping becomes yours (freed with the view). A buffer view never changes; a mapped view
      changes only where you write into it, unless the file itself is rewritten in place while
      you hold it (it shows the file, like safetensors' tensors; ``check_file_changes`` stops a
      load during which that happens). Views may be non-contiguous when the plan read enclosing
      rows for a dim>0 slice.
    - ``read_into`` fills tensors the caller already owns.
    """

    def __init__(self, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 device: str | torch.device = "cpu",
                 config: FastloadConfig | Mapping[str, Any] | None = None, *,
                 show_progress: bool | None = None, facts: ConfigFacts | None = None) -> None:
        given = FastloadConfig.from_env() if config is None else FastloadConfig.build(config)
        self._checkpoint = Checkpoint.discover(path, remote=given.remote, memory_budget=int(given.memory_budget))
        try:
            # On a network filesystem some defaults differ (fields a user set are kept).
            local = next((f.path for f in self._checkpoint.files.values() if f.is_local), None)
            network = local is not None and machine.is_network(machine.filesystem_type(local))
            self.config = resolve(given, dataclasses.replace(facts or ConfigFacts(), network=network))
            self._traits = reader_traits(self.config, device, remote=self._checkpoint.is_remote)
            for callback in self.config.on_layer_ready:
                resolve_callback(callback)  # a typo in "module:function" fails here, not mid-load
        except BaseException:
            self._checkpoint.close()
            raise
        #: Where it was opened from: the directory, file or URI (the common directory of listed files).
        self.source = self._checkpoint.source
        #: Whether its files are objects in a store.
        self.is_remote = self._checkpoint.is_remote
        #: Whether its files are on a network filesystem (``machine.is_network``).
        self.network = network
        #: Tensor name -> ``TensorInfo``, read-only (it grows with ``add_file``).
        self.tensors: Mapping[str, TensorInfo] = types.MappingProxyType(self._checkpoint.tensors)
        #: The reader backend its reads use (``policy.backend``), and where they land.
        self.backend: policy.Backend = self._traits.backend
        self.device = self._traits.device
        self.show_progress = self.config.progress if show_progress is None else show_progress
        #: The ``strided_min_skip`` plans use: configured, else by the source and backend
        #: (``policy.strided_min_skip``).
        self.strided_min_skip = policy.strided_min_skip(
            configured=None if self.config.strided_min_skip is None else int(self.config.strided_min_skip),
            remote=self._checkpoint.is_remote, coalesce_gap=int(self.config.remote.coalesce_gap),
            backend=self._traits.backend)
        self._closed = False
        self._decisions = policy.DecisionLog()
        self._decisions.note("strided_min_skip", self.strided_min_skip, configured=self.config.strided_min_skip,
                             remote=self._checkpoint.is_remote)
        self._reader: Reader | None = None
        self._pool: BufferPool | None = None

    # -- context manager --------------------------------------------------------------------
    def __enter__(self) -> FastCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._give_up_reader()
        self._checkpoint.close()

    # -- what it is -------------------------------------------------------------------------
    @property
    def files(self) -> tuple[str, ...]:
        """Its files' paths (or objects' URIs)."""
        return tuple(self._checkpoint.files)

    @property
    def total_bytes(self) -> int:
        """The bytes of all its tensors."""
        return self._checkpoint.total_bytes

    def keys(self) -> list[str]:
        """The checkpoint's tensor names, sorted."""
        return sorted(self._checkpoint.tensors)

    def metadata(self) -> dict[str, str]:
        """The files' ``__metadata__`` entries, merged."""
        merged: dict[str, str] = {}
        for sf in self._checkpoint.files.values():
            merged.update(sf.header.metadata)
        return merged

    def info(self, name: str) -> TensorInfo:
        """Where a tensor is and what it holds (file, dtype, shape, byte range).

        Raises:
            TensorNotFoundError: no tensor of this name in the checkpoint.
        """
        return self._checkpoint.info(name)

    def add_file(self, path: str | os.PathLike[str]) -> SafetensorsHeader:
        """Add a local file to the checkpoint (nothing if it is one of its files already), for a
        caller whose set of files grows after opening (TGI adds speculator heads); its header.

        Raises:
            IndexMismatchError: a tensor of the file is in another of the checkpoint's files.
            MissingFileError, HeaderError: the file cannot be read as a safetensors file.
        """
        return self._checkpoint.file_for(os.fspath(path)).header

    @property
    def reader(self) -> Reader:
        """The reader backend (made on first use; its threads start with its first read)."""
        return self._reader_for(self.config)

    def cached_share(self, requests: Iterable[RequestLike] | None = None) -> float | None:
        """The share of the bytes that reading ``requests`` reads (tensor names, or the slices of
        ``TensorRequest``s, as their plan reads them) in the page cache, from a sample of
        ``policy.PAGE_SAMPLES`` pages per request (none: of the checkpoint's bytes,
        ``policy.FILE_PAGE_SAMPLES`` per file); None where it cannot be told (objects, or
        ``mincore`` not answering truthfully)."""
        if self._checkpoint.is_remote:
            return None
        spans: list[_Sampled]
        if requests is None:
            sizes = {f.fd: os.fstat(f.fd).st_size for f in self._checkpoint.files.values() if f.fd is not None}
            spans = [_Sampled.evenly(fd, [(0, size)], policy.FILE_PAGE_SAMPLES, size) for fd, size in sizes.items()]
        else:
            planned = plan_requests(self._checkpoint, requests, self.strided_min_skip)
            spans = [_Sampled.evenly(self._checkpoint.files[t.info.file].fd, t.ranges, policy.PAGE_SAMPLES,
                                     t.read_bytes) for t in planned]
        return _weighted_cached_share(spans)

    def plan(self, requests: Iterable[RequestLike] | None = None, *,
             dests: Mapping[str, torch.Tensor] | None = None) -> Plan:
        """The plan these requests would execute, nothing read.

        Args:
            requests: tensor names or ``TensorRequest`` slices; None: every tensor.
            dests: result key -> the caller's tensor the bytes land in directly (as ``read_into``
                gives them).

        Returns:
            The plan (``plan.summary()`` prints bytes per file and layer, and read amplification).

        Example:
            >>> print(ckpt.plan([TensorRequest("lm_head.weight", dim=0, start=0, length=16000)]).summary())
        """
        requests = self.keys() if requests is None else requests
        planned = plan_requests(self._checkpoint, requests, self.strided_min_skip)
        if dests:
            planned = [dataclasses.replace(t, dest=dests[t.key]) if t.key in dests else t for t in planned]
        return self._grouped(planned)

    # -- reading ----------------------------------------------------------------------------
    def empty(self, request: RequestLike) -> torch.Tensor:
        """An uninitialised tensor of the shape and dtype a read of ``request`` gives, on the
        checkpoint's device: what ``read_into`` fills (the slice is checked against the tensor).

        Raises:
            TensorNotFoundError: no tensor of this name.
            InvalidRequestError: the slice does not fit the tensor.
        """
        request = TensorRequest(request) if isinstance(request, str) else request
        planned = plan_tensor(self._checkpoint.info(request.name), request, self.strided_min_skip)
        return torch.empty(torch_shape(planned), dtype=torch_dtype(planned), device=self.device)

    def get_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, owned by the caller.

        Args:
            name: the tensor's name in the checkpoint.
            dtype: convert floating point tensors to this dtype (others are returned as they are).

        Raises:
            TensorNotFoundError: no tensor of this name.
            ReadError: the read failed.
        """
        return self._read_owned(TensorRequest(name), dtype)

    def get_slice(self, name: str, dim: int = 0, start: int = 0, length: int | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[start, start + length)`` along ``dim`` (to the end if ``length`` is None), owned and contiguous.

        Raises:
            TensorNotFoundError: no tensor of this name.
            InvalidRequestError: the slice does not fit the tensor.
            ReadError: the read failed.

        Example:
            >>> ckpt.get_slice("model.layers.0.self_attn.o_proj.weight", dim=1, start=0, length=2048).shape
            torch.Size([4096, 2048])
        """
        return self._read_owned(TensorRequest(name, dim, start, length), dtype)

    def iter_tensors(self, names: Iterable[RequestLike] | None = None, *,
                     dtype: torch.dtype | None = None, shared_by: int = 1) -> TensorStream:
        """``(key, tensor)`` in layer order through aggregated reads; fires ``on_layer_ready``.

        Args:
            names: tensor names or ``TensorRequest`` slices; None: every tensor.
            dtype: convert floating point tensors to this dtype.
            shared_by: how many processes on this machine read these same tensors (an engine's
                ranks reading every tensor whole): with several, ``direct_io`` 'auto' reads
                through the page cache, so that one disk read serves them all
                (``policy.whole_reads_direct_io``).

        Returns:
            An iterator of the request's key and a view valid for as long as the caller holds it
            (see the class docstring); its ``stats`` say what the read did.

        Example:
            >>> for name, tensor in ckpt.iter_tensors():
            ...     model.state_dict()[name].copy_(tensor)
        """
        config = self.config if shared_by <= 1 else resolve(self.config, ConfigFacts(whole_reads=shared_by))
        self._decisions.note("direct_io for reading every tensor whole", config.direct_io,
                             configured=self.config.direct_io, shared_by=shared_by)
        return TensorStream(self, names, dtype, config)

    def prefault(self, tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
        """Around the caller's own copies into ``tensors`` (an engine's ``load_weights`` copying
        what ``iter_tensors`` yields into its parameters): their fresh pages are faulted in ahead
        of the copies on a background thread, where the reader has more than one CPU
        (``policy.prefault_whole_reads``); no byte changes."""
        cpus = machine.cpu_count(self.config.cpus)
        ahead = policy.prefault_whole_reads(cpus)
        self._decisions.note("parameters faulted in ahead of load_weights", ahead, cpus=cpus)
        return Prefault(tensors, cpus=self.config.cpus) if ahead else contextlib.nullcontext()

    def read_into(self, targets: Targets, *, extra: Iterable[RequestLike] = (), hooks: ReadHooks | None = None,
                  layer_events: bool = True) -> LoadStats:
        """Read each request straight into the caller's tensor, in one pass in layer order.

        Contiguous destinations on the reader's device with the checkpoint's dtype receive the
        bytes directly (no intermediate copy); others are filled from a read buffer with
        ``copy_`` (which also converts the dtype, on the destination's device). Layer events fire
        as in ``iter_tensors``. This is also how an engine adapter loads a rank: its parameters'
        regions as ``targets``, what it places itself as ``extra``, and ``hooks``.

        Args:
            targets: request (a tensor name or a ``TensorRequest``) -> a tensor of the request's
                shape, with its dtype or one it converts to (float16, bfloat16, float32, float64).
            extra: requests read in the same pass and handed to ``hooks.on_tensor``, not stored.
            hooks: what runs as the read goes (``ReadHooks``: a check of the plan, per tensor of
                ``extra``, per layer group).
            layer_events: False: no layer events and no progress bar, for callers that read
                piecemeal and track readiness themselves.

        Returns:
            What the read did (bytes, tensors, chunks).

        Raises:
            TensorNotFoundError: a requested tensor is not in the checkpoint.
            InvalidRequestError: a slice does not fit its tensor, or a destination its request.
            ReadError: the read failed (the error names the file and the tensor).

        Example:
            >>> w = torch.empty(4096, 4096, dtype=torch.bfloat16)
            >>> ckpt.read_into({"model.layers.0.mlp.down_proj.weight": w}).bytes_read
            33554432
        """
        hooks = _NO_HOOKS if hooks is None else hooks
        by_key = {_as_request(req).result_key: dest for req, dest in targets.items()}
        requests = [_as_request(req) for req in targets] + [_as_request(r) for r in extra]
        planned = plan_requests(self._checkpoint, requests, self.strided_min_skip)  # each request once
        for i, t in enumerate(planned[:len(by_key)]):
            dest = by_key[t.key]
            self._check_destination(t, dest)
            if self._can_read_directly(t, dest):
                planned[i] = dataclasses.replace(t, dest=dest)
        plan = self._grouped(planned)
        hooks.check(plan)
        executor = self._executor(self.config)
        for delivered in self._execute(executor, plan, layer_events=layer_events, on_layer_end=hooks.on_layer_end):
            t = delivered.planned
            if t.dest is not None:
                continue
            target = by_key.get(t.key)
            if target is not None:
                target.copy_(delivered.tensor)
            else:
                hooks.on_tensor(t.request, delivered.tensor)
        return executor.stats

    # -- internals --------------------------------------------------------------------------
    def _grouped(self, planned: Sequence[PlannedTensor]) -> Plan:
        return build_plan(planned, aggregate_size=int(self.config.aggregate_size),
                          checkpoint_bytes=self._checkpoint.total_bytes)

    def _read_owned(self, request: TensorRequest, dtype: torch.dtype | None) -> torch.Tensor:
        (planned,) = plan_requests(self._checkpoint, [request], self.strided_min_skip)
        out = torch.empty(torch_shape(planned), dtype=torch_dtype(planned), device=self.device)
        if planned.read_bytes:
            # Straight into ``out`` where the reader can; else (enclosing rows on a GPU reader)
            # through a read buffer, narrowed into ``out``. Either way quietly: no bar, no events.
            direct = self._can_read_directly(planned, out)
            plan = self._grouped([dataclasses.replace(planned, dest=out) if direct else planned])
            for delivered in self._execute(self._executor(self.config), plan, layer_events=False):
                if not direct:
                    out.copy_(delivered.tensor)
        return cast(out, dtype)

    def _reader_for(self, config: FastloadConfig) -> Reader:
        """The reader for ``config`` (this checkpoint's, or a stream's own, see ``iter_tensors``);
        a reader made for another config is closed first."""
        if self._closed:
            raise ValueError(f"checkpoint {self._checkpoint.source} is closed")
        if self._reader is not None and self._reader.config is not config:
            self._give_up_reader()
        if self._reader is None:
            self._reader = make_reader(config, self._traits)
        return self._reader

    def _give_up_reader(self, *, stalled: bool = False) -> None:
        """Close the reader and let go of its buffers (a later read gets new ones). After a
        stalled read the pool is dropped, not cleared: the thread stuck in the read may still
        write into a buffer (or a destination) one day, so nothing is used again. The stuck
        thread is not waited for (see ``readers.threads``)."""
        reader, self._reader, pool, self._pool = self._reader, None, self._pool, None
        if reader is not None:
            reader.close()
        if pool is not None and not stalled:
            pool.clear()

    def _check_destination(self, planned: PlannedTensor, dest: torch.Tensor) -> None:
        shape = torch_shape(planned)
        if tuple(dest.shape) != shape:
            raise InvalidRequestError(f"destination shape {list(dest.shape)} != checkpoint shape {list(shape)}",
                                      file=planned.info.file, tensor=planned.key)
        native = torch_dtype(planned)
        if dest.dtype != native and not (dest.dtype in CASTABLE and native in CASTABLE):
            raise InvalidRequestError(f"destination dtype {dest.dtype} cannot hold checkpoint dtype "
                                      f"{planned.info.dtype} (only float16/bfloat16/float32/float64 convert)",
                                      file=planned.info.file, tensor=planned.key)

    def _can_read_directly(self, planned: PlannedTensor, dest: torch.Tensor) -> bool:
        """Bytes can land in ``dest`` as they are; enclosing rows only with a reader that skips the gaps."""
        return ((planned.strategy != "enclosing" or self._traits.reads_rows) and dest.dtype == torch_dtype(planned)
                and dest.is_contiguous() and dest.device == self._traits.device)

    def _executor(self, config: FastloadConfig) -> PlanExecutor:
        reader = self._reader_for(config)
        if self._pool is None:
            budget = int(config.memory_budget) - reader.staging_bytes
            self._pool = BufferPool(reader.allocate, budget, min_size=int(config.aggregate_size))
        return PlanExecutor(self._checkpoint, reader, self._pool, config)

    def _execute(self, executor: PlanExecutor, plan: Plan, *, layer_events: bool = True,
                 on_layer_end: Callable[[LayerGroup], object] | None = None) -> Generator[Delivered, None, None]:
        """Run a plan; without ``layer_events`` (single-tensor reads) no bar and no layer callbacks."""
        progress = None if not layer_events else LoadProgress(
            total_bytes=plan.read_bytes, total_layers=len(plan.groups), callbacks=self.config.on_layer_ready,
            show_bar=self.show_progress, log_layers=self.config.log_layers)
        try:
            yield from executor.run(plan, progress, on_layer_end)
        except StalledReadError:
            self._give_up_reader(stalled=True)
            raise
        finally:
            if progress is not None:
                progress.close()


def _as_request(request: RequestLike) -> TensorRequest:
    return TensorRequest(request) if isinstance(request, str) else request


@dataclass(frozen=True)
class _Sampled:
    """``nbytes`` bytes of the file open as ``fd`` (None: an object), probed at ``offsets``."""

    fd: int | None
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def evenly(cls, fd: int | None, ranges: Sequence[tuple[int, int]], samples: int, nbytes: int) -> _Sampled:
        """About ``samples`` offsets spread evenly over ``nbytes`` bytes in ``ranges`` (``(offset,
        length)`` each, as a plan reads them: a slice's rows are many), at most one per page."""
        count = len(ranges)
        chosen = ranges if count <= samples else [ranges[i * (count - 1) // (samples - 1)] for i in range(samples)]
        offsets: set[int] = set()
        for offset, length in chosen:
            each = min(-(-samples // len(chosen)), -(-length // pagecache.PAGE))  # at most one per page
            offsets.update(pagecache.spread(offset, length, each))
        return cls(fd, tuple(sorted(offsets)), nbytes)


def _weighted_cached_share(spans: Iterable[_Sampled]) -> float | None:
    """The page cache's share of the bytes of the spans, each weighted by its length; None where a
    span's share cannot be told."""
    found = weight = 0.0
    for span in spans:
        share = None if span.fd is None else pagecache.share_cached(span.fd, span.offsets)
        if share is None:
            return None
        found += share * span.nbytes
        weight += span.nbytes
    return found / weight if weight else None


def open(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], device: str | torch.device = "cpu",
         config: FastloadConfig | Mapping[str, Any] | None = None) -> FastCheckpoint:
    """Open a checkpoint: headers parsed and validated, nothing read yet.

    Args:
        path: a directory with an index, a directory of ``*.safetensors`` shards, one file, the
            same below an object store URI such as ``s3://bucket/prefix``, or a list of local files.
        device: where tensors are read to (``"cpu"`` or a CUDA device).
        config: a ``FastloadConfig`` or a dict of its fields (used as given; ``FASTLOAD_*``
            variables apply only where it is None).

    Returns:
        The open checkpoint (a context manager).

    Raises:
        MissingFileError: the path or a file its index names does not exist.
        HeaderError: a header is unreadable or invalid.
        ConfigError: a config value is unknown or invalid.

    Example:
        >>> with vllm_fastload.open("/models/llama") as ckpt:
        ...     w = ckpt.get_tensor("model.embed_tokens.weight")
    """
    return FastCheckpoint(path, device, config)
