"""Importable from vLLM's worker processes (the tests put this folder on PYTHONPATH)."""

import json
import os


def record_layer(event) -> None:
    """on_layer_ready callback: append the event to $FASTLOAD_DEV_TEST_EVENTS.<rank>."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{os.environ['FASTLOAD_DEV_TEST_EVENTS']}.{rank}", "a") as f:
        f.write(json.dumps({"layer": event.layer, "name": event.name, "tensors": event.tensors,
                            "bytes": event.bytes, "elapsed_s": event.elapsed_s,
                            "layers_done": event.layers_done, "layers_total": event.layers_total}) + "\n")


def fail_on_rank_1(event) -> None:
    """on_layer_ready callback that breaks rank 1 only, to prove rank 0 is not left waiting."""
    _fail_on_rank_1(event, 1)


def fail_on_rank_1_at_layer_0(event) -> None:
    """As ``fail_on_rank_1``, a layer earlier: in a two-layer model with ``dp_exchange``, rank 0 is
    then waiting in layer 1's exchange, the last one (the head's goes with the embeddings)."""
    _fail_on_rank_1(event, 0)


def _fail_on_rank_1(event, layer: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1 and event.layer == layer:
        raise RuntimeError(f"injected failure on rank 1 while loading layer {layer}")


def worker_identity(model) -> dict:
    """``apply_model`` function: which process this rank is, whether it is a Ray actor, and
    whether the fastload plugin got registered there through the entry point."""
    import sys

    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    actor_id = None
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            actor_id = ray.get_runtime_context().get_actor_id()
    loader = _LOAD_FORMAT_TO_MODEL_LOADER.get("fastload")
    return {"pid": os.getpid(), "ray_actor_id": actor_id,
            "fastload_loader": f"{loader.__module__}.{loader.__name__}" if loader else None}


def write_digests_after_load(out_dir: str) -> None:
    """Wrap ``BaseModelLoader.load_model`` (once per process): each rank writes its parameter
    digests to ``out_dir/rank<N>.json`` when its model is loaded and post-processed, and to
    ``out_dir/rank<N>.loaded.json`` as it was loaded, before vLLM's post-processing (which on some
    CPUs packs a linear layer's weight into a kernel's own buffer and leaves the parameter empty)."""
    import functools

    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model
    if getattr(original, "_fastload_digests", False):
        return
    post = base_loader.process_weights_after_loading

    def write(model, suffix: str) -> None:
        import torch.distributed as dist

        from vllm_fastload.tools.digests import parameter_digests

        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(out_dir, f"rank{rank}{suffix}.json"), "w") as f:
            json.dump(parameter_digests(model), f)

    @functools.wraps(post)
    def process_weights_after_loading(model, *args, **kwargs):
        write(model, ".loaded")
        return post(model, *args, **kwargs)

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        write(model, "")
        return model

    load_model._fastload_digests = True
    base_loader.BaseModelLoader.load_model = load_model
    base_loader.process_weights_after_loading = process_weights_after_loading
