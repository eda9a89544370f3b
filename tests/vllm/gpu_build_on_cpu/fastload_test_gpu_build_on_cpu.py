"""Test-only vLLM platform plugin: a vLLM *GPU* build (the ``vllm`` wheel) run as vLLM's CPU
platform on a machine without a GPU, so that its model classes, weight loaders and
post-processing run where no GPU is. vLLM 0.33.0 ships no CPU build; scripts/test.sh runs the
vLLM checks marked ``gpu_build`` against its GPU build this way, and scripts/vllm_bundle.py's
``check --engine`` runs vLLM 0.26's the same way.

The GPU build has none of the CPU build's kernels (``vllm._C`` is a CUDA library), and the CPU
platform calls a few of them while it builds a model or post-processes its weights. This plugin
does three things, and nothing else differs from vLLM's own CPU platform:

* declares ``_C.silu_and_mul``, which the CPU platform looks up when it builds an MLP (never
  called: nothing here runs a forward pass);
* defines ``_C.prepack_moe_weight`` as a copy: the CPU fused-MoE layer packs its expert weights
  with it after loading, and the packing is a layout of the CPU kernel's own, not a value; so on
  this platform a MoE's expert weights are compared as loaded, its other post-processing as vLLM
  does it;
* reports no AMX tiles, so that post-processing keeps dense weights as ``torch.nn.functional.linear``
  takes them (as on a CPU without AMX) instead of packing them with the CPU build's kernels.

The CPU platform's int8 W8A8 post-processing needs oneDNN kernels of the CPU build and has no
other path, so the quantized check there uses an fp8 W8A8 checkpoint. Only the runs against a GPU
build put this folder on ``PYTHONPATH`` (a ``.dist-info`` beside this file declares the entry point).
"""

from __future__ import annotations

import torch

_library: torch.library.Library | None = None


def _prepack_moe_weight(weight: torch.Tensor, output: torch.Tensor, isa: str) -> None:
    output.copy_(weight)


def _declare(schema: str, impl=None) -> None:
    """Declares ``_C.<op>`` unless the loaded ``vllm._C`` already has it."""
    assert _library is not None
    try:
        _library.define(schema)
    except RuntimeError:  # vLLM's own library defines it
        return
    if impl is not None:
        _library.impl(schema.split("(", 1)[0], impl, "CPU")


def activate() -> str | None:
    """``vllm.platform_plugins`` entry point: vLLM's CPU platform where no GPU driver answers
    (where one does, the GPU build keeps its own platform)."""
    global _library
    if torch.cuda.is_available():
        return None
    if _library is None:
        _library = torch.library.Library("_C", "FRAGMENT")
        _declare("silu_and_mul(Tensor! out, Tensor input) -> ()")
        _declare("prepack_moe_weight(Tensor weight, Tensor! output, str isa) -> ()", _prepack_moe_weight)
    torch.cpu._is_amx_tile_supported = lambda: False
    return "vllm.platforms.cpu.CpuPlatform"
