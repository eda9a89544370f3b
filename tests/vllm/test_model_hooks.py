"""The model attributes vLLM's default loader honours (``is_unused_checkpoint_weight``,
``allow_patterns_overrides``, ``secondary_weights``), through vLLM's own loader interface in this
process: fastload loads what the default loader loads, from the files the default loader reads."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm_fastload.errors import CheckpointError, MissingFileError, OutsideCheckpointError
from vllm_fastload.tools.checkpoints import write_checkpoint
from vllm_fastload.vllm_plugin import compat

pytestmark = [pytest.mark.vllm, pytest.mark.core, pytest.mark.gpu_build]

SHAPE = (16, 8)


class Tiny(nn.Module):
    """Three linears, loaded the way vLLM models load: by name, through ``default_weight_loader``,
    skipping the names ``is_unused`` accepts; the loaded names are returned."""

    def __init__(self, unused_prefix: str = "mtp.") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(SHAPE[1], SHAPE[0], bias=False, dtype=torch.bfloat16)
                                    for _ in range(3))
        self.unused_prefix = unused_prefix
        for p in self.parameters():
            p.requires_grad_(False)
            p.zero_()

    def load_weights(self, weights) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            if name.startswith(self.unused_prefix):
                continue
            default_weight_loader(params[name], tensor)
            loaded.add(name)
        return loaded


class WithUnusedShards(Tiny):
    def is_unused_checkpoint_weight(self, name: str) -> bool:
        return name.startswith(self.unused_prefix)


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _write(root: Path, shards: dict[str, dict[str, torch.Tensor]], index: bool = True) -> Path:
    """A checkpoint directory with the demo model's config.json (for vLLM's ModelConfig) and these shards."""
    config = write_checkpoint(root.parent / f".{root.name}-config", "demo", files=1) / "config.json"
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, root / "config.json")
    for filename, tensors in shards.items():
        save_file(tensors, root / filename, metadata={"format": "pt"})
    if index:
        weight_map = {name: f for f, tensors in shards.items() for name in tensors}
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _load(load_format: str, model: nn.Module, path: Path):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_fastload.tools.verify import engine_config
    from vllm_fastload.vllm_plugin import register

    register()
    config = engine_config(str(path), 1, load_format, {"progress": False} if load_format == "fastload" else {})
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        loader.load_weights(model, config.model_config)
    return loader


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name].view(torch.uint8), pb[name].view(torch.uint8)), name


def test_shards_holding_only_unused_weights_are_not_opened(tmp_path):
    shards = {"a.safetensors": {"layers.0.weight": _tensor(0), "layers.1.weight": _tensor(1)},
              "b.safetensors": {"mtp.0.weight": _tensor(2), "mtp.1.weight": _tensor(3)},
              "c.safetensors": {"layers.2.weight": _tensor(4), "mtp.2.weight": _tensor(5)}}
    path = _write(tmp_path / "ckpt", shards)
    default, fast = WithUnusedShards(), WithUnusedShards()
    _load("auto", default, path)
    loader = _load("fastload", fast, path)
    _assert_same(default, fast)
    assert torch.equal(fast.layers[2].weight, _tensor(4))
    size = SHAPE[0] * SHAPE[1] * 2
    # Where this vLLM's default loader drops shard b (0.32 and later), fastload does not open it either.
    shards_opened = 2 if compat.default_loader_skips_unused_shards() else 3
    assert loader.report.bytes_total == shards_opened * 2 * size, loader.report
    assert loader.report.bytes_read == 3 * size, loader.report  # the unused tensors are never read


def test_allow_patterns_overrides_picks_the_files(tmp_path):
    """The model names its own files: the decoy ``model.safetensors`` the index names is not loaded."""
    names = [f"layers.{i}.weight" for i in range(3)]
    shards = {"model.safetensors": {n: _tensor(10 + i) for i, n in enumerate(names)}}
    path = _write(tmp_path / "ckpt", shards, index=False)
    save_file({n: _tensor(i) for i, n in enumerate(names[:2])}, path / "tower-00001.safetensors")
    save_file({names[2]: _tensor(2)}, path / "tower-00002.safetensors")

    class Patterned(Tiny):
        allow_patterns_overrides = ["other-*.safetensors", "tower-*.safetensors"]

    default, fast = Patterned(), Patterned()
    _load("auto", default, path)
    _load("fastload", fast, path)
    _assert_same(default, fast)
    for i in range(3):
        assert torch.equal(fast.layers[i].weight, _tensor(i))

    # An index that names the decoy: vLLM before 0.32 filters the picked files by it (and stops,
    # since it names a file not picked), later releases ignore it; fastload does as the running one.
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}))
    if compat.default_loader_filters_overrides_by_index():
        with pytest.raises(FileNotFoundError):
            _load("auto", Patterned(), path)
        with pytest.raises(MissingFileError, match="names a file the model's allow_patterns_overrides does not pick"):
            _load("fastload", Patterned(), path)
    else:
        default, fast = Patterned(), Patterned()
        _load("auto", default, path)
        _load("fastload", fast, path)
        _assert_same(default, fast)
        assert torch.equal(fast.layers[0].weight, _tensor(0))

    class NotSafetensors(Tiny):
        allow_patterns_overrides = ["*.bin"]

    (path / "extra.bin").write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"NotSafetensors\.allow_patterns_overrides .* not safetensors.*\.bin"):
        _load("fastload", NotSafetensors(), path)


def test_secondary_weights_load_through_vllms_default_loader(tmp_path, caplog):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    path = _write(tmp_path / "ckpt", {"model.safetensors": {"layers.0.weight": _tensor(0),
                                                            "layers.1.weight": _tensor(1)}}, index=False)
    tower = _write(tmp_path / "tower", {"model.safetensors": {"2.weight": _tensor(2)}}, index=False)

    class TwoSources(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.secondary_weights = [DefaultModelLoader.Source(model_or_path=str(tower), revision=None,
                                                                prefix="layers.")]

    default, fast = TwoSources(), TwoSources()
    _load("auto", default, path)
    with caplog.at_level(logging.WARNING, logger="vllm_fastload.vllm_plugin"):
        loader = _load("fastload", fast, path)
    _assert_same(default, fast)
    assert torch.equal(fast.layers[2].weight, _tensor(2))
    assert loader.report.fallback_reason == "secondary_weights"
    assert any(f"also loads weights from {tower} (secondary_weights)" in r.getMessage() for r in caplog.records)


def test_allow_patterns_overrides_never_reach_outside_the_checkpoint(tmp_path):
    """A pattern is the model's, but what it matches must still be the checkpoint's own files."""
    names = [f"layers.{i}.weight" for i in range(3)]
    path = _write(tmp_path / "ckpt", {"model.safetensors": {n: _tensor(i) for i, n in enumerate(names)}}, index=False)
    save_file({n: _tensor(i) for i, n in enumerate(names)}, tmp_path / "outside.safetensors")

    class Escaping(Tiny):
        allow_patterns_overrides = ["../outside*.safetensors"]

    with pytest.raises(OutsideCheckpointError, match=r"Escaping\.allow_patterns_overrides .* outside the checkpoint"):
        _load("fastload", Escaping(), path)
