"""Layer readiness for TGI loads: ``on_layer_ready`` events and the rank-0 progress bar.

TGI pulls tensors one call at a time, in an order only the model code knows, so there is
no plan to walk. Readiness is therefore counted, not predicted:

- the groups are the core's layer groups (embeddings, layer 0..N-1, final) over the tensors
  in the routing at construction;
- a tensor counts as served once any read of it returned (whole, sharded, packed, or an
  indexed ``_get_slice``); ``has_tensor`` / ``get_shape`` read nothing and do not count;
- a group is ready when every one of its tensors has been served, and its event fires then,
  once, in the order groups complete (usually layer order, since TGI builds layers in order).

A group holding a tensor this rank never reads (an unused buffer, a rank-0-only bias on
other ranks) never fires: firing early would be wrong, and the loader cannot know which
tensors a model skips. ``LayerEvent.bytes`` is the checkpoint size of the group's tensors
(ranks read different slices of them); the bar counts the same bytes and reaches 100%
when every group is ready.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_fastload.config import FastloadConfig
from vllm_fastload.events import Countdown, LoadProgress
from vllm_fastload.format import TensorInfo
from vllm_fastload.layers import LayerKey, layer_key


class LayerReadiness:
    def __init__(self, tensors: Mapping[str, TensorInfo], config: FastloadConfig, *, show_bar: bool) -> None:
        self._pending: Countdown[LayerKey, str] = Countdown((layer_key(name), name) for name in tensors)
        self._size: dict[LayerKey, tuple[int, int]] = {}
        for name, info in tensors.items():
            key = layer_key(name)
            count, nbytes = self._size.get(key, (0, 0))
            self._size[key] = (count + 1, nbytes + info.nbytes)
        self.progress = LoadProgress(
            total_bytes=sum(nbytes for _, nbytes in self._size.values()), total_layers=len(self._size),
            callbacks=config.on_layer_ready, show_bar=show_bar, log_layers=config.log_layers,
            description="fastload-tgi")

    @property
    def done(self) -> bool:
        return self.progress.layers_done == self.progress.total_layers

    def served(self, name: str) -> bool:
        """Record that ``name`` (a routing key) was read; True when that made the last group ready."""
        # A name added to the routing after construction (speculator heads) is in no group.
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
