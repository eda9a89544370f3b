"""Per-parameter digests of a loaded vLLM model, to prove two loaders produced the same weights.

``LLM.apply_model`` pickles the function by reference, so it must live in an importable
module (not ``__main__``): ``llm.apply_model(parameter_digests)`` returns one dict per worker.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def parameter_digests(model: nn.Module) -> dict[str, str]:
    """``{parameter name: sha256 of its bytes, dtype and shape}`` for every parameter and buffer."""
    out: dict[str, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().contiguous().cpu()
        h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
        if data.numel():
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out
