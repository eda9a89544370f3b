"""The minimal engine adapter in docs/design.md ("Writing an engine adapter"), run as written there:
each tensor-parallel rank gets exactly the slices safetensors gives, and its hooks run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_fastload import policy

from ._util import assert_bitexact, random_tensor

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
SECTION = "## Writing an engine adapter"


def adapter_example() -> dict[str, object]:
    """The names the documented example defines, from the one Python block of its section."""
    text = DESIGN.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    names: dict[str, object] = {}
    exec(compile(code, f"{DESIGN}:{SECTION}", "exec"), names)
    return names


@pytest.mark.parametrize("world", [1, 2])
def test_the_documented_adapter_loads_every_rank_exactly(tmp_path: Path, world: int) -> None:
    tensors = {"model.embed_tokens.weight": random_tensor((32, 16), torch.bfloat16, 1),
               "lm_head.weight": random_tensor((32, 16), torch.bfloat16, 2),
               "model.norm.weight": random_tensor((16,), torch.float32, 3)}
    for i in range(2):
        tensors |= {f"model.layers.{i}.self_attn.q_proj.weight": random_tensor((16, 16), torch.bfloat16, 10 + i),
                    f"model.layers.{i}.self_attn.o_proj.weight": random_tensor((16, 16), torch.bfloat16, 20 + i),
                    f"model.layers.{i}.mlp.up_proj.weight": random_tensor((32, 16), torch.bfloat16, 30 + i),
                    f"model.layers.{i}.mlp.down_proj.weight": random_tensor((16, 32), torch.bfloat16, 40 + i)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_rank = adapter_example()["load_rank"]
    for rank in range(world):
        want = {}
        for name, t in tensors.items():
            if name.endswith(("q_proj.weight", "up_proj.weight")):
                want[name] = t.chunk(world, dim=0)[rank]
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                want[name] = t.chunk(world, dim=1)[rank]
            elif name == "lm_head.weight":
                want["lm_head_t"] = t.t()
            else:
                want[name] = t
        params = {name: torch.full_like(t.contiguous(), 7) for name, t in want.items()}
        stats, ready = load_rank(params, str(tmp_path), rank, world)
        for name, t in want.items():
            assert_bitexact(params[name], t, name)
        assert ready == ["embeddings", "layer 0", "layer 1", "final"]
        assert stats.bytes_read == sum(t.numel() * t.element_size() for t in want.values())
        assert stats.tensors == len(want)


def test_the_documented_check_stops_a_rank_that_would_over_read(tmp_path: Path, monkeypatch) -> None:
    """``check`` sees the plan before a byte is read; what it raises stops the load. (A reader whose
    plans read a column slice as its enclosing rows stands in for a plan that reads too much.)"""
    monkeypatch.setattr(policy, "reader_strided_min_skip", lambda backend: 1 << 30)
    save_file({"model.layers.0.self_attn.o_proj.weight": random_tensor((4, 64), torch.float32, 1),
               "lm_head.weight": random_tensor((2, 2), torch.float32, 2)}, str(tmp_path / "model.safetensors"))
    load_rank = adapter_example()["load_rank"]
    params = {"model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 32), "lm_head_t": torch.zeros(2, 2)}
    with pytest.raises(RuntimeError, match=r"would read 384 bytes it does not keep"):
        load_rank(params, str(tmp_path), 0, 2)
