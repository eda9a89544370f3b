"""vLLM's own layers on a given tensor-parallel rank, loaded the way vLLM's model classes load them.

The geometry properties (``test_geometry.py``) compare, on every rank, what a layer's own
``weight_loader`` writes from the real checkpoint tensors (the oracle) with what fastload's plan
reads and replays. Everything that slices is vLLM's: each layer is built while vLLM's parallel
state says "rank r of a tensor-parallel group of n" (``on_rank``), as a worker builds it, and its
weight loader narrows by the rank it was built for. The ``load_weights`` of the tiny models here
only does what vLLM's model classes do before calling those loaders: map checkpoint names to
parameters and shard ids, transpose a Conv1D weight (GPT-2), undo a per-head interleave (Bloom),
chunk or split a fused tensor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

#: Byte every parameter holds before a load: a region no write reaches keeps it on both sides.
SENTINEL = 0x5A


class _Group:
    """What vLLM's layers ask of a process group while they are built: the rank and the size."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank_in_group = self.rank = rank
        self.world_size = world
        self.ranks = list(range(world))


@contextlib.contextmanager
def on_rank(rank: int, world: int) -> Iterator[None]:
    """vLLM's parallel state as on rank ``rank`` of a TP group of ``world`` (one data-parallel rank,
    one pipeline stage; the expert-parallel group spans the TP ranks, as vLLM makes it)."""
    from vllm.distributed import parallel_state as ps

    names = ("_TP", "_EP", "_DP", "_PP", "_DCP", "_PCP")
    saved = {n: getattr(ps, n) for n in names}
    ps._TP, ps._EP = _Group(rank, world), _Group(rank, world)
    ps._DP = ps._PP = ps._DCP = ps._PCP = _Group(0, 1)
    try:
        yield
    finally:
        for n, g in saved.items():
            setattr(ps, n, g)


@contextlib.contextmanager
def vllm_context() -> Iterator[None]:
    """A default ``VllmConfig`` as the current one, which layers consult while they are built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


#: A call into a layer's loader: (parameter name, loaded weight, extra arguments).
Call = tuple[str, torch.Tensor, tuple]


class Tiny(nn.Module):
    """One vLLM layer at ``model.layers.0.<attr>``, and a ``load_weights`` that routes each checkpoint
    tensor to the layer's parameters through ``route(name, tensor) -> [(param, weight, args)]``
    (``param`` None: hand the tensor to the layer's own ``load_weights``, as AutoWeightsLoader does)."""

    def __init__(self, attr: str, layer: nn.Module, route: Callable[[str, torch.Tensor], list[Call]]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        setattr(self.model.layers[0], attr, layer)
        self.attr, self.layer, self.route = attr, layer, route
        with torch.no_grad():
            for p in self.parameters():
                p.data.view(torch.uint8).fill_(SENTINEL) if p.is_contiguous() else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        prefix = f"model.layers.0.{self.attr}."
        for name, tensor in weights:
            for param, weight, args in self.route(name.removeprefix(prefix), tensor):
                if param is None:
                    loaded |= {prefix + n for n in self.layer.load_weights([(weight_name, weight)
                                                                            for weight_name in args])}
                    continue
                p = params[prefix + param]
                p.weight_loader(p, weight, *args)
                loaded.add(prefix + param)
        return loaded


def parameter_bytes(model: nn.Module) -> dict[str, bytes]:
    """Every parameter's bytes (the comparison is of bytes, whatever the dtype)."""
    return {n: p.detach().contiguous().view(torch.uint8).numpy().tobytes() if p.numel() else b""
            for n, p in model.named_parameters()}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern: the comparison is of bytes)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


class Case:
    """A write pattern: checkpoint tensors (full names) and the tiny model that loads them on a rank."""

    def __init__(self, pattern: str, world: int, tensors: dict[str, torch.Tensor], build: Callable[[], Tiny],
                 notes: dict | None = None) -> None:
        self.pattern, self.world, self.tensors, self.build = pattern, world, tensors, build
        self.notes = notes or {}

    def __repr__(self) -> str:  # what hypothesis prints for a failing example: shapes, not values
        shapes = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.tensors.items()}
        return f"Case({self.pattern}, world={self.world}, {self.notes}, tensors={shapes})"


class ThreadCollectives:
    """The row exchange's two collectives between ranks that run as threads of this process.

    The property tests run all ranks of a group in one process (thousands of cases: a process
    group per case would cost more than the cases). The exchange's transport over gloo between
    real processes is tested in tests/core/test_exchange.py and by the vLLM end-to-end runs.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=60)
        self._slots: list = [None] * world

    def for_rank(self, rank: int) -> _RankCollectives:
        return _RankCollectives(self, rank)

    def abort(self) -> None:
        self._barrier.abort()


class _RankCollectives:
    def __init__(self, shared: ThreadCollectives, rank: int) -> None:
        self.shared, self.rank, self.world = shared, rank, shared.world

    def _exchange(self, mine: object) -> list:
        shared = self.shared
        shared._slots[self.rank] = mine
        shared._barrier.wait()
        everyone = list(shared._slots)
        shared._barrier.wait()
        return everyone

    def all_gather_object(self, obj: object) -> list:
        return self._exchange(obj)

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]) -> None:
        everyone = self._exchange((send.clone(), list(send_sizes)))
        at = 0
        for q, (their_send, their_sizes) in enumerate(everyone):
            start = sum(their_sizes[:self.rank])
            n = their_sizes[self.rank]
            assert n == recv_sizes[q], (n, recv_sizes[q])
            recv[at:at + n].copy_(their_send[start:start + n])
            at += n
