"""The load-time checks, a second line of defence behind the geometry: each is driven by a fault
injected into an otherwise correct load, and must stop it with an error naming the parameter (or
the tensor), before anything wrong lands in a parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm_fastload import plan as plan_module
from vllm_fastload.config import FastloadConfig
from vllm_fastload.errors import PlanError
from vllm_fastload.executor import _direct_calls
from vllm_fastload.model import reads as reads_module
from vllm_fastload.model.rank import load_rank
from vllm_fastload.plan import Chunk, ChunkTensor, TensorRequest
from vllm_fastload.tensors import byte_view, view_tensor

CONFIG = FastloadConfig.build({"progress": False})


class Conv1D(nn.Module):
    """GPT-2's c_attn on one rank of two: the checkpoint holds (in, out); the loader takes this
    rank's q, k and v blocks of the transposed weight (a slab of columns, replayed)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.c_attn = nn.Parameter(torch.zeros(6, 8), requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            t = w.t()
            for part in range(3):
                self.c_attn.data.narrow(0, 2 * part, 2).copy_(t.narrow(0, 4 * part + 2 * self.rank, 2))
        return {"c_attn"}


class Tied(nn.Module):
    """Two parameters filled from one checkpoint tensor (an untied lm_head taking the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(5, 4), requires_grad=False)
        self.lm_head = nn.Parameter(torch.zeros(5, 4), requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            self.embed.data.copy_(w)
            self.lm_head.data.copy_(w)
        return {"embed", "lm_head"}


class DerivedNorm(nn.Module):
    """SGLang's GemmaRMSNorm: its weight loader copies the checkpoint's weight, then computes a
    buffer from the parameter it just filled (``gemma_weight = weight + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(6), requires_grad=False)
        self.register_buffer("gemma_weight", torch.ones(6), persistent=False)

    def load_weights(self, weights):
        for _, w in weights:
            self.weight.data.copy_(w)
            self.gemma_weight.copy_(self.weight.data).add_(1.0)
        return {"weight"}


def test_a_tensor_computed_from_a_filled_parameter_is_read_through_the_models_loader(tmp_path):
    """The placeholders never put the checkpoint's values into the parameter, so a buffer computed
    from it could not be replayed: the probe gives up on the model and it loads as the engine's
    default loader loads it."""
    w = torch.randn(6)
    save_file({"norm.weight": w}, tmp_path / "model.safetensors")
    model = DerivedNorm()
    report = load_rank(model, str(tmp_path), CONFIG)
    assert not report.planned
    assert "gemma_weight is computed by copy_ from the checkpoint data copied into weight" in report.fallback_reason
    assert torch.equal(model.weight, w) and torch.equal(model.gemma_weight, w + 1)


@pytest.fixture
def conv1d(tmp_path):
    w = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    save_file({"model.layers.0.c_attn.weight": w}, tmp_path / "model.safetensors")
    return tmp_path, w


def test_conv1d_slabs_load_exactly(conv1d):
    path, w = conv1d
    model = Conv1D(rank=1)
    report = load_rank(model, str(path), CONFIG, rank=1, world=2)
    want = torch.cat([w.t().narrow(0, 4 * part + 2, 2) for part in range(3)])
    assert torch.equal(model.c_attn, want)
    assert report.paths["slab"] == 1 and report.bytes_read == report.bytes_kept  # its columns only


def test_a_slab_that_arrives_in_another_shape_stops_the_load_naming_the_parameter(conv1d, monkeypatch):
    """The replay checks the slab it is given against the one its views were planned on."""
    path, _ = conv1d
    real = reads_module.plan_slabs

    def one_column_short(shape, views, read_cost):
        return [dataclasses.replace(s, length=s.length - 1) if s.dim is not None else s
                for s in real(shape, views, read_cost)]

    monkeypatch.setattr(reads_module, "plan_slabs", one_column_short)
    model = Conv1D(rank=0)
    with pytest.raises(PlanError, match=r"parameter c_attn: the slab read has shape \[8, 1\], planned \[8, 2\]"):
        load_rank(model, str(path), CONFIG, rank=0, world=2)
    assert not model.c_attn.any()  # nothing was replayed from the wrong slab


