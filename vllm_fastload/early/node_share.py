"""The node's share of a checkpoint: the byte ranges the ranks of one node of a multi-node start
will read, so that early reads on that node read those and no more.

On one machine every rank shares one page cache and early reads read every file. Across nodes,
each node's ranks hold part of the model: the transformer layers of their pipeline stages, the
input embeddings on the first stage and the head on the last (the embeddings too where the head
is tied to them), their experts where expert parallelism is on, and their slices of each tensor
where a tensor-parallel group spans nodes. Early reads start before any model exists, so the
share is found from tensor names and the checkpoint's headers: ``layers.layer_key`` places a
tensor in a layer, ``experts.<n>.`` names its expert, and the usual Megatron split by module
name (``split_dim``) gives a tensor-parallel rank's rows.

What that knows exactly: the layers, the embeddings and head, the experts (given the layout the
engine computes, ``RankHolding``). What it estimates: tensor-parallel slices, which only the
model's own weight loaders know (the rank's load learns them by its probe). A tensor whose module
the split rules do not name is read whole, and so is a row-parallel weight, whose slice is part of
every row (interleaved with the other ranks' columns, as a network filesystem reads it anyway). A
vocabulary (the embeddings, the head) is split as the engines split it: padded first, so that the
first ranks hold more rows than an even split gives them.
An estimate errs only in what is read early, never in what is loaded: each rank plans its reads
from the model and reads what the page cache lacks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_fastload.format import TensorInfo
from vllm_fastload.layers import EMBEDDINGS, LAYER, layer_key
from vllm_fastload.sizes import ceil_div

#: Modules whose weights (and biases) tensor parallelism splits along dim 0 (column-parallel).
COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "w1", "w3",
          "embed_tokens", "lm_head", "query_key_value", "c_fc", "fc1", "wte")
#: Modules whose 2-D weights tensor parallelism splits along dim 1 (row-parallel); their biases are whole.
ROW = ("o_proj", "down_proj", "w2", "dense", "c_proj", "fc2", "out_proj")
#: The column-parallel modules that are a vocabulary: the engines pad it before splitting it
#: (``NodeLayout.vocab_padding``), so a rank's rows start at a multiple of the padded share.
VOCAB = ("embed_tokens", "lm_head", "wte")
#: What vLLM and SGLang pad a vocabulary to a multiple of (their ``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64

#: ``...experts.7.w1.weight``: the expert a tensor belongs to (not ``shared_experts.``).
_EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@dataclass(frozen=True)
class FileRanges:
    """Byte ranges of one file to read early: ``spans`` of ``[start, end)``, sorted and disjoint."""

    path: str
    spans: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """The bytes the spans cover."""
        return sum(end - start for start, end in self.spans)


def coalesce(spans: Iterable[tuple[int, int]], gap: int) -> tuple[tuple[int, int], ...]:
    """``spans`` sorted, empty ones dropped, and those at most ``gap`` bytes apart (or overlapping)
    merged into one."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


def split_dim(name: str, ndim: int) -> int | None:
    """The dim tensor parallelism splits a checkpoint tensor along, by its module's name (None: whole)."""
    module = _module(name)
    if module in COLUMN:
        return 0
    if module in ROW and name.rsplit(".", 1)[-1] == "weight" and ndim == 2:
        return 1
    return None


