"""The effective config of a load: the user's choices, and the defaults that depend on where it runs.

One place turns a ``FastloadConfig`` and what is known of the load (``ConfigFacts``) into the
config a load reads with: a field the user chose (in the environment, the engine's options or the
caller's values) is never changed; a field left to its default takes the default the facts call
for (``policy``'s decisions), and says so (``FastloadConfig.origin``). The result is validated
like any config, so a derived value that breaks a rule (``read_size`` over ``aggregate_size``) is
the same ``ConfigError``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_fastload import policy
from vllm_fastload.config.schema import FastloadConfig, Origin

logger = logging.getLogger("vllm_fastload")


@dataclass(frozen=True)
class ConfigFacts:
    """What is known of a load where its config is resolved; each default says what it changes."""

    #: The checkpoint's files are on a network filesystem (``machine.is_network``):
    #: ``policy.filesystem_defaults``.
    network: bool = False
    #: The CPUs the engine bound this rank to (vLLM-CPU, ``vllm_plugin.cpus``): the reader's threads
    #: run there (``cpus``), as many as those CPUs want (``policy.default_threads``).
    rank_cpus: tuple[int, ...] | None = None
    #: How many ranks on this machine read every tensor whole (no per-rank plan): with several,
    #: ``policy.whole_reads_direct_io``.
    whole_reads: int | None = None


def resolve(config: FastloadConfig, facts: ConfigFacts) -> FastloadConfig:
    """``config`` with the defaults ``facts`` call for in the fields no user chose (itself where
    that changes nothing)."""
    updates: dict[str, tuple[Any, Origin]] = {}
    free = {name for name in type(config).model_fields if not config.is_set(name)}
    for name, value in policy.filesystem_defaults(network=facts.network, set_fields=set(type(config).model_fields)
                                                  - free).items():
        updates[name] = (value, "filesystem")
    if facts.rank_cpus is not None and "cpus" in free:
        updates["cpus"] = (tuple(facts.rank_cpus), "rank")
        if "threads" in free:
            updates["threads"] = (max(config.threads, policy.default_threads(len(facts.rank_cpus))), "rank")
    if facts.whole_reads is not None:
        direct_io = policy.whole_reads_direct_io(config.direct_io, world=facts.whole_reads)
        if direct_io != config.direct_io:  # (only 'auto' changes, chosen or not)
            updates["direct_io"] = (direct_io, "whole reads")
    updates = {name: (value, origin) for name, (value, origin) in updates.items() if getattr(config, name) != value}
    if not updates:
        return config
    logger.debug("fastload: config for this load: %s",
                 ", ".join(f"{name}={value} ({origin})" for name, (value, origin) in updates.items()))
    values = {**dict(config), **{name: value for name, (value, _) in updates.items()}}
    origins = {**config.origins, **{name: origin for name, (_, origin) in updates.items()}}
    return FastloadConfig._validated(values, {}, lambda loc: None, "caller", origins)
