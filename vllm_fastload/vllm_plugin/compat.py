"""The plugin's reaches into vLLM internals that differ between vLLM releases, in one place."""

from __future__ import annotations

import inspect

from torch import nn


def track_weights_loading(loader: object, model: nn.Module, loaded: set[str], quantized: bool) -> None:
    """vLLM's own completeness check (``DefaultModelLoader.track_weights_loading``), in its
    quantized form where this vLLM has one (0.32 and later; older releases take no ``quantized``
    argument and exempt quantized modules, where fastload's own check that every parameter was
    written still applies). Raises vLLM's ``ValueError`` naming the parameters not loaded."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    check = DefaultModelLoader.track_weights_loading
    if "quantized" in inspect.signature(check).parameters:
        check(loader, model, loaded, quantized=quantized)
    else:
        check(loader, model, loaded)