def test_one_tensor_taken_twice_is_read_once(tmp_path):
    w = torch.randn(5, 4)
    save_file({"model.embed.weight": w}, tmp_path / "model.safetensors")
    model = Tied()
    report = load_rank(model, str(tmp_path), CONFIG)
    assert torch.equal(model.embed, w) and torch.equal(model.lm_head, w)
    assert report.bytes_read == w.numel() * w.element_size()


def test_a_plan_that_reads_a_tensor_twice_stops_before_reading(tmp_path, monkeypatch):
    """Had the two writes been planned as two reads, the plan would read the tensor twice: the plan
    check refuses it (a rank never reads more than the tensors it keeps) before a byte is read."""
    w = torch.randn(5, 4)
    save_file({"model.embed.weight": w}, tmp_path / "model.safetensors")
    monkeypatch.setattr(reads_module, "_disjoint", lambda narrows: True)
    model = Tied()
    with pytest.raises(PlanError, match=r"reads 160 bytes of a 80-byte tensor \(for embed, lm_head\)") as err:
        load_rank(model, str(tmp_path), CONFIG)
    assert "model.embed.weight" in str(err.value) and str(tmp_path) in str(err.value)
    assert not model.embed.any() and not model.lm_head.any()


def test_a_read_outside_its_tensor_is_refused(tmp_path, monkeypatch):
    """Every read lands inside its tensor's bytes: a plan whose ranges stray (here, shifted past
    the tensor) stops with an error naming the tensor, whoever asked for the read."""
    w = torch.randn(5, 4)
    save_file({"a": w, "b": torch.randn(3)}, tmp_path / "model.safetensors")
    real = plan_module.plan_tensor

    def shifted(info, request, strided_min_skip):
        t = real(info, request, strided_min_skip)
        return dataclasses.replace(t, ranges=[(o + info.nbytes, n) for o, n in t.ranges])

    monkeypatch.setattr(plan_module, "plan_tensor", shifted)
    import vllm_fastload

    ckpt = vllm_fastload.open(tmp_path, config=CONFIG)
    with ckpt, pytest.raises(PlanError, match="outside the tensor's bytes"):
        ckpt.plan([TensorRequest("a")])


def test_a_view_of_enclosing_rows_must_end_inside_the_bytes_read(tmp_path):
    import vllm_fastload

    save_file({"a": torch.randn(6, 10)}, tmp_path / "model.safetensors")
    with vllm_fastload.open(tmp_path, config={"strided_min_skip": 1 << 40, "progress": False}) as ckpt:
        (t,) = ckpt.plan([TensorRequest("a", dim=1, start=2, length=3)]).tensors
        assert t.strategy == "enclosing"
        raw = torch.zeros(t.read_bytes, dtype=torch.uint8)
        assert view_tensor(raw, t).shape == (6, 3)
        wide = dataclasses.replace(t, view_strides=(11, 1))  # a row longer than the file's
        with pytest.raises(PlanError, match="reaches element"):
            view_tensor(raw, wide)
        with pytest.raises(PlanError, match="delivered for a read of"):
            view_tensor(raw[:-1], t)


def test_a_direct_read_lands_only_in_a_destination_of_its_size(tmp_path):
    import vllm_fastload

    save_file({"a": torch.randn(6, 10)}, tmp_path / "model.safetensors")
    with vllm_fastload.open(tmp_path, config=CONFIG) as ckpt:
        plan = ckpt.plan([TensorRequest("a", dim=0, start=1, length=2)])
        (t,) = plan.tensors
        t = dataclasses.replace(t, dest=torch.empty(3, 10))  # one row too many
        with pytest.raises(PlanError, match="given a 120-byte destination"):
            _direct_calls(Chunk(t.info.file, (), 0, (ChunkTensor(t, 0),), direct=True))
    with pytest.raises(ValueError, match="contiguous tensors only"):
        byte_view(torch.empty(4, 4).t())  # reads into a copy would land nowhere
