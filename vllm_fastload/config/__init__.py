"""fastload's configuration: one validated object, where each value came from, and the defaults
that depend on where a load runs.

- ``schema``: ``FastloadConfig``, every field with its rules;
- ``env``: the ``FASTLOAD_*`` environment, as the config reads it;
- ``remote``: ``RemoteConfig``, how to talk to an object store;
- ``resolution``: the effective config of a load (``resolve``; ``ConfigFacts``: a network
  filesystem, the rank's CPUs, every rank reading every tensor whole).
"""

from vllm_fastload.config.remote import RemoteConfig
from vllm_fastload.config.resolution import ConfigFacts, resolve
from vllm_fastload.config.schema import CHOSEN, FastloadConfig, LayerCallback, Origin, default_threads
from vllm_fastload.errors import ConfigError

__all__ = ["CHOSEN", "ConfigError", "ConfigFacts", "FastloadConfig", "LayerCallback", "Origin", "RemoteConfig",
           "default_threads", "resolve"]
