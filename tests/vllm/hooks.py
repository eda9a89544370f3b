"""Importable from vLLM's worker processes (the tests put this folder on PYTHONPATH)."""

import json
import os


def record_layer(event) -> None:
    """on_layer_ready callback: append the event to $FASTLOAD_TEST_EVENTS.<rank>."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{os.environ['FASTLOAD_TEST_EVENTS']}.{rank}", "a") as f:
        f.write(json.dumps({"layer": event.layer, "name": event.name, "tensors": event.tensors,
                            "bytes": event.bytes, "elapsed_s": event.elapsed_s,
                            "layers_done": event.layers_done, "layers_total": event.layers_total}) + "\n")


def fail_on_rank_1(event) -> None:
    """on_layer_ready callback that breaks rank 1 only, to prove rank 0 is not left waiting."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1 and event.layer == 1:
        raise RuntimeError("injected failure on rank 1 while loading layer 1")
