"""An object-store checkpoint cannot make the loader read outside its prefix: an index entry that
leaves it (``..``, a key from the bucket's root, another bucket's URI) is refused, naming the index
and the entry, and the store is never asked for the object it names (the proxy records every
request the store answered)."""

from __future__ import annotations

import json

import pytest

import vllm_fastload
from vllm_fastload.errors import OutsideCheckpointError

from .test_sources import FAST, SHARD1, SHARD2

pytestmark = pytest.mark.timeout(120)

EVIL = "evil-model"


@pytest.mark.parametrize("entry", [
    f"../tiny-llama/{SHARD2}",
    f"sub/../../tiny-llama/{SHARD2}",
    f"/tiny-llama/{SHARD2}",
    f"s3://other-bucket/{SHARD2}",
])
def test_an_index_entry_leaving_the_prefix_is_refused(s3, s3_client, local_checkpoint, entry: str) -> None:
    other = "other-bucket"
    if other not in {b["Name"] for b in s3_client.list_buckets()["Buckets"]}:
        s3_client.create_bucket(Bucket=other)
        s3_client.put_object(Bucket=other, Key=SHARD2, Body=(local_checkpoint / SHARD2).read_bytes())
    weight_map = json.loads((local_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    redirected = next(name for name, f in weight_map.items() if f == SHARD2)
    weight_map = {name: (entry if f == SHARD2 else f) for name, f in weight_map.items()}
    s3_client.put_object(Bucket=s3.bucket, Key=f"{EVIL}/{SHARD1}", Body=(local_checkpoint / SHARD1).read_bytes())
    s3_client.put_object(Bucket=s3.bucket, Key=f"{EVIL}/model.safetensors.index.json",
                         Body=json.dumps({"weight_map": weight_map}).encode())
    s3.proxy.clear()
    uri = f"s3://{s3.bucket}/{EVIL}"
    with pytest.raises(OutsideCheckpointError) as info:
        vllm_fastload.open(uri, config={"progress": False, "remote": FAST})
    assert info.value.file == f"{uri}/model.safetensors.index.json"
    assert repr(entry) in str(info.value)
    assert info.value.tensor in {name for name, f in weight_map.items() if f == entry}
    assert redirected  # the index did redirect a tensor of the real model
    asked = [r.path for r in s3.proxy.records]
    assert asked and all(p.startswith(f"/{s3.bucket}/") or p == f"/{s3.bucket}" for p in asked), asked
    assert not [p for p in asked if "tiny-llama" in p or SHARD2 in p or other in p], asked
