"""The public API, in safetensors' vocabulary: ``with vllm_fastload.open(path) as ckpt: ...``.

Users read tensors (``get_tensor``, ``iter_tensors``, ``read_into``); an engine adapter loads a
rank through ``read_into`` with its ``ReadHooks`` (docs/design.md, "Writing an engine adapter").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_fastload import policy
from vllm_fastload.buffers import BufferPool
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import InvalidRequestError, StalledReadError
from vllm_fastload.events import LoadProgress, resolve_callback
from vllm_fastload.executor import Delivered, LoadStats, PlanExecutor
from vllm_fastload.format import TensorInfo
from vllm_fastload.plan import LayerGroup, Plan, PlannedTensor, TensorRequest, build_plan, plan_tensor
from vllm_fastload.readers import Reader, make_reader, pagecache
from vllm_fastload.sources import fstype
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

    def __init__(self, ckpt: FastCheckpoint, names: Iterable[RequestLike] | None, dtype: torch.dtype | None) -> None:
        self._ckpt, self._names, self._dtype = ckpt, names, dtype
        self._executor: PlanExecutor | None = None
        self._delivered: Generator[Delivered, None, None] | None = None

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._delivered is None:
            plan = self._ckpt.plan(self._names)
            self._executor = self._ckpt._executor()
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

    def __init__(self, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Checkpoint,
                 device: str | torch.device = "cpu",
                 config: FastloadConfig | Mapping[str, Any] | None = None, *,
                 show_progress: bool | None = None) -> None:
        self.config = FastloadConfig.from_env() if config is None else FastloadConfig.build(config)
        self.device = torch.device(device)
        # A Checkpoint the caller assembled (e.g. TGI's routing, which grows after construction)
        # is used as is; a path is discovered.
        self.checkpoint = path if isinstance(path, Checkpoint) else Checkpoint.discover(
            path, remote=self.config.remote, memory_budget=int(self.config.memory_budget))
        if not self.checkpoint.is_remote and self.checkpoint.files:
            # On a network filesystem some defaults differ (fields the caller set are kept).
            self.config = fstype.tuned(self.config, next(iter(self.checkpoint.files.values())).path)
        self.show_progress = self.config.progress if show_progress is None else show_progress
        for callback in self.config.on_layer_ready:
            resolve_callback(callback)  # a typo in "module:function" fails here, not mid-load
        self._closed = False
        self._decisions = policy.DecisionLog()
        self._reader: Reader | None = None
        self._pool: BufferPool | None = None

    # -- context manager --------------------------------------------------------------------
    def __enter__(self) -> FastCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._pool is not None:
            self._pool.clear()
            self._pool = None
        self.checkpoint.close()

    # -- metadata ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """The checkpoint's tensor names, sorted."""
        return sorted(self.checkpoint.tensors)

    def metadata(self) -> dict[str, str]:
        """The files' ``__metadata__`` entries, merged."""
        merged: dict[str, str] = {}
        for sf in self.checkpoint.files.values():
            merged.update(sf.metadata)
        return merged

    def info(self, name: str) -> TensorInfo:
        """Where a tensor is and what it holds (file, dtype, shape, byte range).

        Raises:
            TensorNotFoundError: no tensor of this name in the checkpoint.
        """
        return self.checkpoint.info(name)

    @property
    def reader(self) -> Reader:
        """The reader backend (made on first use, see ``policy.backend``)."""
        if self._closed:
            raise ValueError(f"checkpoint {self.checkpoint.source} is closed")
        if self._reader is None:
            self._reader = make_reader(self.config, self.device, remote=self.checkpoint.is_remote)
        return self._reader

    def cached_share(self, names: Iterable[str] | None = None) -> float | None:
        """The share of the named tensors' bytes in the page cache, from a sample of
        ``policy.PAGE_SAMPLES`` pages per tensor (no names: of the checkpoint's bytes,
        ``policy.FILE_PAGE_SAMPLES`` per file); None where it cannot be told (objects, or
        ``mincore`` not answering truthfully)."""
        if self.checkpoint.is_remote:
            return None
        spans: list[_Sampled]
        if names is None:
            spans = [_Sampled(f.fd, 0, os.fstat(f.fd).st_size, policy.FILE_PAGE_SAMPLES)
                     for f in self.checkpoint.files.values() if f.fd is not None]
        else:
            infos = [self.checkpoint.info(name) for name in names]
            spans = [_Sampled(self.checkpoint.files[i.file].fd, i.start, i.end, policy.PAGE_SAMPLES) for i in infos]
        return _weighted_cached_share(spans)

    @property
    def strided_min_skip(self) -> int:
        """The ``strided_min_skip`` plans use: configured, else by the source kind
        (``policy.strided_min_skip``)."""
        configured = None if self.config.strided_min_skip is None else int(self.config.strided_min_skip)
        remote = self.checkpoint.is_remote
        value = policy.strided_min_skip(configured=configured, remote=remote,
                                        coalesce_gap=int(self.config.remote.coalesce_gap), backend=self.reader.name)
        self._decisions.note("strided_min_skip", value, configured=configured, remote=remote)
        return value

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
        return build_plan(self.checkpoint, requests, aggregate_size=int(self.config.aggregate_size),
                          strided_min_skip=self.strided_min_skip, dests=dests)

    # -- reading ----------------------------------------------------------------------------
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
                     dtype: torch.dtype | None = None) -> TensorStream:
        """``(key, tensor)`` in layer order through aggregated reads; fires ``on_layer_ready``.

        Args:
            names: tensor names or ``TensorRequest`` slices; None: every tensor.
            dtype: convert floating point tensors to this dtype.

        Returns:
            An iterator of the request's key and a view valid for as long as the caller holds it
            (see the class docstring); its ``stats`` say what the read did.

        Example:
            >>> for name, tensor in ckpt.iter_tensors():
            ...     model.state_dict()[name].copy_(tensor)
        """
        return TensorStream(self, names, dtype)

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
        requests: list[TensorRequest] = []
        by_key: dict[str, torch.Tensor] = {}
        direct: dict[str, torch.Tensor] = {}
        for req, dest in targets.items():
            req = TensorRequest(req) if isinstance(req, str) else req
            planned = plan_tensor(self.checkpoint.info(req.name), req, self.strided_min_skip)
            self._check_destination(planned, dest)
            requests.append(req)
            by_key[req.result_key] = dest
            if self._can_read_directly(planned, dest):
                direct[req.result_key] = dest
        requests += [TensorRequest(r) if isinstance(r, str) else r for r in extra]
        plan = self.plan(requests, dests=direct)
        hooks.check(plan)
        executor = self._executor()
        for delivered in self._execute(executor, plan, layer_events=layer_events, on_layer_end=hooks.on_layer_end):
            planned = delivered.planned
            if planned.dest is not None:
                continue
            target = by_key.get(planned.key)
            if target is not None:
                target.copy_(delivered.tensor)
            else:
                hooks.on_tensor(planned.request, delivered.tensor)
        return executor.stats

    # -- internals --------------------------------------------------------------------------
    def _read_owned(self, request: TensorRequest, dtype: torch.dtype | None) -> torch.Tensor:
        planned = plan_tensor(self.checkpoint.info(request.name), request, self.strided_min_skip)
        native = torch_dtype(planned)
        out = torch.empty(torch_shape(planned), dtype=native, device=self.device)
        if planned.read_bytes:
            # Straight into ``out`` where the reader can; else (enclosing rows on a GPU reader)
            # through a read buffer, narrowed into ``out``. Either way quietly: no bar, no events.
            direct = self._can_read_directly(planned, out)
            plan = build_plan(self.checkpoint, [request], aggregate_size=int(self.config.aggregate_size),
                              strided_min_skip=self.strided_min_skip,
                              dests={request.result_key: out} if direct else None)
            for delivered in self._execute(self._executor(), plan, layer_events=False):
                if not direct:
                    out.copy_(delivered.tensor)
        return cast(out, dtype)

    def _give_up_reader(self) -> None:
        """After a stalled read: the thread stuck in it may still write into a buffer (or a
        destination) one day, so neither the reader nor its buffers are used again; a later read
        gets new ones. The stuck thread is not waited for (see ``readers.threads``)."""
        reader, self._reader, self._pool = self._reader, None, None
        if reader is not None:
            reader.close()

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
        return ((planned.strategy != "enclosing" or self.reader.reads_rows) and dest.dtype == torch_dtype(planned)
                and dest.is_contiguous() and dest.device == self.reader.device)

    def _pool_for(self) -> BufferPool:
        if self._pool is None:
            reader = self.reader
            budget = int(self.config.memory_budget) - reader.staging_bytes
            self._pool = BufferPool(reader.allocate, budget, min_size=int(self.config.aggregate_size))
        return self._pool

    def _executor(self) -> PlanExecutor:
        return PlanExecutor(self.checkpoint, self.reader, self._pool_for(), self.config)

    def _execute(self, executor: PlanExecutor, plan: Plan, *, layer_events: bool = True,
                 on_layer_end: Callable[[LayerGroup], object] | None = None) -> Generator[Delivered, None, None]:
        """Run a plan; without ``layer_events`` (single-tensor reads) no bar and no layer callbacks."""
        progress = None if not layer_events else LoadProgress(
            total_bytes=plan.read_bytes, total_layers=len(plan.groups), callbacks=self.config.on_layer_ready,
            show_bar=self.show_progress, log_layers=self.config.log_layers)
        try:
            yield from executor.run(plan, progress, on_layer_end)
        except StalledReadError:
            self._give_up_reader()
            raise
        finally:
            if progress is not None:
                progress.close()


@dataclass(frozen=True)
class _Sampled:
    """Bytes ``[start, end)`` of the file open as ``fd`` (None: an object), probed at ``samples`` pages."""

    fd: int | None
    start: int
    end: int
    samples: int


def _weighted_cached_share(spans: Iterable[_Sampled]) -> float | None:
    """The page cache's share of the bytes of the spans, each weighted by its length; None where a
    span's share cannot be told."""
    found = weight = 0.0
    for span in spans:
        share = None if span.fd is None else pagecache.cached_share(span.fd, span.start, span.end,
                                                                     samples=span.samples)
        if share is None:
            return None
        found += share * (span.end - span.start)
        weight += span.end - span.start
    return found / weight if weight else None


def open(path: str | os.PathLike[str], device: str | torch.device = "cpu",
         config: FastloadConfig | Mapping[str, Any] | None = None) -> FastCheckpoint:
    """Open a checkpoint: headers parsed and validated, nothing read yet.

    Args:
        path: a directory with an index, a directory of ``*.safetensors`` shards, one file, or the
            same below an object store URI such as ``s3://bucket/prefix``.
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
