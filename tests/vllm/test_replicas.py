"""What the ranks of a data-parallel group hold alike (an MoE under expert parallelism: the same
attention, embeddings and norms, different experts) read once among them (``dp_exchange``):
every rank's parameters equal safetensors' own tensors, byte for byte, and the group reads each
of those bytes once. The ranks run as threads that exchange through ``ThreadCollectives``; the
transport over gloo between real processes is the row exchange's (tests/core/test_exchange.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vllm_fastload.config import FastloadConfig
from vllm_fastload.model import load_rank

from .layers import ThreadCollectives

HIDDEN, VOCAB, EXPERTS = 384, 1001, 6  # odd rows: blocks of unequal size
#: The vocabulary rows every rank takes of the head (a row slice, the same on every rank).
HEAD_ROWS = (3, VOCAB - 3)


def _checkpoint(root: Path) -> Path:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = rand(HIDDEN)
        tensors[prefix + "self_attn.o_proj.weight"] = rand(HIDDEN, HIDDEN)
        for e in range(EXPERTS):
            tensors[prefix + f"mlp.experts.{e}.w1.weight"] = rand(2 * HIDDEN, HIDDEN)
    root.mkdir()
    save_file(dict(list(tensors.items())[:5]), str(root / "a.safetensors"))
    save_file(dict(list(tensors.items())[5:]), str(root / "b.safetensors"))
    return root


class _Moe(nn.Module):
    """Every tensor of the checkpoint but the experts of other ranks, loaded by name through
    vLLM's ``default_weight_loader``; the head's rows ``HEAD_ROWS`` only."""

    def __init__(self, path: Path, experts: set[int], dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.experts = experts
        self.params = nn.ParameterDict()
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    shape = list(f.get_slice(name).get_shape())
                    if name == "lm_head.weight":
                        shape[0] = HEAD_ROWS[1] - HEAD_ROWS[0]
                    if self._holds(name):
                        self.params[name.replace(".", "_")] = nn.Parameter(
                            torch.zeros(shape, dtype=dtype), requires_grad=False)

    def _holds(self, name: str) -> bool:
        return ".experts." not in name or int(name.split(".experts.")[1].split(".")[0]) in self.experts

    def load_weights(self, weights) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loaded = set()
        for name, tensor in weights:
            if not self._holds(name):
                continue
            if name == "lm_head.weight":
                tensor = tensor.narrow(0, HEAD_ROWS[0], HEAD_ROWS[1] - HEAD_ROWS[0])
            param = self.params[name.replace(".", "_")]
            default_weight_loader(param, tensor)
            loaded.add("params." + name.replace(".", "_"))
        return loaded


def _load(path: Path, world: int, config: FastloadConfig,
          dtype: torch.dtype = torch.bfloat16) -> tuple[list[_Moe], list]:
    models = [_Moe(path, {e for e in range(EXPERTS) if e % world == rank}, dtype) for rank in range(world)]
    group = ThreadCollectives(world)
    reports: list = [None] * world
    errors: list = []

    def run(rank: int) -> None:
        try:
            reports[rank] = load_rank(models[rank], str(path), config, rank=rank, world=world,
                                      replicas=group.for_rank(rank))
        except BaseException as exc:
            errors.append((rank, exc))
            group.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return models, reports


def _assert_exact(path: Path, models: list[_Moe]) -> None:
    for rank, model in enumerate(models):
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if not model._holds(name):
                        continue
                    want = f.get_tensor(name)
                    if name == "lm_head.weight":
                        want = want.narrow(0, HEAD_ROWS[0], HEAD_ROWS[1] - HEAD_ROWS[0])
                    got = model.params[name.replace(".", "_")]
                    if got.dtype == torch.bfloat16:  # bit for bit
                        got, want = got.view(torch.int16), want.view(torch.int16)
                    assert torch.equal(got, want.to(got.dtype)), f"rank {rank}: {name} differs"  # bf16 -> f32: exact


@pytest.mark.parametrize("world", [2, 3])
def test_what_the_ranks_hold_alike_is_read_once_among_them(tmp_path, world):
    path = _checkpoint(tmp_path / "ckpt")
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    experts = 2 * EXPERTS * 2 * HIDDEN * HIDDEN * 2
    alike = total - experts  # near enough: the headers are a few hundred bytes

    models, reports = _load(path, world, FastloadConfig(progress=False, dp_exchange="always"))
    _assert_exact(path, models)
    for report in reports:
        assert f"7 tensors held alike read once among the {world} ranks of the data-parallel group" in report.summary, \
            report.summary
        # its share of what they hold alike, and its own experts
        assert report.bytes_read <= alike / world * 1.05 + experts / world * 1.05, (report.bytes_read, alike, world)
    assert sum(r.bytes_read for r in reports) <= total * 1.02

    models, reports = _load(path, world, FastloadConfig(progress=False, dp_exchange="never"))
    _assert_exact(path, models)
    for report in reports:
        assert "held alike" not in report.summary
        assert report.bytes_read >= alike  # each rank read all it holds


@pytest.mark.parametrize(("experts", "dp", "backend", "elastic", "want"), [
    (6, 2, "mp", False, True),  # an MoE's replicas: one group for its experts
    (0, 2, "mp", False, False),  # a dense model's replicas: independent, each a group of one
    (0, 2, "external_launcher", False, True),  # torchrun: the world group spans the replicas
    (6, 1, "mp", False, False), (0, 1, "external_launcher", False, False),  # one replica
    (6, 2, "mp", True, False),  # elastic EP: ranks may join later
])
def test_the_data_parallel_group_links_replicas(experts, dp, backend, elastic, want):
    from types import SimpleNamespace

    from vllm_fastload.vllm_plugin import compat

    config = SimpleNamespace(
        model_config=SimpleNamespace(get_num_experts=lambda: experts),
        parallel_config=SimpleNamespace(data_parallel_size=dp, distributed_executor_backend=backend,
                                        enable_elastic_ep=elastic))
    assert compat.replicas_in_dp_group(config) is want


@pytest.mark.parametrize(("dtype", "slabs"), [(torch.bfloat16, 0), (torch.float32, 7)])
def test_a_block_goes_straight_into_the_parameter_where_it_keeps_the_checkpoint_dtype(tmp_path, monkeypatch,
                                                                                     dtype, slabs):
    """Each rank's block of what the ranks hold alike is read into its own rows of the parameter
    (no read buffer: an object store's requests for it run as far ahead as any read into a
    parameter), and sent from there; where the parameter converts the dtype, through a slab."""
    from vllm_fastload.model import exchange

    taken: list[str] = []
    take = exchange.RowExchange.take

    def counting_take(self, request, rows):
        if request in self._row_reads:
            taken.append(request.name)
        return take(self, request, rows)

    monkeypatch.setattr(exchange.RowExchange, "take", counting_take)
    path = _checkpoint(tmp_path / "ckpt")
    models, reports = _load(path, 2, FastloadConfig(progress=False, dp_exchange="always"), dtype)
    _assert_exact(path, models)
    assert len(taken) == 2 * slabs, taken
    for report in reports:
        assert "7 tensors held alike read once among the 2 ranks" in report.summary, report.summary


def test_the_head_is_exchanged_with_the_embeddings_ahead_of_the_layers(tmp_path, monkeypatch):
    """A replica after the last layer (the head, the final norm) is read and exchanged with the
    embeddings: each exchange then overlaps the reads of the layers after it, and the last
    layer's is the last (small) one."""
    from vllm_fastload.model import exchange

    swaps: list[list[str]] = []
    swap = exchange.RowExchange._swap

    def recording_swap(self, names):
        if self.rank == 0:
            swaps.append(list(names))
        return swap(self, names)

    monkeypatch.setattr(exchange.RowExchange, "_swap", recording_swap)
    path = _checkpoint(tmp_path / "ckpt")
    models, reports = _load(path, 2, FastloadConfig(progress=False, dp_exchange="always"))
    _assert_exact(path, models)
    assert swaps == [["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"],
                     ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.o_proj.weight"],
                     ["model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.o_proj.weight"]], swaps
    for report in reports:
        assert "in 3 exchanges" in report.summary, report.summary
