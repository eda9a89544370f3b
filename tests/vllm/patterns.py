"""The write patterns vLLM's weight loaders make, as hypothesis strategies of ``layers.Case``.

Each strategy draws a tensor-parallel size (1-8), shapes (odd sizes, one-element dims, vocab
sizes no rank count divides, fewer kv heads than ranks), a dtype of 1, 2 or 4 bytes and the way
the checkpoint holds the weight (separate shards, one fused tensor, transposed as GPT-2's
Conv1D, interleaved per head as Bloom's, chunked), and returns the checkpoint tensors and a
builder of the vLLM layer that loads them.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from .layers import Case, Tiny, random_tensor

WORLDS = st.integers(1, 8)
#: 1, 2 and 4 bytes; fp8 and int8 as plain data (an unquantized layer of that dtype).
DTYPES = st.sampled_from([torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32])
PREFIX = "model.layers.0."


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _t(source: str) -> bool:
    return source.endswith("_t")


def _add_linear(tensors: dict, key: str, out_f: int, in_f: int, transposed: bool, bias: bool,
                dtype: torch.dtype, gen: torch.Generator) -> None:
    """A linear layer's checkpoint tensors: the weight ((in, out) where stored transposed), then the bias."""
    tensors[key + ".weight"] = random_tensor((in_f, out_f) if transposed else (out_f, in_f), dtype, gen)
    if bias:
        tensors[key + ".bias"] = random_tensor((out_f,), dtype, gen)


