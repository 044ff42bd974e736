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

    metrics_require_api_key: bool = False
    """Ask /metrics for the API key too, when one is set (then Prometheus must send it as a
    bearer token). Off: /metrics is open, like the probes."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    """Largest request body; a larger one is refused with 413 as soon as it is seen."""

    max_concurrent_requests: int = Field(default=2048, ge=1, le=1_048_576)
    """API calls handled at once, from their first byte to their last (streams included);
    beyond it the API answers 503 with Retry-After. /health, /ready and /metrics do not
    count and keep answering."""

    max_connections: int = Field(default=4096, ge=2, le=1_048_576)
    """Open connections, idle keep-alive ones included; beyond it every request, probes
    included, gets uvicorn's plain 503. A backstop above maxConcurrentRequests."""

    keep_alive_timeout_seconds: int = Field(default=5, ge=1, le=3600)
    """An idle keep-alive connection is closed after this long."""

    header_read_timeout_seconds: float = Field(default=10, gt=0, le=3600)
    """A connection whose request headers are not complete this long after it opened (or
    after its previous response) is closed."""

    body_read_timeout_seconds: float = Field(default=60, gt=0, le=3600)
    """A request body not complete this long after its headers is refused with 408."""

    stream_stall_seconds: float = Field(default=60, gt=0, le=3600)
    """A call whose outputs stay unread this long while its requests keep generating (a
    streaming client that stopped reading) has its requests aborted and their KV blocks
    freed."""

    @model_validator(mode="after")
    def _connections_above_requests(self) -> ServerOptions:
        if self.max_connections <= self.max_concurrent_requests:
            raise ValueError(
                f"maxConnections ({self.max_connections}) must exceed maxConcurrentRequests "
                f"({self.max_concurrent_requests}): connections are the backstop, with room "
                "for probes and idle keep-alive connections; raise maxConnections"
            )
        return self


class ServerConfig(ServerOptions):
    """The OpenAI-compatible HTTP server."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    """Address to listen on. Loopback by default; the operator sets 0.0.0.0 in pods."""

    api_key: ApiKeyConfig | None = None
    """Require `Authorization: Bearer KEY` on the API; off when unset."""
