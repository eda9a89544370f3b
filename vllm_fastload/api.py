"""The engine-free API, in safetensors' vocabulary: ``with vllm_fastload.open(path) as ckpt: ...``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vllm_fastload import policy
from vllm_fastload.buffers import BufferPool
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import InvalidRequestError
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
        self.last_stats: LoadStats | None = None

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
        spans: list[tuple[int | None, int, int, int]]
        if names is None:
            spans = [(f.fd, 0, os.fstat(f.fd).st_size, policy.FILE_PAGE_SAMPLES)
                     for f in self.checkpoint.files.values() if f.fd is not None]
        else:
            infos = [self.checkpoint.info(name) for name in names]
            spans = [(self.checkpoint.files[i.file].fd, i.start, i.end, policy.PAGE_SAMPLES) for i in infos]
        return _weighted_cached_share(spans)

    @property
    def on_network_filesystem(self) -> bool:
        """Whether the (local) files are on a network filesystem (``sources.fstype``)."""
        return not self.checkpoint.is_remote and any(
            fstype.is_network(fstype.filesystem_type(path)) for path in self.checkpoint.files)

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
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(key, tensor)`` in layer order through aggregated reads; fires ``on_layer_ready``.

        Args:
            names: tensor names or ``TensorRequest`` slices; None: every tensor.
            dtype: convert floating point tensors to this dtype.

        Yields:
            The request's key and a view valid for as long as the caller holds it (see the
            class docstring).

        Example:
            >>> for name, tensor in ckpt.iter_tensors():
            ...     model.state_dict()[name].copy_(tensor)
        """
        plan = self.plan(names)
        for delivered in self._execute(plan):
            yield delivered.planned.key, cast(delivered.tensor, dtype)

    def read_into(self, targets: Targets) -> LoadStats:
        """Read each request straight into the caller's tensor.

        Contiguous destinations on the reader's device with the checkpoint's dtype receive the
        bytes directly (no intermediate copy); others are filled from a read buffer with
        ``copy_`` (which also converts the dtype, on the destination's device). Layer events fire
        as in ``iter_tensors``.

        Args:
            targets: request (a tensor name or a ``TensorRequest``) -> a tensor of the request's
                shape, with its dtype or one it converts to (float16, bfloat16, float32, float64).

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
        return self._read_into(targets)

    def _read_into(self, targets: Targets, *, extra: Iterable[RequestLike] = (),
                   on_tensor: Callable[[TensorRequest, torch.Tensor], object] | None = None,
                   on_layer_end: Callable[[LayerGroup], object] | None = None,
                   check: Callable[[Plan], object] | None = None, quiet: bool = False) -> LoadStats:
        """``read_into`` with the hooks an engine adapter needs (the vLLM loader, TGI's patch).

        Requests in ``extra`` are read in the same pass and handed to ``on_tensor(request, tensor)`` as
        views (valid during the call). ``on_layer_end(group)`` runs once a layer's tensors are all
        delivered, before its layer event (e.g. to finish filling its parameters, see
        ``exchange``). ``check(plan)`` runs on the plan before anything is read; what it raises
        stops the read. ``quiet``: no layer events and no bar (for callers that read piecemeal and
        track readiness themselves).
        """
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
        if check is not None:
            check(plan)
        for delivered in self._execute(plan, quiet=quiet, on_layer_end=on_layer_end):
            planned = delivered.planned
            if planned.dest is not None:
                continue
            target = by_key.get(planned.key)
            if target is not None:
                target.copy_(delivered.tensor)
            elif on_tensor is not None:
                on_tensor(planned.request, delivered.tensor)
        assert self.last_stats is not None  # set when the execution ends
        return self.last_stats

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
            for delivered in self._execute(plan, quiet=True):
                if not direct:
                    out.copy_(delivered.tensor)
        return cast(out, dtype)

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

    def _execute(self, plan: Plan, *, quiet: bool = False,
                 on_layer_end: Callable[[LayerGroup], object] | None = None) -> Iterator[Delivered]:
        """Run a plan; ``quiet`` (single-tensor reads) skips the bar and the layer callbacks."""
        progress = None if quiet else LoadProgress(
            total_bytes=plan.read_bytes, total_layers=len(plan.groups), callbacks=self.config.on_layer_ready,
            show_bar=self.show_progress, log_layers=self.config.log_layers)
        executor = PlanExecutor(self.checkpoint, self.reader, self._pool_for(), self.config)
        try:
            yield from executor.run(plan, progress, on_layer_end)
        finally:
            if progress is not None:
                progress.close()
            self.last_stats = executor.stats


def _weighted_cached_share(spans: Iterable[tuple[int | None, int, int, int]]) -> float | None:
    """The page cache's share of the bytes of ``(descriptor, start, end, samples)`` spans, each
    weighted by its length; None where a span's share cannot be told."""
    found = weight = 0.0
    for fd, start, end, samples in spans:
        share = None if fd is None else pagecache.cached_share(fd, start, end, samples=samples)
        if share is None:
            return None
        found += share * (end - start)
        weight += end - start
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
