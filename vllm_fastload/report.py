"""``LoadReport``: what one rank's load did, whichever engine adapter ran it.

Each adapter logs its ``line`` and keeps it as ``report`` on its loader (TGI's ``FastWeights`` too);
the tests and ``vllm-fastload verify`` read it (across processes as ``as_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_fastload import policy
from vllm_fastload.frozen import FrozenMap, frozen_map


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load did."""

    rank: int
    world: int
    #: Read by a per-rank plan (False: every tensor whole through ``load_weights``, or left to the
    #: engine's default loader).
    planned: bool
    #: Why not planned (None where it was).
    fallback_reason: str | None = None
    #: Parameter names the model's ``load_weights`` reported (None: it reports none, or fastload
    #: did not load).
    loaded: frozenset[str] | None = None
    bytes_read: int = 0
    #: The bytes of the checkpoint the rank's parameters take (None: not known, not planned).
    bytes_kept: int | None = None
    bytes_total: int = 0
    #: The reader backend (None: fastload did not read).
    backend: policy.Backend | None = None
    seconds: float = 0.0
    summary: str = ""
    #: How many tensors took each way in (see ``reads.RankReads.paths``; "load_weights": read
    #: whole and handed to the model, "exchange": shared row reads).
    paths: Mapping[str, int] = field(default_factory=FrozenMap)
    #: Seconds of the load's parts: "probe" (learning the writes), "plan", "check" (the plan's
    #: checks), "read" (reading into the parameters, replays included), "replay" (of which replays),
    #: "post" (telling the listener, post-processing included).
    phases: Mapping[str, float] = field(default_factory=FrozenMap)
    #: The share of the checkpoint in the page cache as the load began (early reads, or a warm
    #: cache); None where it cannot be told (object stores).
    cached: float | None = None
    #: The share of the bytes this rank's plan reads (its own slices, not the tensors they are cut
    #: from) in the page cache as its reads began (None: no plan, or it cannot be told); where nodes
    #: read only their share early, the figure that says whether those reads served this rank.
    own_cached: float | None = None
    #: Parameters no checkpoint write reached on the planned path (``ProbeResult.never_written``).
    never_written: tuple[str, ...] = ()
    #: Modules post-processed as their layer completed (vLLM's ``post_per_layer``).
    post_processed: int = 0
    #: The CPUs the reader's threads ran on, where the engine bound this rank's (vLLM-CPU); None:
    #: where the loading thread may run.
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Read-only copies: a report must not change under its holder (nor with the rank's own dicts).
        object.__setattr__(self, "paths", frozen_map(self.paths))
        object.__setattr__(self, "phases", frozen_map(self.phases))

    @classmethod
    def left_to_engine(cls, rank: int, world: int, reason: str) -> LoadReport:
        """A load the engine's default loader did, and why."""
        return cls(rank=rank, world=world, planned=False, fallback_reason=reason)

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain values (JSON), for tools that load in other processes."""
        out = dataclasses.asdict(self)
        out.update(loaded=None if self.loaded is None else sorted(self.loaded), paths=dict(self.paths),
                   phases=dict(self.phases), never_written=list(self.never_written),
                   cpus=None if self.cpus is None else list(self.cpus))
        return out

    def line(self) -> str:
        """The rank's log line."""
        share = self.bytes_read / max(self.bytes_total, 1)
        kept = (f", {self.bytes_read / self.bytes_kept:.3f}x the {self.bytes_kept / 1e6:.1f} MB it keeps"
                if self.bytes_kept else "")
        phases = ", ".join(f"{k} {v:.3f}" for k, v in self.phases.items())
        cached = f"; {self.cached:.0%} of it in the page cache as the load began" if self.cached is not None else ""
        if self.cached is not None and self.own_cached is not None:
            cached += f" ({self.own_cached:.0%} of the bytes this rank reads)"
        post = f"; {self.post_processed} modules post-processed as their layer completed" if self.post_processed else ""
        cpus = f"; reader threads on CPUs {','.join(map(str, self.cpus))}" if self.cpus else ""
        return (f"fastload rank {self.rank}/{self.world}: read {self.bytes_read / 1e6:.1f} MB of "
                f"{self.bytes_total / 1e6:.1f} MB checkpoint ({share:.3f}{kept}) with backend {self.backend} in "
                f"{self.seconds:.2f} s ({self.bytes_read / max(self.seconds, 1e-9) / 1e9:.2f} GB/s; seconds: "
                f"{phases}{cached}); {self.summary}{post}{cpus}")
