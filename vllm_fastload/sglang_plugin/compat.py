"""Every reach of the SGLang adapter into SGLang internals, in one place, and the release it supports.

SGLang's loader interface is not a public API: the loader base class, the default loader's steps,
the model's construction, the parallel state, the load-format checks and the plugin hooks move
between releases (0.5.x changed the runtime context that ``ServerArgs`` publishes). The adapter
calls what is here, so that a release that moves one of them needs a change here only.

Tested: SGLang 0.5.23 (``SUPPORTED``), in-process, on CPU (scripts/test.sh's SGLang environment).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_fastload.model import missing_targets

#: The adapter's logger, under the package's (SGLang shows the root's handlers, so it needs no routing).
logger = logging.getLogger("vllm_fastload.sglang_plugin")

#: The SGLang releases this fastload is tested with (``major.minor.patch`` prefixes).
SUPPORTED = ("0.5.23",)

_LOADER = "sglang.srt.model_loader.loader"
#: The interfaces the adapter cannot work without: name -> "module:attribute.path".
REQUIRED: dict[str, str] = {
    "the plugin hook registry (HookRegistry)": "sglang.srt.plugins.hook_registry:HookRegistry",
    "the load-format choices (add_load_format_choices)": "sglang.srt.arg_groups.choices:add_load_format_choices",
    "LoadConfig._verify_load_format": "sglang.srt.configs.load_config:LoadConfig._verify_load_format",
    "the loader base class (BaseModelLoader)": f"{_LOADER}:BaseModelLoader",
    "the default loader (DefaultModelLoader)": f"{_LOADER}:DefaultModelLoader",
    "DefaultModelLoader.postprocess_weights": f"{_LOADER}:DefaultModelLoader.postprocess_weights",
    "the model's construction (_initialize_model)": f"{_LOADER}:_initialize_model",
    "the quantization config (_get_quantization_config)": f"{_LOADER}:_get_quantization_config",
    "set_default_torch_dtype": "sglang.srt.model_loader.utils:set_default_torch_dtype",
    "the tensor-parallel group (get_tp_group)": "sglang.srt.distributed.parallel_state:get_tp_group",
    "download_weights_from_hf": "sglang.srt.model_loader.weight_utils:download_weights_from_hf",
}
#: Of those, the ones without which ``--load-format fastload`` cannot even be accepted.
REGISTRATION = frozenset({"the plugin hook registry (HookRegistry)",
                          "the load-format choices (add_load_format_choices)", "LoadConfig._verify_load_format"})


class UnsupportedSglangError(RuntimeError):
    """This SGLang lacks an interface fastload needs."""


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def is_supported(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") or version.startswith(v + "+") for v in SUPPORTED)


def missing_interfaces(names: Iterable[str] | None = None) -> list[str]:
    """The names of the required interfaces (all, or those named) this SGLang lacks."""
    return missing_targets(REQUIRED if names is None else {n: REQUIRED[n] for n in names})


_noted = False


def note_release() -> None:
    """Log, once per process, that this SGLang is not a tested release (SGLang loads plugins in
    every process it starts)."""
    global _noted
    if _noted:
        return
    _noted = True
    version = sglang_version()
    if not is_supported(version):
        logger.warning("fastload: SGLang %s is not a release this fastload is tested with (%s); "
                       "`vllm-fastload verify --engine sglang MODEL --tp N` checks it on your checkpoint", version,
                       ", ".join(SUPPORTED))


def require() -> None:
    """Stop, naming what is missing, before anything is read, if this SGLang lacks an interface."""
    missing = missing_interfaces()
    if missing:
        raise UnsupportedSglangError(
            f"fastload cannot run on SGLang {sglang_version()}: it lacks {', '.join(missing)}. fastload is tested "
            f"with SGLang {', '.join(SUPPORTED)}; install it, or load with SGLang's default loader (no --load-format)")


# -- accepting --load-format fastload ----------------------------------------------------------
def accept_load_format(name: str, loader_class: Callable[[], type]) -> None:
    """Make ``--load-format name`` (and ``ServerArgs(load_format=name)``, ``LoadConfig(load_format=name)``)
    valid and load with the class ``loader_class()`` returns.

    SGLang closes the load format twice: the command line's choices (a list plugins may extend)
    and ``LoadConfig._verify_load_format``, which turns the string into its ``LoadFormat`` enum and
    refuses other names. A hook around the latter sets ``load_format`` to the loader class instead,
    which ``get_model_loader`` instantiates as it is (its branch for a class given as the format),
    before any of its own formats are considered. The hooks take effect when SGLang's
    ``load_plugins`` applies them, in every process that loads plugins.
    """
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if name not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([name])

    def verify_load_format(original: Callable[..., None], config: Any) -> None:
        chosen = config.load_format
        if isinstance(chosen, str) and chosen.lower() == name:
            config.load_format = loader_class()
            return None
        return original(config)

    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format", verify_load_format,
                          HookType.AROUND)


def on_server_args(name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(server_args)`` after every ``ServerArgs.resolve_once`` of a start with
    ``--load-format name``.

    That is not once per start: the launching process (``sglang.launch_server``, ``sglang serve``,
    ``sglang.Engine``) resolves its arguments before it starts the scheduler processes that load
    the model, and every process that publishes the arguments (each scheduler, as it starts) calls
    ``resolve_once`` again on the record it was handed, already resolved; the hook runs after each
    call, in every process. The callback must therefore decide for itself whether it has work left
    (early reads: ``early.decide``'s environment guard, which the launcher sets before it starts the
    schedulers and they inherit), and must not raise."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_resolve(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
        if str(getattr(server_args, "load_format", "")).lower() == name:
            callback(server_args)
        return result

    HookRegistry.register("sglang.srt.server_args.ServerArgs.resolve_once", after_resolve, HookType.AFTER)


def local_ranks(server_args: Any) -> int:
    """How many ranks load the model on this node: its share of the tensor- and pipeline-parallel group."""
    ranks = int(getattr(server_args, "tp_size", 1) or 1) * int(getattr(server_args, "pp_size", 1) or 1)
    return max(ranks // max(int(getattr(server_args, "nnodes", 1) or 1), 1), 1)


# -- the model and the default loader's steps ----------------------------------------------------
def build_model(model_config: Any, load_config: Any, device: torch.device) -> nn.Module:
    """The model as ``DefaultModelLoader.load_model`` builds it: quantization config, construction
    under the model's dtype on the target device (parameters allocated, not filled)."""
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), device:
        return _initialize_model(model_config, load_config, quant_config)


