"""Learn where every checkpoint byte goes by running the model's own ``load_weights`` on placeholders.

We feed ``model.load_weights`` a meta-device placeholder (right name, shape and dtype, no
data) for every checkpoint tensor, under a ``TorchFunctionMode`` that intercepts the writes
into parameters. A meta view keeps its storage offset and strides, so each intercepted
``copy_`` says exactly which region of which checkpoint tensor lands in which region of which
parameter on *this* rank: the engine's own code (vLLM's, SGLang's) did the renaming, stacking, TP/PP/EP slicing,
kv-head replication and vocab padding, and we re-implemented none of it.

Anything the probe cannot describe as "copy a view of one checkpoint tensor into a view of a
parameter" (arithmetic on weights, ``param.data = ...``, a loader that looks at values, meta
tensors left behind) makes ``ProbeResult.unsupported`` non-empty; the loader then reads every
tensor in full and calls ``load_weights`` for real, exactly like the engine's default loader.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from vllm_fastload.model.geometry import Geometry, SlabView, affine
from vllm_fastload.sizes import contiguous_strides

#: What a default loader calls with ``(checkpoint name, tensor)`` pairs to fill the model: its
#: ``load_weights`` or an engine's wrapper of it; returns the parameter names loaded, if it says.
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], "Iterable[str] | None"]


@dataclass(frozen=True)
class Narrow:
    """``tensor.narrow(dim, start, length)``; ``dim`` None: the whole tensor (``length`` its rows)."""

    dim: int | None
    start: int
    length: int


@dataclass(frozen=True, eq=False)  # identity: it holds a tensor (no elementwise ==)
class Placement:
    """One write the model's loader made: a view of checkpoint tensor ``source`` into ``dest``."""

    source: str
    dest: torch.Tensor              # a real view into parameter (or buffer) memory
    parameter: str
    src_shape: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int                 # in elements, from the start of the checkpoint tensor
    #: The source was derived from the checkpoint tensor by copying shape ops (reshape of a
    #: transpose, cat of narrows...): the strided view above lists its elements in the
    #: destination's row-major order, and is reshaped to the destination's shape.
    reshape: bool = False

    def narrow(self, tensor_shape: tuple[int, ...]) -> Narrow | None:
        """The narrow of the tensor this write takes, unchanged, into a region of its shape (the
        whole tensor: dim None); else None (read as a slab and replayed)."""
        shape, stride, offset = self.src_shape, self.src_stride, self.src_offset
        full = contiguous_strides(tensor_shape)
        if tuple(self.dest.shape) != shape or self.reshape:
            return None  # broadcasting copy, or a derived source: replayed
        if shape == tensor_shape and offset == 0 and _same_strides(shape, stride, full):
            return Narrow(None, 0, tensor_shape[0] if tensor_shape else 1)
        if len(shape) != len(tensor_shape) or not _same_strides(shape, stride, full):
            return None
        differing = [d for d in range(len(shape)) if shape[d] != tensor_shape[d]]
        if len(differing) != 1:
            return None
        d = differing[0]
        if full[d] == 0 or offset % full[d]:
            return None
        start = offset // full[d]
        if start + shape[d] > tensor_shape[d]:
            return None
        return Narrow(d, start, shape[d])

    @property
    def view(self) -> Geometry:
        """The write's source as a strided view of its checkpoint tensor."""
        return Geometry(self.src_shape, self.src_stride, self.src_offset)

    def replay(self, slab: torch.Tensor, view: SlabView) -> None:
        """Perform this write from what was read of its checkpoint tensor: ``slab`` (the whole
        tensor or a slab of it, in the layout the reader gave it) and this write's ``view`` of it
        (``geometry.plan_slabs``). Raises ``geometry.LayoutError`` if the slab is not the one planned."""
        src = view.on(slab)
        if self.reshape:
            src = src.reshape(self.dest.shape)
        self.dest.copy_(src)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe learnt of the model's loading on this rank."""

    #: checkpoint tensor -> the writes its data made, in order.
    placements: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    #: What the model's ``load_weights`` said it loaded (None: it says nothing).
    loaded_params: frozenset[str] | None = None
    #: Why the probe cannot describe the loading (empty: it can).
    unsupported: tuple[str, ...] = ()
    #: parameter -> elements written (copies and fills); writes never overlap (checked).
    covered: Mapping[str, int] = field(default_factory=dict)
    numel: Mapping[str, int] = field(default_factory=dict)
    #: The model's parameters (one name per distinct memory, as indexed), buffers left out.
    parameters: frozenset[str] = frozenset()

    def never_written(self) -> list[str]:
        """Parameters no write of the checkpoint reached: for an engine whose default loader does
        not check that every parameter came from the checkpoint (SGLang's)."""
        return sorted(p for p in self.parameters if p not in self.covered)

    def partly_written(self) -> dict[str, list[str]]:
        """Parameters the checkpoint fills only in part -> the checkpoint tensors that did reach them."""
        sources: dict[str, list[str]] = {}
        for name, placements in self.placements.items():
            for p in placements:
                sources.setdefault(p.parameter, []).append(name)
        return {param: sorted(set(sources.get(param, [])))
                for param, n in self.covered.items() if n < self.numel.get(param, n)}


