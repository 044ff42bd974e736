"""Bounds on what clients may hold: API calls at once (503 with Retry-After beyond
``server.maxConcurrentRequests``, the probes exempt) and time to send a request's headers
(the connection is closed after ``server.headerReadTimeoutSeconds``). The body's time limit
is the routes' (``openai_routes``); idle keep-alive connections and the connection backstop
are uvicorn's own settings (``serve``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from brook_engine.server.errors import APIError

#: Paths that never count against the limit: kubelet and Prometheus must get through.
UNLIMITED_PATHS = frozenset({"/health", "/ready", "/metrics"})

log = logging.getLogger(__name__)


class ConcurrencyLimit:
    """ASGI middleware: at most ``limit`` API calls at once, from their first byte to their
    last; the next one gets 503 with ``Retry-After: 1`` and its connection closed
    (uvicorn's own limit answers without Retry-After, and to the probes too)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.num_active >= self.limit:
            refusal = APIError(
                503,
                f"the server is handling its limit of {self.limit} requests; retry shortly "
                "or on another replica",
                code="overloaded",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            await refusal.response()(scope, receive, send)
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    ``header_timeout`` seconds after it opened or after its previous response. (uvicorn
    only times idle keep-alive connections, and any byte stops that timer.)"""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout_seconds = header_timeout
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def _watch_headers(self) -> None:
            """Arm the deadline while the next request's headers are awaited (kept from the
            first wait, not renewed by each byte); disarm it once they are in."""
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if not waiting:
                self._stop_watching()
            elif self._header_deadline is None:
                self._header_deadline = self.loop.call_later(
                    self.header_timeout_seconds, self._expire
                )

        def _stop_watching(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _expire(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug(
                    "closing %s: no complete request headers in %s s",
                    self.client,
                    self.header_timeout_seconds,
                )
                self.transport.close()

    return HeaderTimeoutProtocol
