"""Run the server: uvicorn on the configured address, the model loading in the background,
and a graceful drain on SIGTERM (or Ctrl-C).

On the first signal the server keeps listening but answers new API calls with 503 (and
/ready with 503, so Kubernetes stops routing to it), lets in-flight requests finish for up to
``server.drainTimeoutSeconds``, aborts what is left, and exits 0; a model still loading stops
at its next step. A second Ctrl-C exits at once.

uvicorn runs with the server's limits: at most ``maxConnections`` connections, idle
keep-alive ones closed after ``keepAliveTimeoutSeconds``, and request headers that must be
complete within ``headerReadTimeoutSeconds`` (``limits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from brook_engine.config import EngineConfig
from brook_engine.core.ranks import GroupSpec, run_worker_pod
from brook_engine.core.serving_defaults import serving_defaults
from brook_engine.server.app import build_app
from brook_engine.server.limits import header_timeout_protocol
from brook_engine.server.state import ServerState

log = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.brook_state = state
        self.drain_timeout = drain_timeout
        self.failed: BaseException | None = None
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        state = self.brook_state
        state.is_draining = True
        if not state.is_ready:
            log.info("the model is still loading: stopping the model load")
        if state.num_in_flight:
            log.info(
                "draining: %d requests in flight, waiting up to %.0f s",
                state.num_in_flight,
                self.drain_timeout,
            )
            try:
                await asyncio.wait_for(state.idle.wait(), self.drain_timeout)
            except TimeoutError:
                log.warning(
                    "drain timeout: aborting %d requests still in flight", state.num_in_flight
                )
                if state.engine is not None:
                    state.engine.abort_all()
                try:
                    await asyncio.wait_for(state.idle.wait(), 10)
                except TimeoutError:
                    log.warning("%d responses did not close; exiting", state.num_in_flight)
        log.info("drained; shutting down")
        self.should_exit = True

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.should_exit = True


def serve(config: EngineConfig) -> int:
    """Serve until drained; the exit status (0, or 1 when the model failed to load or the
    replica lost a rank). In a replica of several devices this process takes its place from
    the environment (``parallel.launch``): on the first pod it is rank 0 and serves, on the
    others it runs that pod's workers."""
    config = serving_defaults(config)
    group: GroupSpec | None = None
    if config.parallel.world_size > 1:
        group = GroupSpec.from_environment(config)
        if group.pod_rank != 0:
            log.info(
                "worker pod %d of the replica: ranks %d-%d, rank 0 at %s:%d",
                group.pod_rank,
                group.local_ranks.start,
                group.local_ranks.stop - 1,
                group.rendezvous.host,
                group.rendezvous.port,
            )
            return run_worker_pod(config, group)
    holder: list[_DrainingServer] = []
    app = build_app(
        config, CollectorRegistry(), on_fatal=lambda exc: holder[0].fail(exc), group=group
    )
    state: ServerState = app.state.brook
    server = _DrainingServer(
        uvicorn_config(app, config), state, config.server.drain_timeout_seconds
    )
    holder.append(server)
    log.info(
        "serving %s on http://%s:%d (API key %s)",
        app.state.brook.served_name,
        config.server.host,
        config.server.port,
        "required" if config.server.api_key else "off",
    )
    server.run()
    status = 1 if server.failed is not None else 0
    if state.engine_thread is not None and state.engine_thread.is_alive():
        # The load did not reach its next step in time. Leaving the interpreter with native
        # code running on that thread would abort the process; leave without finalizing.
        log.warning("exiting while the model load still runs")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def uvicorn_config(app: Starlette, config: EngineConfig) -> uvicorn.Config:
    """uvicorn for ``app`` with the server's address, limits and timeouts."""
    server = config.server
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level="info",
        lifespan="on",
        http=header_timeout_protocol(server.header_read_timeout_seconds),
        limit_concurrency=server.max_connections,
        timeout_keep_alive=server.keep_alive_timeout_seconds,
    )