def _same_strides(shape: tuple[int, ...], stride: tuple[int, ...], full: tuple[int, ...]) -> bool:
    # Strides of size-1 dims carry no meaning.
    return all(s == f or n == 1 for n, s, f in zip(shape, stride, full))


class _MemoryIndex:
    """Which named parameter or buffer a real tensor's memory belongs to."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: Names of the model's meta tensors (parameters, buffers, plain attributes) when indexed.
        self.meta: list[str] = []
        self._index()

    def _index(self) -> None:
        found = _tensors_of(self.model)
        parameters, buffers, self.meta = found.parameters, found.buffers, found.meta
        spans = []
        seen = set()
        self.numel: dict[str, int] = {}
        self.parameters: set[str] = set()
        for i, (name, t) in enumerate([*parameters, *buffers]):
            if t.is_meta or t.numel() == 0 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            self.numel[name] = t.numel()
            if i < len(parameters):
                self.parameters.add(name)
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
        spans.sort()
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._first = {name: lo for lo, _, name in spans}

    def owner(self, t: torch.Tensor, refresh: bool = False) -> str | None:
        """``refresh``: look again at the model when not found, for parameters registered inside
        ``load_weights`` (the Transformers backend adds an lm_head bias only when it sees one)."""
        if t.is_meta or t.numel() == 0:
            return None
        found = self._lookup(t.data_ptr())
        if found is None and refresh:
            self._index()
            found = self._lookup(t.data_ptr())
        return found

    def start(self, name: str) -> int:
        """The first byte of the parameter or buffer ``name`` (as indexed)."""
        return self._first[name]

    def _lookup(self, ptr: int) -> str | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._spans[i][1]:
            return self._spans[i][2]
        return None


def _span(t: torch.Tensor) -> tuple[int, int]:
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


@dataclass(frozen=True)
class _GridBox:
    """A tensor's elements as a box in the grid its strides draw over memory."""

    strides: tuple[int, ...]                # in bytes, per dim (dims of size 1 left out)
    ranges: tuple[tuple[int, int], ...]     # per dim: [start, stop) coordinates


def _box(t: torch.Tensor, origin: int) -> _GridBox | None:
    """``t``'s elements as a box in the grid its strides draw over memory from ``origin`` (the
    parameter's first byte), or None where it is not one (strides not nested, a row that wraps).

    A fused parameter stored transposed (GPTQ's ``qweight`` is (in, out)) takes its shards as
    column blocks: their byte spans interleave, yet as boxes they are disjoint.
    """
    dims = [(n, s * t.element_size()) for n, s in zip(t.shape, t.stride()) if n != 1]
    if not dims or dims[-1][1] != t.element_size():
        return None
    strides = tuple(s for _, s in dims)
    if any(s <= 0 for s in strides) or any(outer % inner for outer, inner in itertools.pairwise(strides)):
        return None
    rest, box = t.data_ptr() - origin, []
    for i, (n, stride) in enumerate(dims):
        start, rest = divmod(rest, stride)
        if i and start + n > strides[i - 1] // stride:
            return None  # crosses into the next row of the dim above: not a box
        box.append((start, start + n))
    if rest:
        return None  # not on an element boundary of the grid (torch keeps views aligned; be sure)
    return _GridBox(strides, tuple(box))


