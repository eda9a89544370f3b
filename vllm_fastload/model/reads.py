"""From the probe's recorded writes to this rank's reads, and from the bytes read into the parameters.

Per checkpoint tensor, one of:
- **direct**: every write takes the whole tensor or one narrow of it, and no two overlap: each is
  read straight into its parameter region (through a buffer and ``copy_`` where the region is
  not contiguous, or has another dtype);
- **slabs**: anything else (transposed, reshaped or interleaved sources, overlapping writes): the
  cheapest slabs that hold what the writes take (``geometry.plan_slabs``) are read into buffers
  and the recorded copies replayed from them;
- **not read**: no write on this rank takes it.

The plan is checked before a byte is read (``RankReads.check``): no tensor is read beyond its
size, so a rank never reads more than the tensors it keeps. Each replay checks the slab it gets
against the one planned. A failed check is a ``PlanError`` naming the parameter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_fastload.errors import CheckpointError, PlanError
from vllm_fastload.format import TensorInfo
from vllm_fastload.model.geometry import LayoutError, SlabView, plan_slabs
from vllm_fastload.model.probe import Narrow, Placement, ProbeResult
from vllm_fastload.plan import Plan, TensorRequest, plan_tensor
from vllm_fastload.tensors import CASTABLE, dtype_of, shape_of


@dataclass(frozen=True)
class Replay:
    """A recorded write, performed from the slab read for it: the write, and its view of the slab."""

    placement: Placement
    view: SlabView


@dataclass(frozen=True)
class RankReads:
    """What one rank reads, and how each byte reaches its parameter."""

    infos: Mapping[str, TensorInfo]
    #: checkpoint tensor -> the writes the probe recorded from it on this rank.
    writes: Mapping[str, tuple[Placement, ...]]
    #: Read straight into the parameter region (or copied into it from a buffer).
    targets: Mapping[TensorRequest, torch.Tensor]
    #: Read into buffers; the writes in ``replays[key]`` are replayed from each.
    slabs: tuple[TensorRequest, ...]
    replays: Mapping[str, tuple[Replay, ...]]
    whole: int = 0
    sliced: int = 0
    replayed: int = 0

    @property
    def kept_bytes(self) -> int:
        """Checkpoint bytes this rank's parameters take: the floor for the bytes it reads (a region
        taken by several writes counts once per write, up to the tensor's size)."""
        total = 0
        for name, placements in self.writes.items():
            info = self.infos[name]
            used = min(sum(math.prod(p.src_shape) for p in placements), info.numel)
            total += used * info.nbytes // max(info.numel, 1)
        return total

    def check(self, plan: Plan) -> None:
        """No checkpoint tensor is read beyond its size (a per-rank plan reads at most the tensors
        it keeps, never more than the checkpoint), and every tensor read is one this rank uses."""
        read: dict[str, int] = {}
        for t in plan.tensors:
            read[t.info.name] = read.get(t.info.name, 0) + t.read_bytes
        for name, nbytes in read.items():
            info = self.infos[name]
            if name not in self.writes:
                raise PlanError("this rank's plan reads a tensor no parameter of the rank takes", file=info.file,
                                tensor=name)
            if nbytes > info.nbytes:
                raise PlanError(f"this rank's plan reads {nbytes} bytes of a {info.nbytes}-byte tensor (for "
                                f"{self.describe(name)}): a plan never reads a tensor more than once", file=info.file,
                                tensor=name)

    def paths(self, strategies: Mapping[str, int]) -> dict[str, int]:
        """How many tensors took each path: read whole or sliced into parameters, read as slabs (of
        which as the whole tensor), and the read ``strategies`` of the plan that ran
        (``Plan.strategy_counts``)."""
        whole_slabs = sum(1 for req in self.slabs if req.dim is None)
        return {"whole": self.whole, "sliced": self.sliced, "slab": self.replayed, "slab:whole": whole_slabs,
                **strategies}

    def describe(self, name: str) -> str:
        params = sorted({p.parameter for p in self.writes.get(name, [])})
        return ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "") or "no parameter"

    def replay(self, key: str, slab: torch.Tensor) -> None:
        """Perform the writes planned on the slab read for ``key``."""
        for r in self.replays[key]:
            p = r.placement
            try:
                p.replay(slab, r.view)
            except LayoutError as exc:
                info = self.infos[p.source]
                raise PlanError(f"parameter {p.parameter}: {exc}", file=info.file, tensor=info.name) from None

    def summary(self, checkpoint_tensors: int) -> str:
        skipped = checkpoint_tensors - len(self.writes)
        return (f"{self.whole} whole and {self.sliced} sliced reads into parameters, {self.replayed} tensors read "
                f"in slabs and copied by the model's recorded slicing, {skipped} checkpoint tensors not needed on "
                "this rank")