def _module(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def expert_of(name: str) -> int | None:
    """The expert a tensor belongs to, by its name (None: not an expert's)."""
    match = _EXPERT_RE.search(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RankHolding:
    """What one rank holds of the model, as the engine's configuration lays it out."""

    #: The transformer layers of its pipeline stage.
    layers: range
    #: It holds the input embeddings (the first stage).
    embeddings: bool
    #: It holds the final norm and the head (the last stage).
    head: bool
    tp_rank: int = 0
    tp_size: int = 1
    #: The experts it holds whole (expert parallelism); None: every expert, split like other weights.
    experts: frozenset[int] | None = None
    #: Its data-parallel rank, where experts spread over data-parallel ranks too (else 0 of 1).
    dp_rank: int = 0
    dp_size: int = 1


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of one node of a start that spans several."""

    node: int
    nodes: int
    ranks: tuple[RankHolding, ...]
    #: The model's transformer layers, and experts per MoE layer (0: not an MoE model).
    layers_total: int
    experts_total: int = 0
    #: The head is tied to the input embeddings (no head tensor of its own): the last stage reads them.
    tied_embeddings: bool = False
    #: The multiple the engine pads a vocabulary to before splitting it among tensor-parallel ranks.
    vocab_padding: int = VOCAB_PADDING
    #: The ranks of each data-parallel group read what they hold alike in blocks of rows, one
    #: each (``dp_exchange``): a rank's part of such a tensor is its block (``model.exchange``).
    alike_in_blocks: bool = False

    def describe(self) -> str:
        """What the node's ranks hold, for the early-reads log line."""
        layers = sorted({i for r in self.ranks for i in r.layers})
        parts = [f"layers {_spans_text(layers)} of {self.layers_total}" if layers else "no layers"]
        if any(r.embeddings or (self.tied_embeddings and r.head) for r in self.ranks):
            parts.append("the embeddings")
        if any(r.head for r in self.ranks):
            parts.append("the head")
        tp = {r.tp_size for r in self.ranks}
        tp_ranks = sorted({r.tp_rank for r in self.ranks})
        if max(tp) > 1 and len(tp_ranks) < max(tp):
            parts.append(f"tensor-parallel ranks {_spans_text(tp_ranks)} of {max(tp)} (rows estimated by tensor names)")
        return f"node {self.node} of {self.nodes} holds " + ", ".join(parts + self._expert_parts())

    def _expert_parts(self) -> list[str]:
        """The data-parallel ranks and experts of the node, where experts are placed."""
        parts = []
        dp = max((r.dp_size for r in self.ranks), default=1)
        if dp > 1:
            parts.append(f"data-parallel ranks {_spans_text(sorted({r.dp_rank for r in self.ranks}))} of {dp}")
        if all(r.experts is not None for r in self.ranks) and self.experts_total:
            experts = sorted(set().union(*(r.experts or () for r in self.ranks)))
            parts.append(f"experts {_spans_text(experts)} of {self.experts_total}")
        return parts


@dataclass(frozen=True)
class NodeShare:
    """The byte ranges a node reads early, and how much of the checkpoint they are."""

    ranges: tuple[FileRanges, ...]
    #: Bytes of tensors (or of their estimated slices) the node's ranks hold.
    held: int
    #: Tensor bytes of the checkpoint, and of its tensors outside the transformer layers (the
    #: embeddings and the head, which are not split by pipeline stage).
    total: int
    total_outside_layers: int
    #: Bytes of the ranges that fall in tensors outside the layers.
    read_outside_layers: int

    @property
    def read(self) -> int:
        """Bytes the ranges cover (headers and coalesced gaps included)."""
        return sum(r.nbytes for r in self.ranges)

    @property
    def layer_share(self) -> float:
        """The ranges' share of the checkpoint's layers: bytes read, the embeddings and head aside,
        against the bytes of the layers."""
        layers = self.total - self.total_outside_layers
        return (self.read - self.read_outside_layers) / layers if layers else 0.0


def node_share(tensors: Mapping[str, TensorInfo], headers: Mapping[str, int], layout: NodeLayout, *,
               gap: int) -> NodeShare:
    """The ranges of each file that ``layout``'s ranks read: the header (``headers``: file -> its
    data offset) and the tensors, or estimated slices of them, the node's ranks hold; ranges at
    most ``gap`` bytes apart read as one (``coalesce``)."""
    spans: dict[str, list[tuple[int, int]]] = {file: [(0, offset)] for file, offset in headers.items()}
    outside: dict[str, list[tuple[int, int]]] = {}
    held = 0
    for name, info in tensors.items():
        if layer_key(name).stage != LAYER:
            outside.setdefault(info.file, []).append((info.start, info.end))
        parts = coalesce((part for rank in layout.ranks for part in _rank_part(name, info, rank, layout)), 0)
        held += sum(end - start for start, end in parts)
        spans.setdefault(info.file, []).extend(parts)
    ranges = tuple(FileRanges(file, coalesce(found, gap)) for file, found in sorted(spans.items()))
    read_outside = sum(_overlap(r.spans, outside.get(r.path, ())) for r in ranges)
    return NodeShare(ranges=ranges, held=held, total=sum(i.nbytes for i in tensors.values()),
                     total_outside_layers=sum(end - start for found in outside.values() for start, end in found),
                     read_outside_layers=read_outside)


def _overlap(spans: Iterable[tuple[int, int]], others: Iterable[tuple[int, int]]) -> int:
    """Bytes that ``spans`` and ``others`` (each disjoint within itself) have in common."""
    others = list(others)
    return sum(max(0, min(end, o_end) - max(start, o_start)) for start, end in spans for o_start, o_end in others)


def _rank_part(name: str, info: TensorInfo, rank: RankHolding, layout: NodeLayout) -> Iterable[tuple[int, int]]:
    """The byte range(s) of ``info`` that ``rank`` holds: none, all of it, or its estimated rows."""
    key = layer_key(name)
    expert = expert_of(name)
    if key.stage == LAYER:
        if key.index not in rank.layers:
            return ()
        if expert is not None and rank.experts is not None:
            return () if expert not in rank.experts else ((info.start, info.end),)  # held whole (EP)
    elif key.stage == EMBEDDINGS:
        if not (rank.embeddings or (layout.tied_embeddings and rank.head)):
            return ()
    elif not rank.head:
        return ()
    dim = split_dim(name, len(info.shape)) if rank.tp_size > 1 and info.shape else None
    if dim not in (None, 0) or not info.shape:
        return ((info.start, info.end),)
    rows = info.shape[0]
    row_bytes = info.nbytes // max(rows, 1)
    first, last = 0, rows
    if dim == 0:
        padding = layout.vocab_padding if _module(name) in VOCAB else 1
        block = ceil_div(ceil_div(rows, padding) * padding, rank.tp_size)
        first = min(rows, rank.tp_rank * block)
        last = min(rows, first + block)
    if layout.alike_in_blocks and rank.dp_size > 1 and expert is None and last - first >= rank.dp_size:
        # its block of the rows every rank of its data-parallel group takes alike (as ``exchange._split_rows``)
        count = last - first
        first, last = first + count * rank.dp_rank // rank.dp_size, first + count * (rank.dp_rank + 1) // rank.dp_size
    return ((info.start + first * row_bytes, info.start + last * row_bytes),)


def _spans_text(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for value in values:
        if out and value == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-', 1)[0]}-{value}"
        else:
            out.append(str(value))
    return ", ".join(out)