@dataclass(frozen=True)
class _Region:
    """Where one write lands in its parameter, worked out once per write: its byte span, its box
    (see ``_box``) and what makes two writes "the same region" (address, dtype, shape, strides)."""

    span: tuple[int, int]
    box: _GridBox | None
    key: tuple[object, ...]

    @classmethod
    def of(cls, t: torch.Tensor, origin: int) -> _Region:
        return cls(_span(t), _box(t, origin), (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())))

    def overlaps(self, other: _Region) -> bool:
        """Exact for boxes in one grid, else judged by the byte spans (which may say yes for
        interleaved regions, never no for shared ones)."""
        (lo, hi), (other_lo, other_hi) = self.span, other.span
        if not (lo < other_hi and other_lo < hi):
            return False
        if self.box is None or other.box is None or self.box.strides != other.box.strides:
            return True
        return all(lo_a < hi_b and lo_b < hi_a
                   for (lo_a, hi_a), (lo_b, hi_b) in zip(self.box.ranges, other.box.ranges))


#: Torch functions whose every output element is a copy of one input element chosen by shapes and
#: arguments only, never by values: their results are still "bytes from one tensor".
_MOVES = frozenset({
    "view", "reshape", "transpose", "permute", "t", "contiguous", "clone", "flatten", "unflatten", "narrow",
    "select", "__getitem__", "squeeze", "unsqueeze", "movedim", "moveaxis", "swapaxes", "swapdims", "expand",
    "expand_as", "view_as", "reshape_as", "chunk", "split", "unbind", "tensor_split", "cat", "concat",
    "concatenate", "stack", "T", "mT",
})
#: In-place ops that change a tensor's metadata or autograd state, not its values.
_METADATA_ONLY = frozenset({
    "requires_grad_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapaxes_", "swapdims_",
    "retain_grad", "share_memory_",
})


@dataclass
class _Derived:
    """A meta tensor with its own storage made by a ``_MOVES`` op from data of one checkpoint tensor."""

    source: str
    out: torch.Tensor   # kept alive so its storage id is never reused
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    signature: tuple[object, ...]


def _is_meta(obj: object) -> bool:
    """Whether ``obj`` is a meta tensor (a placeholder, or made from one)."""
    return isinstance(obj, torch.Tensor) and obj.is_meta


def _mutates(name: str) -> bool:
    """Whether the torch function ``name`` changes its first argument's values in place."""
    return name.endswith("_") and not name.startswith("__") and name not in _METADATA_ONLY


