"""The engine on a thread of its own, for the HTTP server.

``LLMEngine`` is synchronous and not thread-safe. ``AsyncEngine`` gives it one dedicated
thread, on which it is also built and warmed up (``launch``): OpenMP keeps a thread pool per
calling thread, and kernels issued from a second thread while the first one's pool lives run
at about half speed on a small host. The thread takes commands (add, abort, stop) from a
queue between steps and runs steps while any request is unfinished; torch releases the GIL
inside kernels, so the event loop stays responsive while a step runs. Outputs go back to the
loop in one callback per step. Every request reaches its end: finished, aborted by its caller
(its blocks freed at once), or failed with the error that stopped it.

Outputs are deltas, and a call holds at most one undelivered output per request: later ones
are merged into it while the caller has not read it. A caller that reads nothing for
``stall_seconds`` while its requests go on generating (a streaming client that stopped
reading) has its requests aborted, so a stalled client holds neither memory nor KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from brook_engine.core.llm_engine import LLMEngine
from brook_engine.core.output_stream import STALL_SECONDS, OutputStream, Sink
from brook_engine.core.scheduler import QueueFullError
from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.outputs import RequestOutput
from brook_engine.parallel.comm import ParallelGroupError
from brook_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine stopped (shutdown, or drain timeout) before the request ended."""


class EngineStepError(RuntimeError):
    """A step failed; the requests in it were ended. The server keeps serving."""


