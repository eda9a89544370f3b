"""SGLang's side of ``vllm-fastload verify --engine sglang``: rank processes
that set SGLang's distributed state up the way its scheduler processes do, then load checkpoints
through SGLang's own loader interface (``get_model_loader(LoadConfig(...)).load_model(...)``).

One process per rank: SGLang's plugins loaded (as a scheduler process does: ``--load-format
fastload`` then comes from the ``sglang.srt.plugins`` entry point), ``init_distributed_environment``
(gloo on CPU, NCCL on GPUs), a published ``ServerArgs`` for the parallel layout, and
``initialize_model_parallel``; then per checkpoint and per load mode a fresh ``LoadConfig`` and
``ModelConfig``. On a machine without CUDA, SGLang's CPU engine is chosen (``SGLANG_USE_CPU_ENGINE``).
"""

from __future__ import annotations

import os
import time

from vllm_fastload.tools.verify import load_every_checkpoint


def setup_rank(rank: int, tp: int, port: int) -> str:
    """SGLang's distributed state for this rank, once per process; the device it loads onto."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    from sglang.srt.plugins import load_plugins

    load_plugins()  # registers "fastload" through the entry point, as SGLang's scheduler processes do
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    backend = "nccl" if cuda else "gloo"
    device = "cuda" if cuda else "cpu"
    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend=backend)
    reset_context()
    # The parallel layout only: each checkpoint gets its own ModelConfig and LoadConfig below.
    publish(ServerArgs(model_path="dummy", device=device, tp_size=tp), role="scheduler",
            ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend=backend)
    return device


def load_and_digest(path: str, load_format: str, extra: dict, dtype: str, device: str) -> dict:
    """Load one checkpoint on this rank; digests after the weights are loaded (``loaded:`` names,
    right before SGLang's post-processing) and after ``load_model``, fastload's report, and the
    seconds ``load_model`` took. A post-processing step that fails is reported under
    ``post_error`` with the weights as loaded."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    from vllm_fastload.tools.digests import fastload_report, parameter_digests

    loaded: dict[str, str] = {}
    state: dict = {}
    original = DefaultModelLoader.__dict__["postprocess_weights"]

    def postprocess_weights(model, target_device) -> None:
        loaded.update({f"loaded:{k}": v for k, v in parameter_digests(model).items()})
        state["model"] = model
        try:
            original.__func__(model, target_device)
        except Exception as exc:  # recorded: the weights as loaded are still compared
            state["post_error"] = f"{type(exc).__name__}: {exc}"

    DefaultModelLoader.postprocess_weights = staticmethod(postprocess_weights)
    start = time.perf_counter()
    try:
        load_config = LoadConfig(load_format=load_format, model_loader_extra_config=dict(extra))
        model_config = ModelConfig(path, dtype=dtype)
        loader = get_model_loader(load_config, model_config)
        model = loader.load_model(model_config=model_config, device_config=DeviceConfig(device))
    finally:
        DefaultModelLoader.postprocess_weights = original
    seconds = time.perf_counter() - start
    digests = {**loaded, **({} if "post_error" in state else parameter_digests(model))}
    report = fastload_report(loader)
    out = {"digests": digests, "report": report, "seconds": round(seconds, 3), "loader": type(loader).__name__}
    if "post_error" in state:
        out["post_error"] = state["post_error"]
    state.clear()
    del model
    return out


def rank_main(rank: int, tp: int, port: int, out_dir: str, paths: list[str], modes: dict, dtype: str,
              more: dict | None = None) -> None:
    """One rank: SGLang's distributed state once, then every checkpoint in every mode; results go
    to ``out_dir/rank{rank}.json`` after each checkpoint (a crash keeps what was done)."""
    device = setup_rank(rank, tp, port)
    try:
        load_every_checkpoint(rank, out_dir, paths, modes, more,
                              lambda path, load_format, extra: load_and_digest(path, load_format, extra, dtype, device))
    finally:
        teardown_rank()


def teardown_rank() -> None:
    """SGLang's parallel groups destroyed: rank 0 then unlinks the shared-memory queue they hold,
    which otherwise outlives the rank (Python's resource tracker reports it as leaked)."""
    import gc

    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
