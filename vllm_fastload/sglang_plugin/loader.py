"""``FastloadModelLoader``: SGLang's ``--load-format fastload``.

A thin adapter, like the vLLM one: it builds the model as SGLang's default loader does, finds the
checkpoint and this rank's place in SGLang's tensor-parallel group, hands the model to
``model.rank.load_rank`` (probe, plan, read, replay: the same code as under vLLM), logs what the
rank did, checks that the checkpoint reached every parameter, and runs SGLang's post-processing.
Every reach into SGLang beyond what its plugin hooks hand over goes through ``compat``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.model_loader.loader import BaseModelLoader
from torch import nn

from vllm_fastload import CheckpointError, LoadReport, is_remote
from vllm_fastload.model import Collectives, load_rank, loader_config, loading, model_device
from vllm_fastload.sglang_plugin import compat

logger = logging.getLogger("vllm_fastload.sglang_plugin")


class FastloadModelLoader(BaseModelLoader):
    """Loads safetensors checkpoints through vllm-fastload's per-rank plan and aggregated reader."""

    def __init__(self, load_config: Any) -> None:
        compat.require()  # on an SGLang that lacks what fastload needs, stop here, naming it
        super().__init__(load_config)
        # Env first, then --model-loader-extra-config on top; unknown keys stop start-up here.
        self.config = loader_config(load_config.model_loader_extra_config, "SGLang")
        if self.config.is_set("post_per_layer") and self.config.post_per_layer:
            logger.warning("fastload: post_per_layer applies to vLLM only; SGLang post-processes after the load")
        #: What the last load did on this rank (also logged): for tests and ``verify``.
        self.report: LoadReport | None = None

    # -- SGLang's BaseModelLoader ------------------------------------------------------------
    def download_model(self, model_config: Any) -> None:
        self._checkpoint_dir(model_config)

    def load_model(self, *, model_config: Any, device_config: Any) -> nn.Module:
        why = _left_to_sglang(model_config)
        if why is not None:
            logger.warning("fastload: %s: loading it with SGLang's default loader", why)
            self.report = LoadReport.left_to_engine(*_rank(), why)
            return compat.load_with_default_loader(self.load_config, model_config, device_config)
        device = torch.device(device_config.device)
        model = compat.build_model(model_config, self.load_config, device)
        with compat.default_dtype(model_config.dtype):
            self.load_weights(model, model_config)
            compat.post_process(model, device)
        return model.eval()

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        """Fill ``model``'s parameters from the checkpoint, as SGLang's default loader's
        ``load_weights_only`` would, without post-processing them."""
        with loading():  # early reads stop as this rank's load begins
            self._load_weights(model, model_config)

    # -- helpers ----------------------------------------------------------------------------
    def _load_weights(self, model: nn.Module, model_config: Any) -> None:
        tp = compat.tp_group()
        rank, world = _rank()
        why = _weights_left_to_sglang(model, self.load_config)
        if why is not None:
            logger.warning("fastload: %s: loading its weights with SGLang's default loader", why)
            compat.load_weights_with_default_loader(self.load_config, model, model_config)
            self.report = LoadReport.left_to_engine(rank, world, why)
            return
        path = self._checkpoint_dir(model_config)
        collectives = Collectives(tp.cpu_group, rank, world) if tp is not None and world > 1 else None
        report = load_rank(model, path, self.config, device=model_device(model), rank=rank, world=world,
                           collectives=collectives, show_progress=self.config.progress and rank == 0,
                           load_weights=compat.weights_loader(model))
        logger.info("%s", report.line())
        self.report = report
        if report.planned:
            _check_every_parameter_written(model, report, path)

    def _checkpoint_dir(self, model_config: Any) -> str:
        """Where the weights are: a local directory or file, or a Hugging Face download (as SGLang's
        default loader does it)."""
        model = model_config.model_path
        if is_remote(model):
            raise CheckpointError("fastload on SGLang reads local checkpoints and Hugging Face downloads; for an "
                                  "object-store URI use SGLang's runai_streamer load format", file=model)
        if os.path.isdir(model) or os.path.isfile(model):
            return model
        return compat.download_weights(model, self.load_config, getattr(model_config, "revision", None))


def _rank() -> tuple[int, int]:
    """This rank's place in SGLang's tensor-parallel group (0 of 1 in a single process)."""
    tp = compat.tp_group()
    return (tp.rank_in_group, tp.world_size) if tp is not None else (0, 1)


def _left_to_sglang(model_config: Any) -> str | None:
    """Why this model is loaded by SGLang's default loader, not by fastload (None: by fastload).

    ModelOpt checkpoints go through Hugging Face's own loading in SGLang, not ``load_weights``."""
    if getattr(model_config, "modelopt_quant", None):
        return "ModelOpt quantization loads through transformers in SGLang"
    return None


def _weights_left_to_sglang(model: nn.Module, load_config: Any) -> str | None:
    """Why SGLang's default loader reads this model's weights (None: fastload does): the model
    attributes and options with which it reads other files or filters names, honoured as it does."""
    if getattr(model, "secondary_weights", None):
        return f"{type(model).__name__} also loads weights from other sources (secondary_weights)"
    if getattr(model, "allow_patterns_overrides", None) is not None:
        return f"{type(model).__name__} picks its own checkpoint files (allow_patterns_overrides)"
    if getattr(load_config, "draft_model_idx", None) is not None:
        return "a draft model's layer is picked out of the checkpoint (draft_model_idx)"
    return None


def _check_every_parameter_written(model: nn.Module, report: LoadReport, path: str) -> None:
    """SGLang's default loader leaves a parameter the checkpoint does not provide as it was
    allocated, without a word (uninitialised memory, for a weight); fastload stops instead, naming
    it, where the checkpoint cannot mean to leave it: a parameter of an unquantized module, or of a
    module the checkpoint provides nothing for. A quantized module may keep parameters its method
    set when it was built (GPTQ's ``g_idx`` without act-order)."""
    unwritten = set(report.never_written)
    missing = [name for name in report.never_written if not _kept_from_construction(model, name, unwritten)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint does not provide every parameter of the model: {', '.join(missing[:5])}"
                              f"{more} received no checkpoint data (SGLang's default loader would leave them as "
                              "allocated)", file=path)


def _kept_from_construction(model: nn.Module, name: str, unwritten: set[str]) -> bool:
    """Whether the parameter ``name`` may keep what its module set at construction: the module is
    quantized and the checkpoint wrote some other parameter of it."""
    module_name, _, _ = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    method = getattr(module, "quant_method", None)
    if method is None or type(method).__name__.startswith("Unquantized"):
        return False
    own = [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters(recurse=False)]
    return any(p not in unwritten for p in own)
