"""Loading one rank of a model, for any engine whose layers slice with their own weight loaders.

What the engine adapters (``vllm_plugin``, ``sglang_plugin``) share, knowing neither engine; with
the package root, the only part of ``vllm_fastload`` an adapter imports (``__all__``):

- ``rank``: open, probe, plan, read (layer events, progress bar, row exchange at TP>1), replay,
  or read everything whole through ``load_weights`` where the probe cannot describe the model
  (``load_rank``); ``options``: the config an engine's loader runs with (``loader_config``);
- ``probe``: run the model's ``load_weights`` on placeholders and record every write, so the
  engine's own code says which bytes of which checkpoint tensor land where on this rank;
- ``geometry`` and ``reads``: from those writes to the fewest bytes to read, and back;
- ``exchange``: the row exchange's swaps between the ranks of a tensor-parallel group
  (``Collectives``: what it needs of the group);
- early reads (``vllm_fastload.early``): ``start_early_reads`` where the engine has its
  configuration, ``loading`` around each rank's load.

What differs between engines (the model's construction, the distributed groups, the completeness
check, the default loader to fall back to) is passed in by the adapter.

Names are imported on first use (PEP 562), as at the package root: SGLang runs its plugins'
``register`` in every process it starts, whatever the load format, and registering needs only
``missing_targets``; the configuration and the loading code come in where a rank loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "EarlyStart": "vllm_fastload.early.decide", "start_early_reads": "vllm_fastload.early.decide:start",
    "loading": "vllm_fastload.early.marks",
    "NodeLayout": "vllm_fastload.early.node_share", "RankHolding": "vllm_fastload.early.node_share",
    "missing_targets": "vllm_fastload.events",
    "Collectives": "vllm_fastload.model.exchange",
    "loader_config": "vllm_fastload.model.options",
    "LoadWeights": "vllm_fastload.model.probe", "own_load_weights": "vllm_fastload.model.probe",
    "ParameterListener": "vllm_fastload.model.rank", "load_rank": "vllm_fastload.model.rank",
    "model_device": "vllm_fastload.model.rank",
}

if TYPE_CHECKING:
    from vllm_fastload.early.decide import EarlyStart
    from vllm_fastload.early.decide import start as start_early_reads
    from vllm_fastload.early.marks import loading
    from vllm_fastload.early.node_share import NodeLayout, RankHolding
    from vllm_fastload.events import missing_targets
    from vllm_fastload.model.exchange import Collectives
    from vllm_fastload.model.options import loader_config
    from vllm_fastload.model.probe import LoadWeights, own_load_weights
    from vllm_fastload.model.rank import ParameterListener, load_rank, model_device

__all__ = ["Collectives", "EarlyStart", "LoadWeights", "NodeLayout", "ParameterListener", "RankHolding",
           "load_rank", "loader_config", "loading", "missing_targets", "model_device", "own_load_weights",
           "start_early_reads"]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