@st.composite
def linear(draw) -> Case:
    """Column- or row-parallel linear, weight and bias; the weight narrowed on dim 0 or 1,
    or transposed in the checkpoint (Conv1D) so that the narrow runs across the file's rows."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    world = draw(WORLDS)
    kind = draw(st.sampled_from(["column", "row", "replicated"]))
    in_f = world * draw(st.integers(1, 5)) if kind == "row" else draw(st.integers(1, 24))
    out_f = world * draw(st.integers(1, 5)) if kind == "column" else draw(st.integers(1, 24))
    bias = draw(st.booleans())
    source = draw(st.sampled_from(["plain", "plain_t"]))
    dtype = draw(DTYPES)
    gen = _gen(draw(st.integers(0, 2**16)))
    weight = random_tensor((in_f, out_f) if _t(source) else (out_f, in_f), dtype, gen)
    tensors = {PREFIX + "proj.weight": weight}
    if bias:
        tensors[PREFIX + "proj.bias"] = random_tensor((out_f,), dtype, gen)
    layer_cls = {"column": ColumnParallelLinear, "row": RowParallelLinear, "replicated": ReplicatedLinear}[kind]

    def route(name, w):
        return [(name, w.t() if _t(source) and name == "weight" else w, ())]

    def build() -> Tiny:
        layer = layer_cls(in_f, out_f, bias=bias, params_dtype=dtype, prefix=PREFIX + "proj")
        return Tiny("proj", layer, route)

    return Case(f"linear/{kind}/{source}", world, tensors, build, {"in": in_f, "out": out_f, "bias": bias})


def _kv_heads(draw, world: int, heads: int) -> int:
    """kv heads vLLM accepts: a multiple of the ranks, or a divisor of them (then replicated)."""
    options = [k for k in range(1, heads + 1) if heads % k == 0 and (k % world == 0 or world % k == 0)]
    return draw(st.sampled_from(options))


@st.composite
def qkv(draw) -> Case:
    """QKVParallelLinear: q/k/v as separate tensors or fused (Phi-3), fused and transposed
    (GPT-2's c_attn), or fused and interleaved per head (Bloom); kv heads replicated where there
    are fewer than ranks."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    world = draw(WORLDS)
    heads = world * draw(st.integers(1, 3))
    kv = _kv_heads(draw, world, heads)
    head_size = draw(st.integers(1, 6))
    hidden = draw(st.integers(1, 20))
    source = draw(st.sampled_from(["separate", "separate_t", "fused", "fused_t"] +
                                  (["interleaved"] if kv == heads else [])))
    bias = draw(st.booleans())
    dtype = draw(DTYPES)
    gen = _gen(draw(st.integers(0, 2**16)))
    sizes = {"q": heads * head_size, "k": kv * head_size, "v": kv * head_size}
    tensors = {}
    if source.startswith("separate"):
        for s, n in sizes.items():
            _add_linear(tensors, f"{PREFIX}attn.{s}_proj", n, hidden, _t(source), bias, dtype, gen)
    else:
        _add_linear(tensors, PREFIX + "attn.qkv", sum(sizes.values()), hidden, _t(source), bias, dtype, gen)

    def route(name, w):
        kind = name.rsplit(".", 1)[1]
        if name.endswith(".weight") and _t(source):
            w = w.t()
        if source == "interleaved":  # what vllm's bloom.py does before the fused loader
            shape = w.shape
            w = w.view((heads, 3, -1) + tuple(shape[1:])).transpose(0, 1).reshape(shape)
        if source.startswith("separate"):
            return [(f"qkv_proj.{kind}", w, (name.split(".")[0][0],))]
        return [(f"qkv_proj.{kind}", w, ())]

    def build() -> Tiny:
        layer = QKVParallelLinear(hidden, head_size, heads, kv, bias=bias, params_dtype=dtype,
                                  prefix=PREFIX + "attn.qkv_proj")
        return Tiny("attn", _holder(qkv_proj=layer), route)

    return Case(f"qkv/{source}", world, tensors, build,
                {"heads": heads, "kv": kv, "head_size": head_size, "hidden": hidden, "bias": bias})


@st.composite
def merged(draw) -> Case:
    """MergedColumnParallelLinear (gate_up): shards as separate tensors, fused (Phi-3), fused and
    transposed, or fused and split by the model (``chunk`` for equal halves, ``split`` otherwise)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    world = draw(WORLDS)
    sizes = [world * draw(st.integers(1, 4)) for _ in range(draw(st.integers(2, 3)))]
    hidden = draw(st.integers(1, 20))
    source = draw(st.sampled_from(["separate", "fused", "fused_t", "split"] +
                                  (["chunk"] if len(set(sizes)) == 1 else [])))
    bias = draw(st.booleans())
    dtype = draw(DTYPES)
    gen = _gen(draw(st.integers(0, 2**16)))
    tensors = {}
    if source == "separate":
        for i, n in enumerate(sizes):
            _add_linear(tensors, f"{PREFIX}mlp.part{i}", n, hidden, False, bias, dtype, gen)
    else:
        _add_linear(tensors, PREFIX + "mlp.fused", sum(sizes), hidden, _t(source), bias, dtype, gen)

    def route(name, w):
        kind = name.rsplit(".", 1)[1]
        if source == "separate":
            return [(f"gate_up_proj.{kind}", w, (int(name.split(".")[0].removeprefix("part")),))]
        if _t(source) and kind == "weight":
            w = w.t()
        if source == "chunk":
            return [(f"gate_up_proj.{kind}", part, (i,)) for i, part in enumerate(w.chunk(len(sizes), 0))]
        if source == "split":
            return [(f"gate_up_proj.{kind}", part, (i,)) for i, part in enumerate(w.split(sizes, 0))]
        return [(f"gate_up_proj.{kind}", w, ())]

    def build() -> Tiny:
        layer = MergedColumnParallelLinear(hidden, sizes, bias=bias, params_dtype=dtype,
                                           prefix=PREFIX + "mlp.gate_up_proj")
        return Tiny("mlp", _holder(gate_up_proj=layer), route)

    return Case(f"merged/{source}", world, tensors, build, {"sizes": sizes, "hidden": hidden, "bias": bias})


@st.composite
def vocab(draw) -> Case:
    """VocabParallelEmbedding and ParallelLMHead: vocab padded to 64 and split by rank (sizes no
    rank count divides; a rank may hold only padding)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    world = draw(st.sampled_from([1, 2, 4, 8]))  # vLLM pads the vocab to 64 rows, split evenly by rank
    size = draw(st.integers(1, 300))
    hidden = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["embedding", "lm_head"]))
    dtype = draw(DTYPES)
    gen = _gen(draw(st.integers(0, 2**16)))
    tensors = {PREFIX + "vocab.weight": random_tensor((size, hidden), dtype, gen)}
    cls = VocabParallelEmbedding if kind == "embedding" else ParallelLMHead

    def build() -> Tiny:
        return Tiny("vocab", cls(size, hidden, params_dtype=dtype, prefix=PREFIX + "vocab"),
                    lambda name, w: [(name, w, ())])

    return Case(f"vocab/{kind}", world, tensors, build, {"vocab": size, "hidden": hidden})