@dataclass(frozen=True)
class SubRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AsyncEngine:
    #: Idle seconds between heartbeats to the replica's other ranks.
    HEARTBEAT_SECONDS = 1.0

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.stall_seconds = stall_seconds
        self.fatal: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- lifecycle (event loop side) -----------------------------------------------------

    @classmethod
    async def launch(
        cls,
        build: Callable[[], tuple[LLMEngine, EngineMetrics | None]],
        on_fatal: Callable[[BaseException], None] | None = None,
        stall_seconds: float = STALL_SECONDS,
    ) -> AsyncEngine:
        """Run ``build`` (load, warm up, make the metrics) on a new engine thread, which then
        serves. Raises what ``build`` raised. ``on_fatal`` is called (on the event loop) if
        the engine later stops for good: a rank of its replica failed."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[AsyncEngine] = loop.create_future()

        def main() -> None:
            try:
                engine, metrics = build()
                self = cls(engine, metrics, on_fatal, stall_seconds)
                self._loop = loop
                self._thread = threading.current_thread()
                self._record()
            except BaseException as exc:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle_with, built, None, exc)
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle_with, built, self, None)
            self._run()

        threading.Thread(target=main, name="brook-engine", daemon=True).start()
        # Cancelling this call (shutdown while loading) cancels ``built``; the engine is then
        # stopped as soon as it exists.
        return await built

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._record()
        self._thread = threading.Thread(target=self._run, name="brook-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs and stop the thread."""
        if self._thread is None or self._stopped:
            return
        self._stopped = True
        self._commands.put(("stop", None))
        await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # -- requests (event loop side) ------------------------------------------------------

    async def add(
        self, requests: list[SubRequest], arrival_time: float | None = None
    ) -> OutputStream:
        """Queue ``requests`` (the choices of one API call) together. Raises
        ``RequestError`` / ``QueueFullError`` if the engine refuses them (then none runs);
        otherwise returns the stream of their outputs."""
        if not self.is_running or self._loop is None:
            raise EngineStoppedError("the engine is not running")
        sink = Sink(self.stall_seconds)
        accepted: asyncio.Future[None] = self._loop.create_future()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(("add", (requests, sink, accepted, arrival)))
        ids = [r.request_id for r in requests]
        try:
            await accepted
        except BaseException:  # refused, or the caller was cancelled while waiting
            self._commands.put(("abort", ids))
            raise
        return OutputStream(self.abort, sink, ids)

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_ids))

    def abort_all(self) -> None:
        """End every request now (the drain timeout ran out)."""
        self._commands.put(("abort_all", None))

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except ParallelGroupError as error:
            # The replica lost a rank: nothing more can run. End every request, say why,
            # and let the server exit non-zero (its /ready and /health fail meanwhile).
            exc = self._cause(error)
            log.error("the replica failed: %s", exc)
            self.fatal = exc
            self._stopped = True
            self._fail_all(EngineStoppedError(f"the engine's replica failed: {exc}"))
            self._record()
            if self.on_fatal is not None:
                self._call_soon(self.on_fatal, exc)
        finally:
            self.engine.shutdown()

    def _cause(self, error: ParallelGroupError) -> ParallelGroupError:
        """A local worker's exit says more than the broken connection it caused."""
        time.sleep(0.2)  # let a dying worker be reaped
        try:
            self.engine.check_workers()
        except ParallelGroupError as exited:
            return exited
        return error

    def _serve(self) -> None:
        engine = self.engine
        heartbeat = self.HEARTBEAT_SECONDS if engine.is_distributed else None
        while True:
            busy = engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy, timeout=None if busy else heartbeat)
            except queue.Empty:
                command = None
            if not busy and heartbeat is not None and engine.heartbeat_due(heartbeat):
                engine.heartbeat()  # also while commands keep arriving without a step
            stop = False
            while command is not None:
                stop = self._handle(*command) or stop
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if stop:
                self._fail_all(EngineStoppedError("the engine stopped before the request ended"))
                self._record()
                return
            if engine.has_unfinished_requests():
                engine.check_workers()
                try:
                    outputs = engine.step()
                except ParallelGroupError:
                    raise
                except Exception as exc:
                    if engine.is_distributed:
                        # The other ranks ran their part of the step; rank 0 cannot know
                        # where they stand, so the replica cannot go on.
                        raise ParallelGroupError(f"rank 0 failed a step: {exc}") from exc
                    log.exception("engine step failed; ending the requests it held")
                    self._fail_all(EngineStepError(f"the engine failed a step: {exc}"))
                else:
                    self._deliver(outputs)
            self._record()

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "stop":
            return True
        if kind == "add":
            requests, sink, accepted, arrival = payload
            self._add(requests, sink, accepted, arrival)
        elif kind == "abort":
            for request_id in payload:
                self._sinks.pop(request_id, None)
                self.engine.abort_request(request_id)
        elif kind == "abort_all":
            self._fail_all(EngineStoppedError("the server is shutting down"))
        return False

    def _add(
        self,
        requests: list[SubRequest],
        sink: Sink,
        accepted: asyncio.Future[None],
        arrival: float,
    ) -> None:
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, arrival)
                added.append(r.request_id)
                self._sinks[r.request_id] = sink
        except Exception as exc:
            # The call is refused whole: its earlier choices were never served (no step ran
            # between), so they are taken back rather than counted as received and aborted.
            refused = isinstance(exc, QueueFullError)
            for request_id in added:
                self._sinks.pop(request_id, None)
                self.engine.retract_request(request_id, refused)
            if refused:  # the choices after the refused one are demand turned away too
                untried = requests[len(added) + 1 :]
                self.engine.note_refused(sum(len(r.prompt_token_ids) for r in untried))
            self._call_soon(_settle, accepted, exc)
            return
        self._call_soon(_settle, accepted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        routed: list[tuple[Sink, RequestOutput | BaseException]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue  # its caller has gone; the abort is on its way
            if output.finished:
                del self._sinks[output.request_id]
            routed.append((sink, output))
        if routed:
            self._call_soon(_put_all, routed)

    def _fail_all(self, error: BaseException) -> None:
        routed: list[tuple[Sink, RequestOutput | BaseException]] = []
        for request_id in self.engine.abort_all():
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                routed.append((sink, error))
        if routed:
            self._call_soon(_put_all, routed)

    def _record(self) -> None:
        if self.metrics is not None:
            self.metrics.record(self.engine.stats(), self.engine.take_finished_stats())

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self._loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _settle_with(
    future: asyncio.Future[AsyncEngine], engine: AsyncEngine | None, error: BaseException | None
) -> None:
    if future.cancelled():
        if engine is not None:
            engine._stopped = True
            engine._commands.put(("stop", None))
        return
    if engine is not None:
        future.set_result(engine)
    else:
        future.set_exception(error or RuntimeError("the engine was not built"))


def _put_all(routed: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
    for sink, item in routed:
        sink.put_nowait(item)
