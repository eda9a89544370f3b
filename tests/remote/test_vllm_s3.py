"""``vllm serve s3://...`` / ``LLM(model="s3://...", load_format="fastload")`` against moto on loopback.

vLLM 0.32 refuses every load format but its own streamers for an object-storage model;
``vllm_plugin.register()`` lets fastload through (see ``_allow_object_storage``). The first test
fails loudly when a vLLM upgrade moves that check; the other two start vLLM at TP=2 from
``s3://`` through the counting proxy: once to compare every parameter on both ranks with the
default loader on a local copy (the same reference run tests/vllm uses) and to count the bytes
each rank was served, once with the store denying reads mid-load.

vLLM fetches config.json through the Run:ai streamer (``runai-model-streamer[s3]``, in the
``test`` extra), configured by the same AWS_* variables plus path-style addressing.
"""

from __future__ import annotations

import inspect
import re
import time
from pathlib import Path

import pytest

from tests.vllm.conftest import run_scenario
from tests.vllm.test_vllm_loader import assert_ok, summaries

from .s3server import BUCKET

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "qwen2"  # a tests/vllm architecture: its default-loader run at TP=2 is shared
#: Per-row requests for dim>0 slices (coalesce_gap also sets strided_min_skip for objects) and a
#: header prefetch that does not fetch a tiny shard whole: so the store serves what the plan reads.
REMOTE = {"coalesce_gap": 64, "header_prefetch": "16KiB", "timeout_s": 10, "max_retries": 1,
          "retry_timeout_s": 10}
MOVED = "vLLM moved the object-storage check; update vllm_plugin.compat.allow_object_storage"


@pytest.fixture(scope="module")
def model_uri(s3_client, checkpoints) -> str:
    """The qwen2 checkpoint of tests/vllm, uploaded to moto below ``qwen2/``."""
    for path in sorted(checkpoints[MODEL].iterdir()):
        if path.is_file() and not path.name.startswith("."):
            s3_client.put_object(Bucket=BUCKET, Key=f"{MODEL}/{path.name}", Body=path.read_bytes())
    return f"s3://{BUCKET}/{MODEL}"


@pytest.fixture
def vllm_s3_env(s3, tmp_path, monkeypatch) -> dict[str, str]:
    """What vLLM's Run:ai streamer needs beside the AWS_* variables the ``s3`` fixture sets."""
    env = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "VLLM_ASSETS_CACHE": str(tmp_path / "assets")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_vllm_config_accepts_fastload_for_object_storage(vllm_s3_env, model_uri) -> None:
    import vllm_fastload.vllm_plugin as plugin

    plugin.register()
    plugin.register()  # idempotent: wrapped once
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    method = VllmConfig.try_verify_and_update_config
    original = inspect.unwrap(method)
    assert original is not method and inspect.unwrap(original) is original
    source = inspect.getsource(original)
    assert re.search(r'load_format not in \(\s*"modelexpress",\s*"runai_streamer",\s*"runai_streamer_sharded",?\s*\)',
                     source), MOVED
    assert "model_weights" in source and "is_runai_obj_uri" in source, MOVED

    def build(load_format: str) -> VllmConfig:
        model = ModelConfig(model=model_uri, tokenizer=model_uri, dtype="bfloat16", max_model_len=128,
                            skip_tokenizer_init=True, enforce_eager=True)
        assert model.model_weights == model_uri and Path(model.model, "config.json").is_file()
        return VllmConfig(model_config=model, load_config=LoadConfig(load_format=load_format))

    config = build("fastload")
    assert config.load_config.load_format == "fastload", MOVED
    assert config.model_config.model_weights == model_uri  # restored after the check
    with pytest.raises(ValueError, match="object storage"):
        build("safetensors")  # every other format is still refused, as vLLM decides


def test_tp2_from_s3_equals_default_loader(vllm_s3_env, s3, model_uri, checkpoints, scenarios, tmp_path) -> None:
    ref = scenarios.get(MODEL, checkpoints[MODEL], "safetensors", 2)
    assert_ok(ref)
    s3.proxy.clear()
    fast = run_scenario(tmp_path, "s3-fastload-tp2", model_uri, "fastload", 2, extra={"remote": REMOTE},
                        env=vllm_s3_env)
    assert_ok(fast)

    assert len(fast["digests"]) == len(ref["digests"]) == 2
    for rank, (got, want) in enumerate(zip(fast["digests"], ref["digests"])):
        assert got.keys() == want.keys()
        assert not [name for name in want if got[name] != want[name]], f"rank {rank} differs"
    assert fast["tokens"] == ref["tokens"] and fast["logprobs"] == ref["logprobs"]

    lines = summaries(fast["log"])
    assert sorted(lines) == [0, 1], fast["log"][-3000:]
    assert all(groups[5] == "host" for groups in lines.values())
    # Objects share row-parallel reads between the ranks by default (row_exchange "auto").
    shared = re.findall(r"fastload rank \d/2: .*; (\d+) sliced tensors read as whole rows shared", fast["log"])
    assert len(shared) == 2 and all(int(n) > 0 for n in shared), fast["log"][-3000:]
    assert model_uri in fast["log"] or "load_format=fastload" in fast["log"]

    # What the store served for the weights, counted at the proxy: each rank its share only.
    shards = sorted(p for p in checkpoints[MODEL].glob("*.safetensors"))
    checkpoint_bytes = sum(p.stat().st_size for p in shards)
    gets = [r for r in s3.proxy.records if r.method == "GET" and r.path.endswith(".safetensors")]
    assert gets and all(r.range and r.range.startswith("bytes=") for r in gets), "whole-object GETs"
    assert {r.path.rsplit("/", 1)[-1] for r in gets} == {p.name for p in shards}
    per_rank = sum(r.body_bytes for r in gets) / 2
    # Half of every tensor but the few read whole on both ranks (norms, biases), and the headers.
    assert per_rank <= 0.55 * checkpoint_bytes, f"each rank was served {per_rank / checkpoint_bytes:.3f} of it"


def test_store_denying_reads_mid_load_stops_both_ranks(vllm_s3_env, s3, model_uri, tmp_path) -> None:
    # Headers (the first GET of each object) pass; every read of tensor data is denied.
    s3.proxy.inject("status", status=403, code="AccessDenied", applies=lambda method, path, headers: (
        method == "GET" and path.endswith(".safetensors") and not headers.get("range", "").startswith("bytes=0-")))
    start = time.monotonic()
    result = run_scenario(tmp_path, "s3-denied-tp2", model_uri, "fastload", 2, extra={"remote": REMOTE},
                          env=vllm_s3_env, timeout=400)
    elapsed = time.monotonic() - start
    assert "error" in result and "digests" not in result, "vLLM started although the store denied every read"
    assert elapsed < 300, f"start-up took {elapsed:.0f} s to fail"
    log = result["log"]
    # Each rank stops on its own denied read, with the object's URI and the tensor being read.
    named = (rf"AccessDeniedError: GET bytes \d+-\d+: access denied.* while reading model\.[\w.]+.* "
             rf"\(file '{re.escape(model_uri)}/model-0000[12]-of-00002\.safetensors', tensor 'model\.[\w.]+'\)")
    for rank in (0, 1):
        assert re.search(rf"Worker_TP{rank}\b.*{named}", log), log[-4000:]
    assert any(r.fault for r in s3.proxy.records)
