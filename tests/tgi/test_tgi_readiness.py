"""on_layer_ready: a group fires once, when every tensor of it has been served to this rank; bar on rank 0."""

from __future__ import annotations

import json
import sys

import pytest
import tgi_helpers
import torch
from tgi_helpers import ALL_SPECS, FILE_A, write

from vllm_fastload import LayerEvent

LAYER0 = [n for n in ALL_SPECS if n.startswith("model.layers.0.")]
LAYER1 = [n for n in ALL_SPECS if n.startswith("model.layers.1.")]


def group_bytes(names: list[str]) -> int:
    total = 0
    for n in names:
        shape, dtype = ALL_SPECS[n]
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return total


def test_group_fires_once_when_all_its_tensors_are_served(make_weights):
    events: list[LayerEvent] = []
    w = make_weights(2, 1, config={"on_layer_ready": [events.append]})
    for name in LAYER0[:-1]:
        w.get_partial_sharded(name, 0)
    w.has_tensor(LAYER0[-1])
    w.get_shape(LAYER0[-1])
    assert events == []  # metadata does not count, and one tensor is still missing
    w._get_slice(LAYER0[-1])[0:1]
    assert [e.name for e in events] == ["layer 0"]
    event = events[0]
    assert (event.layer, event.tensors, event.layers_done) == (0, len(LAYER0), 1)
    assert event.bytes == group_bytes(LAYER0)
    assert event.layers_total == 4  # embeddings, layer 0, layer 1, final
    assert event.bytes_total == group_bytes(list(ALL_SPECS))
    for name in LAYER0:  # served again: no second event
        w.get_tensor(name)
    assert len(events) == 1


def test_all_groups_fire_in_completion_order(make_weights, capsys):
    events: list[LayerEvent] = []
    w = make_weights(1, 0, config={"on_layer_ready": [events.append]})
    w.get_tensor("lm_head.weight")
    w.get_tensor("model.norm.weight")
    for name in LAYER1:
        w.get_tensor(name)
    w.get_partial_sharded("model.embed_tokens.weight", 0)
    for name in LAYER0:
        w.get_tensor(name)
    assert [e.name for e in events] == ["final", "layer 1", "embeddings", "layer 0"]
    assert events[-1].layers_done == events[-1].layers_total == 4
    assert events[-1].bytes_done == events[-1].bytes_total
    err = capsys.readouterr().err
    assert "fastload-tgi: rank 0 ready: 4 layer groups" in err


def test_late_routing_entries_do_not_disturb_groups(make_weights, tmp_path):
    events: list[LayerEvent] = []
    w = make_weights(config={"on_layer_ready": [events.append]})
    spec = tmp_path / "medusa.safetensors"
    write(spec, {"medusa.0.weight": ((4, 4), torch.float32)}, 3)
    w.routing["medusa.0.weight"] = str(spec)
    w.get_tensor("medusa.0.weight")
    assert events == []


def test_callback_by_import_string(make_weights):
    tgi_helpers.EVENTS.clear()
    w = make_weights(config={"on_layer_ready": "tgi_helpers:record_event"})
    for name in FILE_A:
        if name.startswith("model.layers.0."):
            w.get_tensor(name)
    assert [e.name for e in tgi_helpers.EVENTS] == ["layer 0"]


def test_default_config_comes_from_the_environment(ckpt, monkeypatch):
    from tgi_helpers import FakeGroup

    from tgi_patch import FastWeights

    monkeypatch.setenv("FASTLOAD_TGI", "1")           # the switch itself is not a config field
    monkeypatch.setenv("FASTLOAD_PROGRESS", "false")
    monkeypatch.setenv("FASTLOAD_THREADS", "3")
    w = FastWeights(ckpt, "cpu", torch.float16, FakeGroup(0, 2), None)
    try:
        assert (w.config.progress, w.config.threads) == (False, 3)
    finally:
        w.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_progress_bar_only_on_rank_0(make_weights, capsys, rank):
    w = make_weights(2, rank, config={"progress": True})
    capsys.readouterr()
    for name in w.routing:
        w.get_tensor(name)
    err = capsys.readouterr().err
    if rank == 0:
        assert "fastload-tgi" in err and "layers 4/4" in err
        assert "fastload-tgi: rank 0 ready: 4 layer groups" in err
    else:
        assert err == ""


def test_json_output_log_line_is_a_loguru_record(make_weights, capsys, monkeypatch):
    """Under the launcher (--json-output) the summary is a record the launcher parses and logs."""
    monkeypatch.setattr(sys, "argv", ["text-generation-server", "serve", "x", "--json-output"])
    w = make_weights(1, 0)
    for name in w.routing:
        w.get_tensor(name)
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 1 and err == ""
    assert records[0]["record"]["level"]["name"] == "INFO"
    assert records[0]["text"].startswith("fastload-tgi: rank 0 ready: 4 layer groups")
