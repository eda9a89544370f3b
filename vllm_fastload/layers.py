"""Which transformer layer a tensor belongs to, so reads can complete layer by layer."""

from __future__ import annotations

import re
from dataclasses import dataclass

# `model.layers.3.`, `transformer.h.3.`, `blocks.3.`, `encoder.layer.3.` ... The first match
# wins, so `model.layers.3.mlp.experts.7.w1` is layer 3, not expert 7.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|decoder_layers)\.(\d+)(?:\.|$)")
# Tensors outside every layer that come *before* layer 0 in the forward pass.
_EMBEDDING_HINTS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")

EMBEDDINGS, LAYER, FINAL = 0, 1, 2


@dataclass(frozen=True, order=True)
class LayerKey:
    """Sort key: embeddings, then layers in order, then final norm / head."""

    stage: int
    index: int = -1

    @property
    def layer(self) -> int | None:
        return self.index if self.stage == LAYER else None

    @property
    def name(self) -> str:
        if self.stage == LAYER:
            return f"layer {self.index}"
        return "embeddings" if self.stage == EMBEDDINGS else "final"


def layer_key(tensor_name: str) -> LayerKey:
    match = _LAYER_RE.search(tensor_name)
    if match:
        return LayerKey(LAYER, int(match.group(1)))
    lowered = tensor_name.lower()
    if any(hint in lowered for hint in _EMBEDDING_HINTS):
        return LayerKey(EMBEDDINGS)
    return LayerKey(FINAL)
