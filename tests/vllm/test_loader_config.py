"""The loader's configuration checks that need no vLLM start."""

from __future__ import annotations

import pytest
from vllm.config.load import LoadConfig

from vllm_fastload.errors import ConfigError
from vllm_fastload.vllm_plugin.loader import FastloadModelLoader


def _loader(extra: dict) -> FastloadModelLoader:
    return FastloadModelLoader(LoadConfig(load_format="fastload", model_loader_extra_config=extra))


def test_credentials_in_the_extra_config_are_refused():
    """vLLM logs --model-loader-extra-config verbatim: a key there would end up in every log."""
    with pytest.raises(ConfigError, match=r"aws_secret_access_key .* environment") as err:
        _loader({"remote": {"store_options": {"aws_secret_access_key": "s3cr3t-value", "allow_http": "true"}}})
    assert "s3cr3t-value" not in str(err.value)
    loader = _loader({"threads": 3, "direct_io": "never", "remote": {"store_options": {"allow_http": "true"}}})
    assert loader.config.threads == 3 and loader.config.direct_io == "never"
