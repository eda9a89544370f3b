"""fastload's options as an engine hands them to its loader (``--model-loader-extra-config``).

Both engines take a JSON object there and print it verbatim in their start-up logs; fastload
reads it over the ``FASTLOAD_*`` environment (``FastloadConfig.for_engine``), so that an unknown key
or a bad value stops the start before anything is read, naming the key.
"""

from __future__ import annotations

from typing import Any

from vllm_fastload import ConfigError, FastloadConfig

#: Store option names that hold credentials (obstore's S3/GCS/Azure option names contain one of these).
_SECRET_WORDS = ("secret", "token", "password", "key", "sas", "credential")


def loader_config(extra: dict[str, Any] | None, engine: str) -> FastloadConfig:
    """The config a loader runs with: the environment's ``FASTLOAD_*``, ``extra`` on top."""
    extra = dict(extra or {})
    refuse_secrets(extra, engine)
    return FastloadConfig.for_engine(extra)


def refuse_secrets(extra: dict[str, Any], engine: str) -> None:
    """The engine prints ``--model-loader-extra-config`` verbatim in its start-up log, so credentials
    there would be in every log line shipped anywhere: stop with a pointer to the environment."""
    remote = extra.get("remote")
    options = (remote.get("store_options") or {}) if isinstance(remote, dict) else {}
    found = sorted(k for k in options if any(w in str(k).lower() for w in _SECRET_WORDS))
    if found:
        raise ConfigError(f"remote.store_options {', '.join(found)} in --model-loader-extra-config would be printed "
                          f"in {engine}'s start-up log: pass credentials through the environment "
                          "(AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...) or "
                          "FASTLOAD_REMOTE")