def plan_reads(probe: ProbeResult, infos: Mapping[str, TensorInfo], strided_min_skip: int) -> RankReads:
    """This rank's reads for the writes ``probe`` recorded; ``strided_min_skip`` as the reader
    will use it (it decides what a slice along a later dim costs)."""
    targets: dict[TensorRequest, torch.Tensor] = {}
    slabs: list[TensorRequest] = []
    replays: dict[str, tuple[Replay, ...]] = {}
    replayed = 0
    for name, placements in probe.placements.items():
        info = infos[name]
        requests = _direct_requests(info, placements, name)
        if requests is not None:
            targets.update(requests)
            continue
        replayed += 1

        def read_cost(dim: int | None, start: int, length: int, info: TensorInfo = info) -> int:
            return plan_tensor(info, _request(info, dim, start, length), strided_min_skip).read_bytes

        for j, slab in enumerate(plan_slabs(shape_of(info), [p.view for p in placements], read_cost)):
            key = f"{name}#slab{j}"
            slabs.append(_request(info, slab.dim, slab.start, slab.length, key))
            replays[key] = tuple(Replay(placements[m.write], m.view) for m in slab.members)
    whole = sum(1 for req in targets if req.dim is None)
    return RankReads(infos, probe.placements, targets, tuple(slabs), replays, whole=whole,
                     sliced=len(targets) - whole, replayed=replayed)


def _direct_requests(info: TensorInfo, placements: Sequence[Placement],
                     name: str) -> list[tuple[TensorRequest, torch.Tensor]] | None:
    """Each write as a request read into its parameter region, or None where one is not a whole
    tensor or narrow, cannot take the checkpoint's dtype, or two overlap (read once, as a slab)."""
    native = dtype_of(info)
    shape = shape_of(info)
    narrows = []
    for p in placements:
        check_dtype(info, native, p)
        narrow = p.narrow(shape)
        if narrow is None or (p.dest.dtype != native and not (p.dest.dtype in CASTABLE and native in CASTABLE)):
            return None
        narrows.append(narrow)
    if not _disjoint(narrows):
        return None
    return [(_request(info, n.dim, n.start, n.length, f"{name}#{i}"), p.dest)
            for i, (n, p) in enumerate(zip(narrows, placements))]


def _disjoint(narrows: list[Narrow]) -> bool:
    """Whether narrows of one tensor share no element (narrows along different dims always may)."""
    if len(narrows) < 2:
        return True
    if len({n.dim for n in narrows}) != 1 or narrows[0].dim is None:
        return False
    spans = sorted((n.start, n.start + n.length) for n in narrows)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def _request(info: TensorInfo, dim: int | None, start: int, length: int, key: str | None = None) -> TensorRequest:
    """A request in the checkpoint's units from a narrow in torch's: torch holds two F4 values per
    element, so along an F4 tensor's last dim the checkpoint counts twice as many."""
    if dim is None:
        return TensorRequest(info.name, key=key)
    if info.dtype == "F4" and dim == len(info.shape) - 1:
        start, length = 2 * start, 2 * length
    return TensorRequest(info.name, dim=dim, start=start, length=length, key=key)


def check_dtype(info: TensorInfo, native: torch.dtype, p: Placement) -> None:
    """Refuse what would be silently wrong: e.g. integer or fp8 data into a bf16 parameter."""
    target = p.dest.dtype
    if target == native or (target in CASTABLE and native in CASTABLE):
        return
    raise CheckpointError(f"checkpoint dtype {info.dtype} does not match parameter {p.parameter} "
                          f"({str(target).removeprefix('torch.')})", file=info.file, tensor=info.name)

