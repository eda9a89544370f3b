"""The engine-free API on ``s3://`` URIs: the same tensors as the local copy, per-rank reads that
the store serves without extra bytes, errors naming the URI and tensor, config and backend choice."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import vllm_fastload
from vllm_fastload.checkpoint import Checkpoint
from vllm_fastload.config import ConfigError, FastloadConfig
from vllm_fastload.errors import AccessDeniedError, CheckpointError
from vllm_fastload.format import SafetensorsFile
from vllm_fastload.readers import reader_traits
from vllm_fastload.sources import LocalSource, ObjectSource, Source
from vllm_fastload.tp_rules import rank_requests

from .test_sources import FAST, SHARD1, SHARD2, check_error

pytestmark = pytest.mark.timeout(120)

CONFIG = {"progress": False, "remote": FAST}


def local_tensors(local_checkpoint) -> dict[str, torch.Tensor]:
    return {**load_file(local_checkpoint / SHARD1), **load_file(local_checkpoint / SHARD2)}


def test_open_uri_gives_the_local_tensors(s3, local_checkpoint) -> None:
    want = local_tensors(local_checkpoint)
    with vllm_fastload.open(s3.uri(), config=CONFIG) as ckpt:
        assert ckpt.keys() == sorted(want)
        assert ckpt.is_remote and ckpt.backend == "host"
        assert ckpt.info("model.norm.weight").file.startswith(s3.uri() + "/")
        assert ckpt.metadata() == {"format": "pt"}
        for name, tensor in ckpt.iter_tensors():
            assert torch.equal(tensor, want[name]), name
        assert torch.equal(ckpt.get_tensor("model.embed_tokens.weight"), want["model.embed_tokens.weight"])
        half = ckpt.get_slice("model.layers.0.mlp.down_proj.weight", dim=1, start=64, length=128)
        assert torch.equal(half, want["model.layers.0.mlp.down_proj.weight"][:, 64:192])


def test_files_hold_object_sources(s3) -> None:
    ckpt = Checkpoint.discover(s3.uri(), remote=FAST)
    try:
        sf = ckpt.files[s3.uri(SHARD1)]
        assert isinstance(sf, SafetensorsFile) and isinstance(sf.source, ObjectSource)
        assert isinstance(sf.source, Source) and sf.fd is None and sf.identity is None and not sf.is_local
        assert sf.path == s3.uri(SHARD1)
        sf.check_unchanged()
        with pytest.raises(CheckpointError, match="not part of this checkpoint"):
            ckpt.file_for(s3.uri("other.safetensors"))
    finally:
        ckpt.close()


def test_local_source_fits_the_protocol(local_checkpoint) -> None:
    source = LocalSource(local_checkpoint / SHARD1)
    try:
        assert isinstance(source, Source) and source.fd >= 0 and source.size == source.identity.size
        buf = bytearray(100)
        source.submit_ranges_into([(8, memoryview(buf))]).result()
        assert bytes(buf) == (local_checkpoint / SHARD1).read_bytes()[8:108]
        with pytest.raises(CheckpointError, match="end of file") as info:
            source.read_into(source.size - 4, memoryview(bytearray(8)), tensor="t")
        assert info.value.tensor == "t"
    finally:
        source.close()
        source.close()  # idempotent
    assert source.fd == -1


def test_rank_reads_are_served_without_extra_bytes(s3, local_checkpoint) -> None:
    """TP=2 rank 1's slices: dim>0 slices row by row (strided_min_skip follows coalesce_gap), and the
    proxy serves exactly the bytes the plan reads."""
    want = local_tensors(local_checkpoint)
    config = {**CONFIG, "remote": {**FAST, "coalesce_gap": 64}}
    with vllm_fastload.open(s3.uri(), config=config) as ckpt:
        assert ckpt.strided_min_skip == 64
        requests = rank_requests(ckpt.tensors, 2, 1)
        plan = ckpt.plan(requests)
        s3.proxy.clear()
        got = dict(ckpt.iter_tensors(requests))
    served = sum(r.body_bytes for r in s3.proxy.gets())
    assert served == plan.read_bytes < 0.6 * ckpt.total_bytes
    for req in requests:
        full = want[req.name]
        expect = full if req.dim is None else full.narrow(req.dim, req.start, req.length)
        assert torch.equal(got[req.result_key], expect), req.result_key


def test_default_strided_min_skip_is_the_coalesce_gap(s3) -> None:
    with vllm_fastload.open(s3.uri(), config=CONFIG) as ckpt:
        assert ckpt.strided_min_skip == 1 << 20
    with vllm_fastload.open(s3.uri(), config={**CONFIG, "strided_min_skip": 4096}) as ckpt:
        assert ckpt.strided_min_skip == 4096


def test_read_into_owned_tensors(s3, local_checkpoint) -> None:
    want = local_tensors(local_checkpoint)
    dest = {name: torch.empty_like(want[name]) for name in ("model.norm.weight", "lm_head.weight")}
    with vllm_fastload.open(s3.uri(), config=CONFIG) as ckpt:
        ckpt.read_into(dest)
    for name, tensor in dest.items():
        assert torch.equal(tensor, want[name])


def test_denied_mid_load_names_uri_and_tensor(s3) -> None:
    with vllm_fastload.open(s3.uri(), config=CONFIG) as ckpt:
        s3.proxy.inject("status", status=403, code="AccessDenied")
        with pytest.raises(AccessDeniedError) as info:
            for _ in ckpt.iter_tensors():
                pass
    exc = info.value
    assert exc.file in (s3.uri(SHARD1), s3.uri(SHARD2)) and exc.tensor is not None
    check_error(exc, AccessDeniedError, exc.file, exc.tensor)


def test_remote_config_from_extra_config_and_env() -> None:
    assert FastloadConfig.build({"remote": {"timeout_s": 10}}).remote.timeout_s == 10
    assert FastloadConfig.from_env({"FASTLOAD_REMOTE": '{"timeout_s": 10}'}).remote.timeout_s == 10
    assert FastloadConfig().remote.coalesce_gap == 1 << 20
    with pytest.raises(ConfigError, match=r"remote\.timeout_s"):
        FastloadConfig.build({"remote": {"timeout_s": -1}})
    with pytest.raises(ConfigError, match="bogus"):
        FastloadConfig.from_env({"FASTLOAD_REMOTE": '{"bogus": 1}'})


def test_backend_choice_for_objects() -> None:
    cuda = torch.device("cuda", 0)
    assert reader_traits(FastloadConfig(), cuda, remote=True).backend == "cuda"
    assert reader_traits(FastloadConfig(), torch.device("cpu"), remote=True).backend == "host"
    with pytest.raises(ValueError, match="local files only"):
        reader_traits(FastloadConfig(backend="kvikio"), cuda, remote=True)


def test_cli_plan_on_a_uri(s3, capsys) -> None:
    from vllm_fastload.cli import main

    assert main(["plan", s3.uri(), "--tp", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert f"plan for {s3.uri()}" in out and SHARD1 in out and "of checkpoint" in out


def test_cuda_staging_fills_slots_from_objects(s3, local_checkpoint) -> None:
    """The GPU readers' staging step, on a CPU slot (the copy to the device needs a GPU): ranges
    and rows land packed in the slot, each at the offset it reports."""
    from vllm_fastload.plan import Rows
    from vllm_fastload.readers import ReadCall, RowsCall
    from vllm_fastload.readers.staging import fill_slot

    want = (local_checkpoint / SHARD2).read_bytes()
    ckpt = Checkpoint.discover(s3.uri(), remote=FAST)
    try:
        sf = ckpt.files[s3.uri(SHARD2)]
        rows = Rows(2000, 16, 100, 5)
        batch = [ReadCall(100, 50, "a"), ReadCall(4000, 300, "b"), RowsCall(rows, "rows"),
                 ReadCall(sf.source.size - 10, 10, "c")]
        slot = torch.zeros(4096, dtype=torch.uint8)
        placed = fill_slot(sf, memoryview(slot.numpy()), batch)
        assert [(p.offset, p.length, p.dest) for p in placed] == [(0, 50, "a"), (50, 300, "b"), (350, 80, "rows"),
                                                                  (430, 10, "c")]
        packed = b"".join(want[2000 + i * 100:2016 + i * 100] for i in range(5))
        assert bytes(slot[:440].numpy()) == want[100:150] + want[4000:4300] + packed + want[-10:]
    finally:
        ckpt.close()
