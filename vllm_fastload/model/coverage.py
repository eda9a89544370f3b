"""Whether the ranks of a group together take every element of each checkpoint tensor they use.

The engines' slicing loaders narrow whatever they are given, so a ``k_proj`` with rows too many
loads without a word under their default loaders, at every TP. On one rank a tensor the model
takes only part of can only be a checkpoint that does not match the model (``rank``'s own check).
With several ranks each takes a part by design, and no rank sees the others: each says what it
takes of each tensor (``Use``), the group's ranks gather that, and a tensor whose parts leave
indices out is the same error on every rank. Where the engine splits a tensor by design beyond the
group (experts spread over data-parallel ranks), the adapter leaves the check out.

What is known exactly: narrows (a write that takes the tensor, or one range of it along one dim,
unchanged: what column- and row-parallel layers, vocabulary shards, fused q/k/v and gate/up parts,
replicated KV heads and experts take). Writes of any other shape (a transposed Conv1D weight, a
per-head interleave) are not judged across ranks: such a tensor is passed over, never refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm_fastload import CheckpointError, TensorInfo
from vllm_fastload.model.probe import Placement
from vllm_fastload.tensors import shape_of


@dataclass(frozen=True)
class Use:
    """What one rank's writes take of one checkpoint tensor: all of it (``dim`` None), ``spans``
    ``[start, stop)`` along ``dim``, or something not a narrow (``known`` False: not judged)."""

    dim: int | None
    spans: tuple[tuple[int, int], ...] = ()
    known: bool = True


WHOLE = Use(None)
UNKNOWN = Use(None, known=False)


def uses(placements: Mapping[str, Sequence[Placement]], infos: Mapping[str, TensorInfo]) -> dict[str, Use]:
    """What this rank's writes (the probe's placements) take of each checkpoint tensor."""
    found: dict[str, Use] = {}
    for name, writes in placements.items():
        shape = shape_of(infos[name])
        narrows = [p.narrow(shape) for p in writes]
        if any(n is not None and n.dim is None for n in narrows):
            found[name] = WHOLE
        elif any(n is None for n in narrows) or len({n.dim for n in narrows if n is not None}) != 1:
            found[name] = UNKNOWN
        else:
            dim = next(n.dim for n in narrows if n is not None)
            found[name] = Use(dim, _merged((n.start, n.start + n.length) for n in narrows if n is not None))
    return found


def check_taken_whole(everyone: Sequence[Mapping[str, Use]], infos: Mapping[str, TensorInfo],
                      mine: Mapping[str, Sequence[Placement]], group: str) -> None:
    """Raise a ``CheckpointError`` naming the file, the tensor and both shapes for the first
    tensor (by name) the ranks' ``everyone`` uses take only part of, together; ``mine`` (this
    rank's placements) names the parameter; ``group`` names the ranks in the message."""
    for name in sorted({name for ranks in everyone for name in ranks}):
        taken = [ranks[name] for ranks in everyone if name in ranks]
        if not all(u.known for u in taken) or any(u.dim is None for u in taken) or len({u.dim for u in taken}) != 1:
            continue
        dim = taken[0].dim
        assert dim is not None
        info = infos[name]
        size = shape_of(info)[dim]
        spans = _merged(span for u in taken for span in u.spans)
        if spans == ((0, size),):
            continue
        where = ", ".join(f"[{a}, {b})" for a, b in spans)
        params = ", ".join(f"{p.parameter} {list(p.dest.shape)}" for p in mine.get(name, ()))
        raise CheckpointError(
            f"checkpoint tensor has shape {list(info.shape)} but the {group} together take only {where} of its "
            f"dim {dim} (of {size}; on this rank into {params or 'no parameter'}): the checkpoint does not match "
            "the model", file=info.file, tensor=name)


def _merged(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` spans sorted, and those that touch or overlap merged."""
    out: list[list[int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        elif stop > start:
            out.append([start, stop])
    return tuple((a, b) for a, b in out)
