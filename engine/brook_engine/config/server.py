"""The HTTP server: address, authentication, metrics and drain."""

from __future__ import annotations

from pydantic import Field, model_validator

from brook_engine.config.base import Section


class ApiKeyConfig(Section):
    """Where the API key is read from (exactly one source). The key itself never appears in
    the configuration, so the configuration can be logged and mounted freely."""

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)
    """Environment variable holding the key."""

    file: str | None = Field(default=None, min_length=1, max_length=4096)
    """File holding the key (surrounding whitespace ignored)."""

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.env is None) == (self.file is None):
            raise ValueError("set exactly one of env and file")
        return self


class ServerOptions(Section):
    """Server settings that mean the same on a laptop and in a pod."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the API, /metrics, /health and /ready."""

    metrics: bool = True
    """Serve Prometheus metrics on /metrics."""

    drain_timeout_seconds: float = Field(default=30, ge=0, le=3600)
    """On SIGTERM, time in-flight requests get to finish before the server exits."""


class ServerConfig(ServerOptions):
    """The OpenAI-compatible HTTP server."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    """Address to listen on. Loopback by default; the operator sets 0.0.0.0 in pods."""

    api_key: ApiKeyConfig | None = None
    """Require `Authorization: Bearer KEY` on the API; off when unset."""
