"""Test-only stand-in for SGLang's CPU kernel package (sgl-kernel's CPU build).

Why a stub: SGLang's CPU engine imports a handful of ``*_cpu`` kernels from ``sgl_kernel`` when its
model modules are imported, and the CPU build of sgl-kernel is not on any package registry (it is
built from source); the registry's ``sglang-kernel`` wheel is CUDA-only. Loading weights calls none
of them, so every name here is a function that raises if it is ever called: a test that reached a
kernel fails loudly instead of computing something. Nothing in vllm-fastload imports this.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (tests/sglang/stubs): the CPU kernels of "
                                  "SGLang cannot be installed on this machine")

    kernel.__name__ = name
    return kernel
