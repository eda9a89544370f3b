"""Fixtures for object store tests: moto on loopback (once per session), a fault proxy per test.

Every client under test points at the proxy through the standard environment
(``AWS_ENDPOINT_URL`` and friends), exactly as a user would configure a private S3 store.
The whole directory skips when obstore or moto is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the [remote] extra (obstore) is not installed")
boto3 = pytest.importorskip("boto3", reason="moto[server] (with boto3) is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")

from vllm_fastload.tools.checkpoints import write_checkpoint  # noqa: E402

from .s3server import ACCESS_KEY_ID, BUCKET, PREFIX, SECRET, FaultProxy, MotoServer, S3Env  # noqa: E402

_CLOUD_ENV = ("AWS_", "GOOGLE_", "AZURE_", "GCS_", "GCP_", "OBJECT_STORE_")


def _client(url: str):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=ACCESS_KEY_ID,
                        aws_secret_access_key=SECRET)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def local_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("remote") / PREFIX, "tiny-llama", files=2)


@pytest.fixture(scope="session")
def s3_client(moto_server: MotoServer, local_checkpoint: Path):
    """A boto3 client straight to moto (not through the proxy); the bucket holds the checkpoint."""
    client = _client(moto_server.url)
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(local_checkpoint.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.name}", Body=path.read_bytes())
    return client


@pytest.fixture
def s3(moto_server: MotoServer, s3_client, monkeypatch) -> Iterator[S3Env]:
    """The proxy in front of moto, and an environment that points every client at it."""
    for key in list(os.environ):
        if key.startswith(_CLOUD_ENV):
            monkeypatch.delenv(key)
    with FaultProxy(moto_server.url) as proxy:
        env = {
            "AWS_ENDPOINT_URL": proxy.url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield S3Env(moto_server, proxy, BUCKET, PREFIX, env)
