"""The probe's view geometry, without starting vLLM: any view of a placeholder that a weight
loader copies into a parameter must be reproduced exactly, as a sliced read or as a replay, by
the same path the vLLM loader takes (``rank.load_rank``), with the reader's settings of users
(the default) and of network filesystems and object stores (enclosing rows read through)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from vllm_fastload.config import FastloadConfig
from vllm_fastload.model.probe import probe_model
from vllm_fastload.model.rank import load_rank

#: The default, and enclosing rows read through their gaps (as on network filesystems).
READERS = {"default": {}, "enclosing": {"strided_min_skip": 1 << 40}}


def _config(reader: str) -> FastloadConfig:
    return FastloadConfig.build({**READERS[reader], "progress": False})


class TinyModel(nn.Module):
    """Loads like vLLM models do: narrow the checkpoint tensor, copy into a parameter view."""

    def __init__(self, shape, view) -> None:
        super().__init__()
        self.view = view
        out = view(torch.empty(shape))
        self.weight = nn.Parameter(torch.zeros(out.shape), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "w":
                self.weight.data.copy_(self.view(w))
                loaded.add("weight")
            elif name == "norm":
                self.norm.data[:2] = w[:2]   # __setitem__ path
                self.norm.data[2:].fill_(0)  # padding fill, like vocab padding
                loaded.add("norm")
        return loaded


views = st.sampled_from([
    lambda t: t,
    lambda t: t.narrow(0, 1, t.shape[0] - 1),
    lambda t: t.narrow(1, 2, 3),
    lambda t: t[1],                 # select: expert stacking
    lambda t: t.t(),                # transpose: not a single narrow -> replay
    lambda t: t[:, ::2],            # step: replay
    lambda t: t.narrow(0, 0, 2).narrow(1, 1, 2),  # two narrows: replay
    lambda t: t.t().contiguous().narrow(0, 1, 2),  # a copy of a transpose: a derived view
    lambda t: torch.cat([t[:1], t[2:3]]),           # concatenated rows of one tensor
    lambda t: t.reshape(-1)[1:-1].reshape(1, -1),   # flattened: a run across rows
])


@settings(max_examples=40, deadline=None)
@given(view=views, rows=st.integers(3, 9), cols=st.integers(6, 12), seed=st.integers(0, 2**16),
       reader=st.sampled_from(sorted(READERS)))
def test_recorded_writes_reproduce_the_loader(tmp_path_factory, view, rows, cols, seed, reader):
    path = tmp_path_factory.mktemp("probe") / "m.safetensors"
    gen = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(rows, cols, generator=gen), "norm": torch.randn(4, generator=gen)}
    save_file(tensors, path)
    model = TinyModel((rows, cols), view)
    result = probe_model(model, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
    assert not result.unsupported
    assert result.loaded_params == {"weight", "norm"}
    assert result.partly_written() == {}

    model = TinyModel((rows, cols), view)
    # As one rank of two: a rank takes part of a tensor by design (alone it would be a mismatch).
    report = load_rank(model, str(path), _config(reader), rank=0, world=2)
    assert report.planned and report.loaded == {"weight", "norm"}
    assert torch.equal(model.weight, view(tensors["w"]))
    assert torch.equal(model.norm, torch.cat([tensors["norm"][:2], torch.zeros(2)]))
    assert report.bytes_read <= sum(t.numel() * t.element_size() for t in tensors.values())


def test_unsupported_loading_is_detected():
    class Scaling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.weight.data.copy_(w * 2)  # arithmetic on checkpoint data
            return {"weight"}

    result = probe_model(Scaling(), {"w": ((4,), torch.float32)})
    assert result.unsupported and "computed from checkpoint data" in result.unsupported[0]


class Keeping(nn.Module):
    """A loader that keeps what it is given (a placeholder in the probe) as a parameter, a buffer
    or a plain attribute, beside meta tensors the model had before loading."""

    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep = keep
        self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.inner = nn.Module()
        self.inner.lazy = torch.empty(2, device="meta")  # the model's own, from before the load
        self.inner.register_buffer("lazy_buffer", torch.empty(2, device="meta"))

    def load_weights(self, weights):
        for name, w in weights:
            if name == "w":
                self.weight.data.copy_(w)
            elif self.keep == "attribute":
                self.inner.kept = w
            elif self.keep == "buffer":
                self.inner.register_buffer("kept", w[:1])
            elif self.keep == "parameter":
                self.inner.kept = nn.Parameter(w, requires_grad=False)
        return {"weight"}


@pytest.mark.parametrize("keep", ["attribute", "buffer", "parameter", "nothing"])
def test_placeholders_kept_by_the_model_are_refused(keep):
    """A placeholder the model keeps would stay a meta tensor where the real load leaves data: the
    probe refuses, naming it; the meta tensors the model had before the load are not its doing."""
    result = probe_model(Keeping(keep), {"w": ((4,), torch.float32), "extra": ((4,), torch.float32)})
    if keep == "nothing":
        assert not result.unsupported
    else:
        assert list(result.unsupported) == ["placeholders were kept by the model: inner.kept"]


def test_partly_written_parameter_is_reported():
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Parameter(torch.zeros(8, 2), requires_grad=False)

        def load_weights(self, weights):
            for name, w in weights:
                offset = 0 if name == "gate" else 4
                self.gate_up.data.narrow(0, offset, 4).copy_(w)
            return {"gate_up"}

    result = probe_model(Stacked(), {"gate": ((4, 2), torch.float32)})  # "up" is missing
    assert result.partly_written() == {"gate_up": ["gate"]}


# -- writes that are not one narrow: transposes, reshapes of transposes, concatenations -----------

def _bloom_like(t, rank, world=2, heads=4):
    """Per-head interleaved fused qkv, de-interleaved by a reshape of a transpose (a copy), then this
    rank's q, k and v rows, as vLLM's QKV loader takes them."""
    rows, cols = t.shape
    d = rows // (3 * heads)
    qkv = t.view(heads, 3, d, cols).transpose(0, 1).reshape(rows, cols)
    per = heads // world * d
    return [qkv.narrow(0, part * heads * d + rank * per, per) for part in range(3)]


def _falcon_like(t, rank, world=2, groups=2, q_per_group=2):
    """Grouped interleave (q heads of a group, then its k and v), split with narrows and joined by cat."""
    rows, cols = t.shape
    d = rows // (groups * (q_per_group + 2))
    g = t.view(groups, q_per_group + 2, d, cols)
    wq = g.narrow(1, 0, q_per_group).reshape(-1, cols)
    wk = g.narrow(1, q_per_group, 1).reshape(-1, cols)
    wv = g.narrow(1, q_per_group + 1, 1).reshape(-1, cols)
    qkv = torch.cat([wq, wk, wv], dim=0)
    q_rows, kv_rows = groups * q_per_group * d, groups * d
    return [qkv.narrow(0, rank * q_rows // world, q_rows // world),
            qkv.narrow(0, q_rows + rank * kv_rows // world, kv_rows // world),
            qkv.narrow(0, q_rows + kv_rows + rank * kv_rows // world, kv_rows // world)]


def _conv1d_like(t, rank, world=2):
    """A GPT-2 Conv1D weight (in, out) transposed, then this rank's rows of q, k and v."""
    w = t.t()
    out = w.shape[0] // 3
    return [w.narrow(0, part * out + rank * out // world, out // world) for part in range(3)]


class Parts(nn.Module):
    """A parameter filled by several writes that the loader derives from one checkpoint tensor."""

    def __init__(self, shape, parts) -> None:
        super().__init__()
        self.parts = parts
        outs = parts(torch.empty(shape))
        self.weight = nn.Parameter(torch.zeros(sum(o.shape[0] for o in outs), outs[0].shape[1]),
                                   requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            offset = 0
            for part in self.parts(w):
                self.weight.data.narrow(0, offset, part.shape[0]).copy_(part)
                offset += part.shape[0]
        return {"weight"}


LAYOUTS = {"bloom": (_bloom_like, (24, 6)), "falcon": (_falcon_like, (32, 6)), "conv1d": (_conv1d_like, (6, 24))}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_derived_writes_read_only_their_slab(tmp_path, layout, rank, reader):
    fn, shape = LAYOUTS[layout]
    parts = functools.partial(fn, rank=rank)
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
    save_file({"w": tensor}, tmp_path / "m.safetensors")
    result = probe_model(Parts(shape, parts), {"w": (shape, tensor.dtype)})
    assert not result.unsupported
    assert result.partly_written() == {}
    model = Parts(shape, parts)
    report = load_rank(model, str(tmp_path), _config(reader), rank=rank, world=2)
    assert report.planned and report.paths["slab"] == 1
    assert torch.equal(model.weight, torch.cat(parts(tensor)))
    kept = model.weight.numel() * model.weight.element_size()
    assert report.bytes_kept == kept
    if reader == "default":  # rows read row by row: exactly what the rank keeps
        assert report.bytes_read == kept, f"read {report.bytes_read} bytes for {kept}"
    else:  # through the gaps, still never more than the tensor
        assert kept <= report.bytes_read <= tensor.numel() * tensor.element_size()


def test_a_reshape_that_is_no_strided_view_is_refused():
    class Shuffled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 8), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:  # rows 0, 3, 1 of a (6, 8) tensor: no single strided view
                self.weight.data.copy_(w.view(2, 3, 8).transpose(0, 1).reshape(6, 8)[:3])
            return {"weight"}

    result = probe_model(Shuffled(), {"w": ((6, 8), torch.float32)})
    assert result.unsupported and "cannot describe as a strided view" in result.unsupported[0]


def test_arithmetic_after_a_reshape_is_still_refused():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8, 6), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.weight.data.copy_(w.t().contiguous() * 2)
            return {"weight"}

    result = probe_model(Scaled(), {"w": ((6, 8), torch.float32)})
    assert result.unsupported and "computed from checkpoint data" in result.unsupported[0]


def test_a_copy_into_the_same_region_replaces_the_earlier_one():
    class Shape(nn.Module):  # like a quantized fused layer's weight_shape, written once per shard
        def __init__(self) -> None:
            super().__init__()
            self.shape = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.shape.data.copy_(w)
            return {"shape"}

    result = probe_model(Shape(), {"a": ((2,), torch.int64), "b": ((2,), torch.int64)})
    assert not result.unsupported
    assert list(result.placements) == ["b"]  # the last write wins, as in the loader


def test_column_blocks_of_a_transposed_fused_parameter_are_disjoint_writes():
    """GPTQ keeps ``qweight`` as (in, out): a fused gate_up takes its two shards as column blocks,
    whose byte spans interleave. They must plan (and an overlapping block must still be refused)."""

    class Transposed(nn.Module):
        def __init__(self, second: int) -> None:
            super().__init__()
            self.qweight = nn.Parameter(torch.zeros(4, 16, dtype=torch.int32), requires_grad=False)
            self.second = second

        def load_weights(self, weights):
            for name, w in weights:
                self.qweight.data.narrow(1, 0 if name == "gate" else self.second, 8).copy_(w)
            return {"qweight"}

    tensors = {"gate": ((4, 8), torch.int32), "up": ((4, 8), torch.int32)}
    result = probe_model(Transposed(8), tensors)
    assert not result.unsupported and sorted(result.placements) == ["gate", "up"]
    assert not result.partly_written()
    clash = probe_model(Transposed(4), tensors)  # columns 4..7 written twice
    assert clash.unsupported and "written twice in overlapping regions" in clash.unsupported[0]


def test_a_write_through_another_dtype_at_the_same_address_is_an_overlap():
    """Same address, shape and strides but another element size is not "the same region": the
    second write covers only part of the first, so the probe must not let it replace the first."""

    class Retyped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                (self.w.data if name == "a" else self.w.data.view(torch.uint8)[:4]).copy_(t)
            return {"w"}

    result = probe_model(Retyped(), {"a": ((4,), torch.int32), "b": ((4,), torch.uint8)})
    assert result.unsupported and "written twice in overlapping regions" in result.unsupported[0]


def test_box_overlap_matches_the_elements_shared():
    """``_Region.overlaps`` against the truth (shared byte addresses) for random strided views of
    one parameter, expanded (stride 0) ones included: it may say "overlap" when unsure, never
    "disjoint" for views that share an element."""
    import random

    from vllm_fastload.model.probe import _Region

    def _overlap(a: torch.Tensor, b: torch.Tensor, origin: int) -> bool:
        return _Region.of(a, origin).overlaps(_Region.of(b, origin))

    rng = random.Random(0)
    base = torch.zeros(6, 8, 10, dtype=torch.int16)
    origin = base.data_ptr()

    def view() -> torch.Tensor:
        t = base
        for dim in range(3):
            start = rng.randrange(t.shape[dim])
            t = t.narrow(dim, start, rng.randrange(1, t.shape[dim] - start + 1))
        if rng.random() < 0.1:
            t = t[:, :1].expand(t.shape[0], 3, t.shape[2])
        return t

    def addresses(t: torch.Tensor) -> set[int]:
        index = torch.arange(base.numel()).view(base.shape)
        picked = index.as_strided(t.shape, t.stride(), (t.data_ptr() - origin) // base.element_size())
        return set(picked.flatten().tolist())

    for _ in range(2000):
        a, b = view(), view()
        if addresses(a) & addresses(b):
            assert _overlap(a, b, origin), (a.shape, a.stride(), b.shape, b.stride())
