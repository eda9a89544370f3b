"""Per-parameter digests of a loaded vLLM model, to prove two loaders produced the same weights.

``LLM.apply_model`` pickles the function by reference, so it must live in an importable
module (not ``__main__``): ``llm.apply_model(parameter_digests)`` returns one dict per worker.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

from vllm_fastload.tensors import host_bytes


def parameter_digests(model: nn.Module) -> dict[str, str]:
    """``{parameter name: sha256 of its bytes, dtype and shape}`` for every parameter and buffer."""
    return _digests([*model.named_parameters(), *model.named_buffers()])


#: Bytes from which the digests are taken on several threads (hashlib and the copies off a GPU
#: release the GIL), so that a 16 GB model's are not a minute's work on one.
_PARALLEL_BYTES = 64 << 20


def _digests(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    total = sum(t.numel() * t.element_size() for _, t in named)
    if total < _PARALLEL_BYTES or len(named) < 2:
        return dict(map(_digest, named))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(pool.map(_digest, named))


def _digest(item: tuple[str, torch.Tensor]) -> tuple[str, str]:
    name, t = item
    data = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        h.update(host_bytes(data.reshape(-1).view(torch.uint8)))  # the buffer itself, not a copy of it
    return name, h.hexdigest()


def digests_before_post_processing(model: nn.Module, out: dict[str, str]) -> None:
    """Record in ``out`` the digests of each module's own parameters and buffers right before its
    first ``process_weights_after_loading`` step (which may repack them into kernel handles that are
    no longer parameters), whenever that comes: after ``load_weights`` for vLLM's default loader,
    during it for fastload's per-layer post-processing. Names already in ``out`` are kept."""
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "__dict__") or not hasattr(method, "process_weights_after_loading"):
            continue
        _digest_on_first_step(method, prefix, module, out)


def _digest_on_first_step(method: Any, prefix: str, module: nn.Module, out: dict[str, str]) -> None:
    seen: dict[int, tuple[str, nn.Module]] | None = method.__dict__.get("_digest_modules")
    if seen is None:
        original = method.process_weights_after_loading
        seen = {}

        def process_weights_after_loading(layer: nn.Module) -> None:
            entry = seen.pop(id(layer), None)
            if entry is not None and entry[1] is layer:
                own = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
                for name, digest in _digests(own).items():
                    out.setdefault(f"{entry[0]}.{name}" if entry[0] else name, digest)
            return original(layer)

        method.process_weights_after_loading = process_weights_after_loading
        method._digest_modules = seen
    seen[id(module)] = (prefix, module)


def fastload_report(loader: object) -> dict[str, Any] | None:
    """What fastload's loader reports of its last load (``LoadReport.as_dict``), for the results
    these tools write; None for another engine loader, or where fastload did not load."""
    report = getattr(loader, "report", None)
    return None if report is None else report.as_dict()
