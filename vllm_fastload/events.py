"""Layer readiness: an event per layer group, fired when the caller has consumed all of it.

A layer is "ready" only once the caller asked for the item after its last tensor, i.e. the
caller has put every tensor of the layer where it belongs. That is the moment start-up work
for that layer (warm-up, metrics) may begin. A plan knows its groups' order (``LoadProgress``,
driven by the executor); where tensors are asked for one at a time in an order no plan predicts
(TGI's ``Weights`` calls), ``LayerTracker`` counts them instead.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from vllm_fastload.errors import ConfigError
from vllm_fastload.format import TensorInfo
from vllm_fastload.layers import LayerKey, layer_key

if TYPE_CHECKING:
    from vllm_fastload.config import LayerCallback

logger = logging.getLogger("vllm_fastload")

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class LayerEvent:
    """Passed to every ``on_layer_ready`` callback."""

    layer: int | None       # transformer layer index; None for embeddings / final groups
    name: str               # "embeddings", "layer 3", "final"
    tensors: int            # tensors in this group
    bytes: int              # bytes read for this group
    elapsed_s: float        # seconds since the load started
    layers_done: int        # groups completed so far, this one included
    layers_total: int
    bytes_done: int
    bytes_total: int


def import_target(spec: str) -> object:
    """The object ``"package.module:attr.path"`` names, imported now.

    Raises:
        ImportError: the module cannot be imported.
        AttributeError: it has no such attribute.
    """
    module_name, _, path = spec.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_targets(targets: Mapping[str, str]) -> list[str]:
    """The names in ``targets`` (name -> ``"package.module:attr.path"``) whose target cannot be
    imported: what an engine adapter checks its engine release for."""
    missing = []
    for name, target in targets.items():
        try:
            import_target(target)
        except (ImportError, AttributeError):
            missing.append(name)
    return missing


def resolve_callback(spec: str | LayerCallback) -> LayerCallback:
    """A callable, or ``"package.module:function"`` imported now (so typos fail at start-up)."""
    if callable(spec):
        return spec
    try:
        obj = import_target(spec)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"on_layer_ready: cannot import {spec!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigError(f"on_layer_ready: {spec!r} is not callable")
    return obj


class Countdown(Generic[K, T]):
    """Keys that each wait for some items: tells which keys an arriving item completes.

    Readiness is counted this way wherever tensors arrive in an order no plan predicts (TGI's
    calls) or where a key waits for several reads (a parameter written from several tensors).
    An item may be due several times for a key (several planned reads of one tensor); an
    arrival nobody waits for any more is ignored.

    Example:
        >>> c = Countdown([("layer 0", "a"), ("layer 0", "b")])
        >>> c.arrive("a"), c.arrive("b")
        ([], ['layer 0'])
    """

    def __init__(self, waits: Iterable[tuple[K, T]]) -> None:
        self._due: dict[K, Counter[T]] = {}
        self._keys_of: dict[T, list[K]] = {}
        for key, item in waits:
            due = self._due.setdefault(key, Counter())
            if not due[item]:
                self._keys_of.setdefault(item, []).append(key)
            due[item] += 1

    def arrive(self, item: T) -> list[K]:
        """Count one arrival of ``item``; the keys it completed (in the order first seen)."""
        done = []
        for key in self._keys_of.get(item, ()):
            due = self._due[key]
            if not due[item]:
                continue
            due[item] -= 1
            if not due[item]:
                del due[item]
                if not due:
                    done.append(key)
        return done


class LoadProgress:
    """Tracks bytes and layer groups; drives callbacks, the tqdm bar and debug log lines."""

    #: Seconds between redraws of the bar: each redraw is work on the loading thread.
    REFRESH_S = 0.5

    def __init__(self, *, total_bytes: int, total_layers: int,
                 callbacks: Sequence[str | LayerCallback] = (), show_bar: bool = False,
                 log_layers: bool = False, description: str = "fastload") -> None:
        self.total_bytes = total_bytes
        self.total_layers = total_layers
        self.callbacks: list[Callable[[LayerEvent], object]] = [resolve_callback(c) for c in callbacks]
        self.log_layers = log_layers
        self.bytes_done = 0
        self.layers_done = 0
        self.start = time.perf_counter()
        self._bar = None
        if show_bar and total_bytes:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                             desc=description, dynamic_ncols=True, leave=True,
                             mininterval=self.REFRESH_S)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def layer_done(self, layer: int | None, name: str, tensors: int, nbytes: int) -> LayerEvent:
        self.bytes_done += nbytes
        self.layers_done += 1
        event = LayerEvent(layer, name, tensors, nbytes, self.elapsed_s, self.layers_done,
                           self.total_layers, self.bytes_done, self.total_bytes)
        if self._bar is not None:
            self._bar.update(nbytes)
            rate = self.bytes_done / max(event.elapsed_s, 1e-9) / 1e9
            self._bar.set_postfix_str(f"layers {self.layers_done}/{self.total_layers}, {rate:.2f} GB/s",
                                      refresh=False)
        if self.log_layers:
            logger.debug("fastload: %s ready (%d tensors, %.1f MB) at %.3f s", name, tensors, nbytes / 1e6,
                         event.elapsed_s)
        for callback in self.callbacks:
            callback(event)
        return event

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class LayerTracker:
    """Layer readiness counted, not predicted, for a caller that reads tensors one at a time in
    an order only it knows (TGI's ``Weights``).

    The groups are the layer groups (embeddings, each layer, final) of ``tensors``. A tensor
    counts once any read of it has been delivered (``arrive``); a group is ready when every one of
    its tensors has, and its event fires then, once, in the order groups complete. A group holding
    a tensor the caller never reads never fires: firing early would be wrong. ``LayerEvent.bytes``
    is the checkpoint size of the group's tensors (ranks may read different slices of them), and
    the bar counts the same bytes.
    """

    def __init__(self, tensors: Iterable[TensorInfo], *, callbacks: Sequence[str | LayerCallback] = (),
                 show_bar: bool = False, log_layers: bool = False, description: str = "fastload") -> None:
        infos = list(tensors)
        self._pending: Countdown[LayerKey, str] = Countdown((layer_key(t.name), t.name) for t in infos)
        self._size: dict[LayerKey, tuple[int, int]] = {}
        for t in infos:
            count, nbytes = self._size.get(layer_key(t.name), (0, 0))
            self._size[layer_key(t.name)] = (count + 1, nbytes + t.nbytes)
        self.progress = LoadProgress(total_bytes=sum(nbytes for _, nbytes in self._size.values()),
                                     total_layers=len(self._size), callbacks=callbacks, show_bar=show_bar,
                                     log_layers=log_layers, description=description)

    @property
    def done(self) -> bool:
        """Whether every group is ready."""
        return self.progress.layers_done == self.progress.total_layers

    def arrive(self, name: str) -> bool:
        """Count a delivered read of tensor ``name``; True when that made the last group ready (a
        name in no group, added after the tracker was made, completes nothing)."""
        done = self._pending.arrive(name)
        if not done:
            return False
        key = done[0]
        count, nbytes = self._size[key]
        self.progress.layer_done(key.layer, key.name, count, nbytes)
        if self.done:
            self.progress.close()
            return True
        return False

    def close(self) -> None:
        self.progress.close()