def _tensors_in(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def _leaves(obj: object, signature: Callable[[torch.Tensor], object]) -> tuple[object, ...] | str:
    """A hashable description of an op's arguments (slices are not hashable before Python 3.12)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", signature(obj))
    if isinstance(obj, (list, tuple)):
        return tuple(_leaves(x, signature) for x in obj)
    if isinstance(obj, dict):
        return tuple((k, _leaves(v, signature)) for k, v in sorted(obj.items()))
    return repr(obj)


def _replace(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each tensor in it (in lists, tuples and dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _replace(v, fn) for k, v in obj.items()}
    return obj


class _Recorder(TorchFunctionMode):
    """Records the writes of the model's loading while it runs: what becomes the ``ProbeResult``."""

    def __init__(self, placeholders: Mapping[str, torch.Tensor], memory: _MemoryIndex) -> None:
        super().__init__()
        #: meta storage id -> checkpoint name, and -> the tensor's shape
        self.placeholders = {ph.untyped_storage()._cdata: name for name, ph in placeholders.items()}
        self.shapes = {ph.untyped_storage()._cdata: tuple(ph.shape) for ph in placeholders.values()}
        self.derived: dict[int, _Derived] = {}
        #: (signature, view, destination shape) -> the write's view of its checkpoint tensor: every
        #: layer repeats the same derivation, so the index arithmetic runs once per distinct one.
        self.views: dict[tuple[object, ...], Geometry | None] = {}
        self.memory = memory
        self.placements: dict[str, list[Placement]] = {}
        self.unsupported: list[str] = []
        self.covered: dict[str, int] = {}
        #: parameter -> [(region written, the copy that wrote it or None for a fill)]
        self.written: dict[str, list[tuple[_Region, Placement | None]]] = {}
        #: meta storages a loader changed in place (``loaded_weight.zero_()``): their values are no
        #: longer the checkpoint's, so a copy of them is computed, not a placement.
        self.mutated: set[int] = set()

    def _source(self, t: torch.Tensor) -> str | None:
        key = t.untyped_storage()._cdata
        if key in self.mutated:
            return None
        name = self.placeholders.get(key)
        if name is None and key in self.derived:
            name = self.derived[key].source
        return name

    def _signature(self, t: torch.Tensor) -> tuple[object, ...] | None:
        key = t.untyped_storage()._cdata
        if key in self.placeholders:
            base: tuple[object, ...] = ("checkpoint", self.shapes[key])
        elif key in self.derived:
            base = self.derived[key].signature
        else:
            return None
        return base, tuple(t.shape), tuple(t.stride()), t.storage_offset()

    def _derive(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> None:
        """Remember how ``out`` (a new meta storage) was made from one checkpoint tensor."""
        if not isinstance(out, torch.Tensor) or not out.is_meta:
            return
        key = out.untyped_storage()._cdata
        if key in self.placeholders or key in self.derived:
            return  # a view: found through its storage already
        inputs = [t for t in _tensors_in((args, kwargs)) if t.is_meta]
        sources = {self._source(t) for t in inputs}
        source = sources.pop() if len(sources) == 1 else None
        if not inputs or source is None:
            return  # not from one checkpoint tensor: a copy of it is "computed", and refused later
        if any(not t.is_meta for t in _tensors_in((args, kwargs))):
            signature: tuple[object, ...] = ("indexed by a real tensor", object())  # never shares a cached result
        else:
            signature = (getattr(func, "__name__", repr(func)), _leaves((args, kwargs), self._signature))
        self.derived[key] = _Derived(source, out, func, args, kwargs, signature)

    def _positions(self, t: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
        """For each element of meta tensor ``t``: its flat position in its checkpoint tensor, computed
        by running the recorded ops on position tensors instead of data."""
        key = t.untyped_storage()._cdata
        base = memo.get(key)
        if base is None:
            if key in self.placeholders:
                base = torch.arange(math.prod(self.shapes[key]), dtype=torch.int64)
            else:
                d = self.derived[key]
                out = d.func(*_replace(d.args, lambda x: self._positions(x, memo) if x.is_meta else x),
                             **_replace(d.kwargs, lambda x: self._positions(x, memo) if x.is_meta else x))
                n = d.out.untyped_storage().nbytes() // d.out.element_size()
                base = torch.full((n,), -1, dtype=torch.int64)
                base.as_strided(d.out.shape, d.out.stride(), d.out.storage_offset()).copy_(out)
            memo[key] = base
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def _derived_view(self, dest: torch.Tensor, src: torch.Tensor) -> Geometry | None:
        cache_key = (self._signature(src), tuple(dest.shape))
        if cache_key not in self.views:
            try:
                positions = torch.broadcast_to(self._positions(src, {}), dest.shape)
                self.views[cache_key] = affine(positions)
            except Exception:  # an op that cannot run on positions: not understood, so not planned
                self.views[cache_key] = None
        return self.views[cache_key]

    def _record(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        name = self._source(src)
        owner = self.memory.owner(dest, refresh=True)
        if name is None:
            self.unsupported.append(
                f"a tensor computed from checkpoint data (not a view of one tensor) is copied into "
                f"{owner or 'a non-parameter tensor'}")
            return
        if owner is None:
            self.unsupported.append(f"{name} is copied into a tensor that is not a model parameter")
            return
        if src.untyped_storage()._cdata in self.derived:
            view = self._derived_view(dest, src)
            if view is None:
                self.unsupported.append(
                    f"{name} reaches {owner} through a reshaping the probe cannot describe as a strided view")
                return
            placement = Placement(name, dest, owner, view.shape, view.strides, view.offset, reshape=True)
        else:
            placement = Placement(name, dest, owner, tuple(src.shape), tuple(src.stride()), int(src.storage_offset()))
        if not self._claim(owner, dest, f"{owner} is written twice in overlapping regions (last: {name})",
                           placement):
            return
        self.placements.setdefault(name, []).append(placement)

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and args[1].is_meta and not args[0].is_meta:
            self._record(args[0], args[1])
            return args[0]
        if func is torch.Tensor.__setitem__ and _is_meta(args[2]) and not args[0].is_meta:
            self._record(args[0][args[1]], args[2])
            return None
        name = getattr(func, "__name__", "")
        if _mutates(name) and args and _is_meta(args[0]):
            self.mutated.add(args[0].untyped_storage()._cdata)  # checkpoint data changed before its copy
            return func(*args, **kwargs)
        if name in _MOVES:
            out = func(*args, **kwargs)
            self._derive(func, args, kwargs, out)
            return out
        if name == "__set__" and any(_is_meta(a) for a in args[1:]):
            self.unsupported.append("a weight loader replaces a parameter's .data")
            return None
        if name.endswith("_") and not name.startswith("__") and args and isinstance(args[0], torch.Tensor) \
                and not args[0].is_meta and (owner := self.memory.owner(args[0])) is not None:
            return self._in_place(func, name, owner, args, kwargs)
        if name == "__setitem__" and isinstance(args[0], torch.Tensor):
            self._item_assignment(args)
        return func(*args, **kwargs)

    def _in_place(self, func: Callable[..., Any], name: str, owner: str, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        """An in-place op on the model's tensor ``owner``: refused where it uses checkpoint data or
        changes it after its copy; a fill is a write that a checkpoint copy may not overlap."""
        if any(_is_meta(a) for a in args[1:]):
            self.unsupported.append(f"in-place {name} on {owner} uses checkpoint data")
            return args[0]
        source = self._checkpoint_holder((args[1:], kwargs))
        if source is not None:
            # Computed from what the checkpoint put in another tensor (Gemma's norm buffer =
            # weight + 1): the placeholders never put those values there, so no replay would.
            self.unsupported.append(f"{owner} is computed by {name} from the checkpoint data copied into "
                                           f"{source} (a derived tensor)")
        elif name in ("fill_", "zero_", "copy_"):
            # Known values written here now, and kept: a checkpoint copy may not overlap them.
            self._claim(owner, args[0], f"{owner} is overwritten by {name} after checkpoint data was copied "
                                        "into it (a loader that transforms what it loaded)")
        elif _mutates(name) and self._holds_checkpoint_data(owner, args[0]):
            self.unsupported.append(
                f"in-place {name} on {owner} changes checkpoint data after its copy (a computed weight)")
        return func(*args, **kwargs)

    def _item_assignment(self, args: tuple[Any, ...]) -> None:
        """``tensor[index] = value``: on a placeholder it changes checkpoint data before its copy; on
        a model tensor it writes known values a checkpoint copy may not overlap."""
        if args[0].is_meta:
            self.mutated.add(args[0].untyped_storage()._cdata)
        elif (owner := self.memory.owner(args[0])) is not None:
            self._claim(owner, args[0][args[1]], f"{owner} is overwritten by item assignment after checkpoint "
                                                 "data was copied into it")

    def _checkpoint_holder(self, objs: object) -> str | None:
        """The model tensor among ``objs`` (real tensors) whose region holds checkpoint data, if any."""
        for t in _tensors_in(objs):
            if t.is_meta:
                continue
            owner = self.memory.owner(t)
            if owner is not None and self._holds_checkpoint_data(owner, t):
                return owner
        return None

    def _holds_checkpoint_data(self, owner: str, dest: torch.Tensor) -> bool:
        region = _Region.of(dest, self.memory.start(owner))
        return any(p is not None and region.overlaps(r) for r, p in self.written.get(owner, []))

    def _claim(self, owner: str, dest: torch.Tensor, overlap_reason: str,
               placement: Placement | None = None) -> bool:
        """Record that ``dest`` (in parameter ``owner``) is written. Our reads do not keep the
        loader's write order, so an overlap makes the probe give up, with one exception that is
        still exact: a copy into exactly the region (same address, shape and strides) an earlier
        copy wrote replaces it, as the last write wins in the loader too (quantized layers write
        a fused parameter's ``weight_shape`` once per shard)."""
        region = _Region.of(dest, self.memory.start(owner))
        entries = self.written.setdefault(owner, [])
        for k, (other, earlier) in enumerate(entries):
            if region.overlaps(other):
                if placement is not None and earlier is not None and other.key == region.key:
                    self.placements[earlier.source].remove(earlier)
                    if not self.placements[earlier.source]:
                        del self.placements[earlier.source]
                    entries[k] = (region, placement)
                    return True
                self.unsupported.append(overlap_reason)
                return False
        entries.append((region, placement))
        self.covered[owner] = self.covered.get(owner, 0) + dest.numel()
        return True


def probe_model(model: nn.Module, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                load_weights: LoadWeights | None = None) -> ProbeResult:
    """Run ``model.load_weights`` (or the engine's ``load_weights`` wrapper) over placeholders for
    ``tensors`` (name -> (shape, dtype))."""
    memory = _MemoryIndex(model)
    meta_before = set(memory.meta)
    # Made before the recorder starts, so that it sees only the model's own torch calls; alive
    # until the probe ends, so that no other meta storage reuses their ids.
    placeholders = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in tensors.items()}
    recorder = _Recorder(placeholders, memory)
    try:
        with recorder:
            loaded = (load_weights or own_load_weights(model))(iter(placeholders.items()))
    except Exception as exc:
        why = f"load_weights cannot run on placeholders: {type(exc).__name__}: {exc}"
        return ProbeResult(unsupported=(*recorder.unsupported, why))
    leftovers = [n for n in _tensors_of(model).meta if n not in meta_before]
    if leftovers:
        recorder.unsupported.append(f"placeholders were kept by the model: {', '.join(leftovers[:5])}")
    return ProbeResult(placements={name: tuple(ps) for name, ps in recorder.placements.items()},
                       loaded_params=frozenset(loaded) if loaded is not None else None,
                       unsupported=tuple(recorder.unsupported), covered=dict(recorder.covered),
                       # after the probe: includes parameters registered during it
                       numel=dict(memory.numel), parameters=frozenset(memory.parameters))


@dataclass
class _ModelTensors:
    """A model's tensors, found in one walk over its modules."""

    parameters: list[tuple[str, torch.Tensor]]  # (name, parameter), as ``named_parameters`` lists them
    buffers: list[tuple[str, torch.Tensor]]     # (name, buffer), as ``named_buffers`` lists them
    meta: list[str]                             # names of meta tensors (parameters, buffers, attributes)


def own_load_weights(model: nn.Module) -> LoadWeights:
    """The model's own ``load_weights`` (every engine's models have one; ``nn.Module`` does not)."""
    load_weights: LoadWeights = getattr(model, "load_weights")  # noqa: B009 (nn.Module types attributes as tensors)
    return load_weights


def _tensors_of(model: nn.Module) -> _ModelTensors:
    """The model's parameters and buffers, named as ``named_parameters`` and ``named_buffers`` name
    them, and the names of its meta tensors (parameters, buffers, plain module attributes), in one
    walk over its modules: each walk is a noticeable part of a probe (docs/benchmarks.md)."""
    parameters: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    meta: list[str] = []
    seen_parameters: set[int] = set()
    seen_buffers: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for store, seen, found in ((module._parameters, seen_parameters, parameters),
                                   (module._buffers, seen_buffers, buffers)):
            for name, t in store.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                found.append((dot + name, t))
                if t.is_meta:
                    meta.append(dot + name)
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                meta.append(dot + attr)
    return _ModelTensors(parameters, buffers, meta)
