"""``FastloadModelLoader``: vLLM's ``--load-format fastload``.

A thin adapter: it finds the checkpoint (narrowed by the model's own hooks, ``model_hooks``) and
this rank's place in vLLM's tensor-parallel group, hands the model to ``rank.load_rank`` (probe,
plan, read, replay), logs what the rank did, and runs vLLM's completeness check. Every reach into
vLLM beyond its public loader base class goes through ``compat``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from vllm_fastload import CheckpointError, LoadReport, is_remote
from vllm_fastload.model import Collectives, load_rank, loader_config, loading, model_device
from vllm_fastload.vllm_plugin import compat, model_hooks
from vllm_fastload.vllm_plugin.cpus import reader_cpus
from vllm_fastload.vllm_plugin.post import LayerPostProcessor

logger = logging.getLogger("vllm_fastload.vllm_plugin")  # shown in vLLM's log (see ``vllm_plugin``)


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class FastloadModelLoader(BaseModelLoader):
    """Loads safetensors checkpoints through vllm-fastload's per-rank plan and aggregated reader."""

    def __init__(self, load_config: LoadConfig) -> None:
        compat.require()  # on a vLLM that lacks what fastload needs, stop here, naming it
        super().__init__(load_config)
        # Env first, then --model-loader-extra-config on top; unknown keys stop start-up here.
        self.config = loader_config(load_config.model_loader_extra_config, "vLLM")
        #: What the last ``load_weights`` did on this rank (also logged): for tests and tools that
        #: load in-process, e.g. tests/vllm/zoo.py.
        self.report: LoadReport | None = None
        #: Where vLLM post-processes, while ``load_model`` runs (None: ``load_weights`` called on
        #: its own, e.g. by a weight reload, which post-processes in its own way).
        self._post_device: torch.device | None = None
        #: Where this rank's reader threads run, while ``load_model`` runs (see ``cpus``).
        self._cpus: tuple[int, ...] | None = None
        #: Whether the tensor-parallel group's ranks together take each tensor they use whole:
        #: not where an MoE's experts spread over data-parallel ranks too.
        self._group_takes_all = True
        #: Whether the ranks of vLLM's data-parallel group hold alike what is not their experts,
        #: and may read it once among them (``dp_exchange``).
        self._replicas = False

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        self._post_device = torch.device(load_device)
        self._cpus = None if self.config.is_set("cpus") else reader_cpus()
        self._group_takes_all = not compat.experts_beyond_tp_group(vllm_config)
        self._replicas = compat.replicas_in_dp_group(vllm_config)
        try:
            return super().load_model(vllm_config, model_config, prefix=prefix)
        finally:
            self._post_device = None
            self._cpus = None
            self._group_takes_all = True
            self._replicas = False

    # -- BaseModelLoader --------------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        self._checkpoint_dir(model_config)  # an object URI is opened where it is, never downloaded

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        with loading():  # early reads stop as this rank's load begins
            self._load_weights(model, model_config)

    # -- helpers ----------------------------------------------------------------------------
    def _load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        path = self._checkpoint_dir(model_config)
        rank, world = _rank()
        secondary = model_hooks.secondary_sources(model)
        if secondary:
            logger.warning("fastload: %s also loads weights from %s (secondary_weights): loading it with vLLM's "
                           "default loader", type(model).__name__, ", ".join(s.model_or_path for s in secondary))
            compat.load_with_default_loader(self.load_config, model, model_config)
            self.report = LoadReport.left_to_engine(rank, world, "secondary_weights")
            return
        files = model_hooks.checkpoint_files(model, path)
        post = self._post_processor(model)
        report = load_rank(model, path if files is None else files, self.config, device=model_device(model),
                           rank=rank, world=world, collectives=_collectives(compat.tp_group()),
                           show_progress=self.config.progress and rank == 0, listener=post, rank_cpus=self._cpus,
                           group_takes_all=self._group_takes_all,
                           replicas=_collectives(compat.dp_group()) if self._replicas else None)
        if post is not None:
            report = dataclasses.replace(report, post_processed=post.processed)
        logger.info("%s", report.line())
        self.report = report
        loaded = report.loaded if post is None or report.loaded is None else report.loaded | post.added
        self._check_complete(model, model_config, loaded, path)

    def _post_processor(self, model: nn.Module) -> LayerPostProcessor | None:
        """Post-processing layer by layer (``post_per_layer``), where vLLM's pass follows this load."""
        if not self.config.post_per_layer or self._post_device is None:
            return None
        reason = compat.post_processing_per_module_unsafe(model)
        if reason is not None:
            logger.info("fastload: post-processing after the load, not per layer (%s)", reason)
            return None
        return LayerPostProcessor(model, self._post_device)

    def _checkpoint_dir(self, model_config: ModelConfig) -> str:
        """Where the weights are: a local path, an object URI (vLLM puts ``s3://...`` in
        ``model_weights`` and a local copy of the config files in ``model``), or a Hugging Face
        download."""
        model = getattr(model_config, "model_weights", "") or model_config.model
        if is_remote(model) or os.path.isdir(model) or os.path.isfile(model):
            return model
        return compat.download_weights(model, self.load_config.download_dir, model_config.revision)

    def _check_complete(self, model: nn.Module, model_config: ModelConfig, loaded: frozenset[str] | None,
                        path: str) -> None:
        """The default loader's strict check: every parameter must come from the checkpoint.

        vLLM runs it only for unquantized models; fastload runs its quantized form too (every
        parameter except those a checkpoint cannot carry), so that a quantized checkpoint
        missing e.g. its ``weight_scale`` tensors stops the load instead of leaving uninitialised
        scales (vLLM's default loader loads such a checkpoint without a word).
        """
        if loaded is None:
            return
        quantized = model_config.quantization is not None
        try:
            compat.track_weights_loading(self, model, set(loaded), quantized)
        except ValueError as exc:
            hint = (f"; the checkpoint's tensors do not match its quantization config ({model_config.quantization})"
                    if quantized else "")
            raise CheckpointError(f"checkpoint does not provide every parameter of the model: {exc}{hint}",
                                  file=path) from None


def _collectives(group: Any) -> Collectives | None:
    """The collectives of a vLLM group coordinator's CPU group (``compat.tp_group``: the
    tensor-parallel one; ``compat.dp_group``: the data-parallel one, where experts spread over
    it), if there is one with several ranks (None: no distributed state, a single process)."""
    if group is None or group.world_size == 1:
        return None
    return Collectives(group.cpu_group, group.rank_in_group, group.world_size)