def default_dtype(dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """SGLang's default-dtype context, which its loader keeps while loading and post-processing."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    return set_default_torch_dtype(dtype)


def weights_loader(model: nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Any]:
    """What ``DefaultModelLoader.load_weights_only`` does with the checkpoint's tensors, returning
    what ``model.load_weights`` returns: MXFP8 scales renamed, AMD monokernels shown each tensor
    (a pass-through elsewhere), then ``model.load_weights``. (GPU memory bookkeeping left out.)"""
    from sglang.srt.kernel_plugins.amd.binding import monokernel_weights_iterator

    from vllm_fastload.model import own_load_weights

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        quant_config = getattr(model, "quant_config", None)
        if quant_config is not None and quant_config.get_name() == "mxfp8":
            weights = _mxfp8_names(weights)
        return own_load_weights(model)(monokernel_weights_iterator(model=model, weights=weights))

    return load_weights


def _mxfp8_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield (f"{name}_inv" if name.endswith(".weight_scale") else name), tensor


def post_process(model: nn.Module, device: torch.device) -> None:
    """SGLang's post-processing after loading (each quantization method's
    ``process_weights_after_loading``), looked up when called."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.postprocess_weights(model, device)


def load_with_default_loader(load_config: Any, model_config: Any, device_config: Any) -> nn.Module:
    """The model loaded exactly as ``--load-format auto`` would (what fastload leaves to SGLang)."""
    import dataclasses

    from sglang.srt.model_loader.loader import DefaultModelLoader

    config = dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
    return DefaultModelLoader(config).load_model(model_config=model_config, device_config=device_config)


def load_weights_with_default_loader(load_config: Any, model: nn.Module, model_config: Any) -> None:
    """``model``'s weights read exactly as ``--load-format auto`` reads them (every source, SGLang's
    file and name filters), without post-processing (the caller's ``load_model`` does it)."""
    import dataclasses

    from sglang.srt.model_loader.loader import DefaultModelLoader

    config = dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
    loader = DefaultModelLoader(config)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    DefaultModelLoader.load_weights_only(model, loader._get_all_weights(model_config, model), device)


def download_weights(model: str, load_config: Any, revision: str | None) -> str:
    """A Hugging Face model's safetensors files, downloaded the way SGLang's default loader does."""
    from sglang.srt.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(model, load_config.download_dir, ["*.safetensors", "*.safetensors.index.json"],
                                    revision, ignore_patterns=load_config.ignore_patterns)


# -- the parallel state ------------------------------------------------------------------------
def tp_group() -> Any | None:
    """SGLang's tensor-parallel group coordinator, or None in a single process without one."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        return get_tp_group()
    except (ImportError, AssertionError, RuntimeError):
        return None
