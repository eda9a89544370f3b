"""``RemoteConfig``: how fastload talks to an object store, validated like ``FastloadConfig``.

Endpoint and credentials normally come from the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_NAME``, ...), read by the store
client itself; the fields here say what the environment cannot, and tune requests for
stores whose latency is milliseconds, not microseconds. Secrets given here are ``SecretStr``
so that fastload never shows them in a repr, a log line or an error. (vLLM itself prints its
``--model-loader-extra-config``, so the vLLM loader refuses credentials there.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    WrapSerializer,
    field_validator,
)

from vllm_fastload.errors import ConfigError
from vllm_fastload.frozen import FrozenMap


class RemoteConfig(BaseModel):
    """Object store settings. All fields are optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_size: ByteSize = Field(ByteSize(8 << 20), description="Largest ranged GET. Object stores answer "
                                   "in ms and stream each connection at ~50-100 MB/s, so 8-16 MiB requests "
                                   "amortise the latency without holding much memory per request.")
    max_in_flight: int = Field(32, ge=1, le=1024, description="Most ranged GETs in flight at once per process "
                               "(throughput comes from parallel connections); also bounded by the memory "
                               "budget, see in_flight_limit().")
    coalesce_gap: ByteSize = Field(ByteSize(1 << 20), description="Ranges of one object closer than this are "
                                   "read as one request, gap included: a request costs about as much as "
                                   "transferring this many bytes.")
    header_prefetch: ByteSize = Field(ByteSize(1 << 20), description="First request of every object: the "
                                      "8-byte length and the header in one GET unless the header is larger.")
    timeout_s: float = Field(30.0, gt=0, description="Per-request limit, connect to last body byte; a request "
                             "that runs over is retried, then reported.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Limit for establishing a connection.")
    max_retries: int = Field(5, ge=0, le=100, description="Retries of a failed request (5xx, throttling, "
                             "timeouts, dropped connections), with exponential backoff and jitter.")
    retry_timeout_s: float = Field(60.0, gt=0, description="No retry starts later than this after a request's "
                                   "first attempt; bounds how long a failing store can delay the error.")
    endpoint: str | None = Field(None, description="Endpoint of an S3-compatible store, GCS base URL or Azure "
                                 "endpoint; default: the environment (AWS_ENDPOINT_URL, ...) or the cloud's own.")
    region: str | None = Field(None, description="S3 region; default: AWS_REGION / AWS_DEFAULT_REGION / profile.")
    profile: str | None = Field(None, description="AWS profile from ~/.aws (needs boto3); default: AWS_PROFILE "
                                "when no access key is in the environment.")
    anonymous: bool = Field(False, description="Send unsigned requests (public buckets); no credentials looked up.")
    virtual_hosted_style: bool | None = Field(None, description="S3 bucket in the host name instead of the path; "
                                              "default: the environment or path style.")
    store_options: Annotated[Mapping[str, SecretStr], AfterValidator(FrozenMap),
                             WrapSerializer(lambda value, dump: dump(dict(value)))] = Field(
        default_factory=FrozenMap, description="Further obstore store "
                                                "options (S3Config / GCSConfig / AzureConfig keys), e.g. "
                                                "access_key_id; values are treated as secrets.")

    @field_validator("request_size", "coalesce_gap", "header_prefetch")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 64:
            raise ValueError("must be at least 64 bytes")
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must start with http:// or https://, got {value!r}")
        return value

    def in_flight_limit(self, memory_budget: int) -> int:
        """Requests in flight so that their response bodies (held until copied into place) take
        at most a quarter of the memory budget, as the cuda reader's staging does."""
        return max(1, min(self.max_in_flight, int(memory_budget) // 4 // int(self.request_size)))

    def secrets(self) -> list[str]:
        """Secret values given in this config, for scrubbing messages."""
        return [v.get_secret_value() for v in self.store_options.values()]

    @classmethod
    def build(cls, values: RemoteConfig | dict[str, Any] | None = None) -> RemoteConfig:
        """Validate a dict into a config with one error naming every bad field."""
        if isinstance(values, RemoteConfig):
            return values
        try:
            return cls(**dict(values or {}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                                 for e in exc.errors())
            raise ConfigError(f"invalid remote configuration: {problems} "
                              f"(known fields: {', '.join(cls.model_fields)})") from None
