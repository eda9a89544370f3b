"""Per-layer post-processing (``vllm_plugin.post``): each module post-processed exactly once, by
its own vLLM quantization method, only once its parameters are complete and only inside decoder
layers; vLLM's pass after the load skips exactly those modules, once. (Whole vLLM loads with it
are compared with the default loader in test_verify.py and test_zoo.py.)"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from vllm_fastload.vllm_plugin.post import LayerPostProcessor


class Counting(QuantizeMethodBase):
    """A quantization method that records the modules it post-processes."""

    def __init__(self) -> None:
        self.calls: list[nn.Module] = []

    def create_weights(self, *args, **kwargs) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    def apply(self, *args, **kwargs) -> torch.Tensor:  # pragma: no cover - not used
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls.append(layer)


class Proj(nn.Module):
    def __init__(self, method: QuantizeMethodBase) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("scale", torch.ones(1))
        self.quant_method = method


def _model(shared: Counting | None = None) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for layer in model.layers:
        layer.qkv = Proj(shared or Counting())
        layer.out = Proj(shared or Counting())
    model.lm_head = Proj(Counting())
    return model


def _vllm_pass(model: nn.Module) -> None:
    """What vLLM's ``process_weights_after_loading`` does per module."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)


def _all_written(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters()} | {"layers.0.qkv.scale"}


def test_a_module_is_processed_once_its_parameters_and_written_buffers_are_complete():
    model = _model()
    post = LayerPostProcessor(model, torch.device("cpu"))
    post.expect(_all_written(model))
    qkv = model.layers[0].qkv
    post.ready(0, ["layers.0.qkv.weight", "layers.0.qkv.bias"])
    assert qkv.quant_method.calls == []  # its scale (written by the checkpoint) is not in yet
    post.ready(0, ["layers.0.qkv.scale", "layers.0.out.weight"])
    assert qkv.quant_method.calls == [qkv] and model.layers[0].out.quant_method.calls == []
    post.ready(0, ["layers.0.out.bias"])
    assert model.layers[0].out.quant_method.calls == [model.layers[0].out]
    assert post.processed == 2


def test_embeddings_and_head_groups_are_left_to_vllms_pass():
    model = _model()
    post = LayerPostProcessor(model, torch.device("cpu"))
    post.expect(_all_written(model))
    post.ready(None, ["lm_head.weight", "lm_head.bias"])
    assert model.lm_head.quant_method.calls == [] and post.processed == 0
    _vllm_pass(model)
    assert model.lm_head.quant_method.calls == [model.lm_head]


def test_vllms_pass_skips_processed_modules_once_then_a_reload_processes_all_again():
    model = _model()
    post = LayerPostProcessor(model, torch.device("cpu"))
    post.expect(_all_written(model))
    for i in range(2):
        post.ready(i, [f"layers.{i}.{m}.{p}" for m in ("qkv", "out") for p in ("weight", "bias")])
    post.ready(0, ["layers.0.qkv.scale"])
    _vllm_pass(model)
    projs = [m for m in model.modules() if isinstance(m, Proj)]
    assert all(p.quant_method.calls == [p] for p in projs)  # exactly once each
    assert all("process_weights_after_loading" not in vars(p.quant_method) for p in projs)  # hooks gone
    _vllm_pass(model)  # e.g. a weight reload's post-processing
    assert all(p.quant_method.calls == [p, p] for p in projs)


def test_a_method_shared_by_several_modules_skips_only_those_processed():
    shared = Counting()
    model = _model(shared)
    post = LayerPostProcessor(model, torch.device("cpu"))
    post.expect(_all_written(model))
    post.ready(0, ["layers.0.qkv.weight", "layers.0.qkv.bias", "layers.0.qkv.scale"])
    _vllm_pass(model)
    layer0, layer1 = model.layers
    assert shared.calls == [layer0.qkv, layer0.out, layer1.qkv, layer1.out]


class Adding(Counting):
    """Post-processing that adds a parameter (as vLLM-CPU's int8 method adds ``azp_adj``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.azp_adj = nn.Parameter(torch.zeros(2), requires_grad=False)


def test_parameters_added_by_post_processing_are_reported():
    """The loader's completeness check must not ask the checkpoint for them."""
    model = _model()
    model.layers[0].qkv.quant_method = Adding()
    post = LayerPostProcessor(model, torch.device("cpu"))
    post.expect(_all_written(model))
    post.ready(0, ["layers.0.qkv.weight", "layers.0.qkv.bias", "layers.0.qkv.scale"])
    assert post.added == {"layers.0.qkv.azp_adj"}