@st.composite
def packed_int4(draw) -> Case:
    """GPTQ (int4 packed in int32 down the input dim, transposed) and AWQ (packed across the output
    dim) through vLLM's quantized linear methods: column, row, qkv and merged layers."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.quantization import get_quantization_config

    world = draw(WORLDS)
    method = draw(st.sampled_from(["gptq", "awq"]))
    group = draw(st.sampled_from([32, 64]))  # what vLLM's int4 kernels take (-1, 32, 64, 128)
    kind = draw(st.sampled_from(["column", "row", "qkv", "merged"]))
    in_f = group * (world if kind == "row" else 1) * draw(st.integers(1, 3))
    pack = 8
    unit = 32  # vLLM-CPU's int4 kernel takes output sizes per rank in multiples of 32
    gen = _gen(draw(st.integers(0, 2**16)))
    if kind == "qkv":
        heads = world * draw(st.integers(1, 2))
        kv = _kv_heads(draw, world, heads)
        head_size = unit
        outs = {"q": heads * head_size, "k": kv * head_size, "v": kv * head_size}
    elif kind == "merged":
        outs = {str(i): world * unit * draw(st.integers(1, 2)) for i in range(2)}
    else:
        outs = {"": (world if kind == "column" else 1) * unit * draw(st.integers(1, 3))}
    config = ({"bits": 4, "group_size": group, "desc_act": False, "sym": True} if method == "gptq" else
              {"bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    tensors = {}
    for shard, out in outs.items():
        prefix = f"{PREFIX}q.{shard}." if shard else f"{PREFIX}q."
        qweight = (in_f // pack, out) if method == "gptq" else (in_f, out // pack)
        tensors[prefix + "qweight"] = random_tensor(qweight, torch.int32, gen)
        tensors[prefix + "qzeros"] = random_tensor((in_f // group, out // pack), torch.int32, gen)
        tensors[prefix + "scales"] = random_tensor((in_f // group, out), torch.float16, gen)

    def route(name, w):
        *shard, param = name.split(".")
        if not shard:
            return [(f"proj.{param}", w, ())]
        return [(f"proj.{param}", w, (shard[0] if kind == "qkv" else int(shard[0]),))]

    def build() -> Tiny:
        quant = get_quantization_config(method).from_config(config)
        common = {"bias": False, "quant_config": quant, "params_dtype": torch.float16, "prefix": PREFIX + "q.proj"}
        if kind == "qkv":
            layer = QKVParallelLinear(in_f, head_size, heads, kv, **common)
        elif kind == "merged":
            layer = MergedColumnParallelLinear(in_f, list(outs.values()), **common)
        else:
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            layer = cls(in_f, outs[""], **common)
        return Tiny("q", _holder(proj=layer), route)

    return Case(f"int4/{method}/{kind}", world, tensors, build, {"in": in_f, "outs": outs, "group": group})


@st.composite
def moe(draw) -> Case:
    """Fused MoE experts: per-expert w1/w2/w3 tensors, or the experts stacked in fused 3-D tensors."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    world = draw(WORLDS)
    experts = draw(st.integers(1, 4))
    hidden = 32 * draw(st.integers(1, 2))  # vLLM-CPU's MoE kernels take hidden sizes in multiples of 32
    inter = world * draw(st.integers(1, 3))
    source = draw(st.sampled_from(["per_expert", "stacked"]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    gen = _gen(draw(st.integers(0, 2**16)))
    tensors = {}
    if source == "per_expert":
        for e in range(experts):
            for w in ("w1", "w3"):
                tensors[f"{PREFIX}experts.{e}.{w}.weight"] = random_tensor((inter, hidden), dtype, gen)
            tensors[f"{PREFIX}experts.{e}.w2.weight"] = random_tensor((hidden, inter), dtype, gen)
    else:
        tensors[PREFIX + "experts.w13"] = random_tensor((experts, 2 * inter, hidden), dtype, gen)
        tensors[PREFIX + "experts.w2"] = random_tensor((experts, hidden, inter), dtype, gen)

    def route(name, w):
        return [(None, w, (name,))]

    def build() -> Tiny:
        layer = FusedMoEFactory(num_experts=experts, top_k=1, hidden_size=hidden, intermediate_size=inter,
                                params_dtype=dtype, renormalize=True, prefix=PREFIX + "experts",
                                ckpt_names=("w1", "w2", "w3"))
        return Tiny("experts", layer, route)

    return Case(f"moe/{source}", world, tensors, build, {"experts": experts, "hidden": hidden, "inter": inter})


@st.composite
def computed(draw) -> Case:
    """Loaders that compute on checkpoint data: a model that scales the tensor before the copy, a
    parameter whose loader transforms what it loaded (vLLM's ``composed_weight_loader``, as Mamba's
    ``A = -exp(A_log)``), and a model that zeroes the loaded tensor in place on ranks other than 0
    (as GPT-OSS does with its row-parallel expert bias). The probe cannot describe these as reads,
    so the tensors go through the model's own ``load_weights``: what it computes must be kept."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, sharded_weight_loader
    from vllm.model_executor.utils import set_weight_attrs

    world = draw(WORLDS)
    kind = draw(st.sampled_from(["scaled", "composed", "zeroed"]))
    out_f = world * draw(st.integers(1, 4))
    in_f = draw(st.integers(1, 12))
    gen = _gen(draw(st.integers(0, 2**16)))
    weight = random_tensor((out_f, in_f), torch.float32, gen).clamp(-8, 8).nan_to_num()
    tensors = {PREFIX + "proj.weight": weight}
    if kind == "composed":
        tensors[PREFIX + "proj.A"] = random_tensor((out_f,), torch.float32, gen).clamp(-8, 8).nan_to_num()

    def route(name, w):
        if kind == "scaled":
            return [(name, w * 2, ())]
        if kind == "zeroed" and get_tensor_model_parallel_rank() != 0:
            w = w.zero_()
        return [(name, w, ())]

    def build() -> Tiny:
        layer = ColumnParallelLinear(in_f, out_f, bias=False, params_dtype=torch.float32, prefix=PREFIX + "proj")
        if kind == "composed":
            layer.A = torch.nn.Parameter(torch.empty(out_f // world, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(layer.A, {"weight_loader": composed_weight_loader(
                sharded_weight_loader(0), lambda x: -torch.exp(x.float()))})
        return Tiny("proj", layer, route)

    return Case(f"computed/{kind}", world, tensors, build, {"in": in_f, "out": out_f})


def _holder(**layers) -> torch.nn.Module:
    """A module holding named layers (``attn.qkv_proj``, ``mlp.gate_up_proj``) as models nest them."""
    m = torch.nn.Module()
    for name, layer in layers.items():
        setattr(m, name, layer)
    return m


PATTERNS = {"linear": linear, "qkv": qkv, "merged": merged, "vocab": vocab, "int4": packed_int4, "moe": moe,
            "computed": computed}
