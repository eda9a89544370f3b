"""The probe's view geometry, without starting vLLM: any view of a placeholder that a weight
loader copies into a parameter must be reproduced exactly, as a sliced read or as a replay."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import vllm_fastload
from vllm_fastload.vllm_plugin.probe import probe_model


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
])


@settings(max_examples=40, deadline=None)
@given(view=views, rows=st.integers(3, 9), cols=st.integers(6, 12), seed=st.integers(0, 2**16))
def test_recorded_writes_reproduce_the_loader(tmp_path_factory, view, rows, cols, seed):
    path = tmp_path_factory.mktemp("probe") / "m.safetensors"
    gen = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(rows, cols, generator=gen), "norm": torch.randn(4, generator=gen)}
    save_file(tensors, path)
    model = TinyModel((rows, cols), view)
    result = probe_model(model, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
    assert not result.unsupported
    assert result.loaded_params == {"weight", "norm"}
    assert result.partly_written() == {}

    with vllm_fastload.open(path, config={"progress": False}) as ckpt:
        for name, placements in result.placements.items():
            for i, p in enumerate(placements):
                req = p.request(tuple(tensors[name].shape), key=f"{name}#{i}")
                if req is None:
                    p.replay(ckpt.get_tensor(name))
                else:
                    ckpt.read_into({req: p.dest})
    assert torch.equal(model.weight, view(tensors["w"]))
    assert torch.equal(model.norm, torch.cat([tensors["norm"][:2], torch.zeros(2)]))


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
