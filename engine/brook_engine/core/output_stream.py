"""What an API call reads from the engine: the outputs of its requests, as deltas, with at
most one undelivered output per request (a later one is merged into the unread one), so a
caller that stops reading holds only what was generated since. A caller that reads nothing
for ``stall_seconds`` while its requests go on generating has them aborted."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from brook_engine.outputs import RequestOutput


class RequestFailedError(RuntimeError):
    """One request failed on its own (e.g. its logits could not be sampled); the engine and
    every other request go on."""


class ClientStalledError(RuntimeError):
    """The caller read nothing for too long while its requests generated; they were aborted."""


#: Seconds a caller may leave its outputs unread while its requests generate.
STALL_SECONDS = 60.0


class Sink:
    """One call's undelivered outputs (event loop only): at most one per request, a later
    output merged into the unread one; then the error that ended the call, if any."""

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self.on_stall: Callable[[], None] = lambda: None
        self._outputs: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._unread_since: float | None = None  # when the caller last had nothing to read
        self._ready = asyncio.Event()

    @property
    def num_unread(self) -> int:
        """Outputs waiting for the caller: at most one per request."""
        return len(self._outputs)

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            unread = self._outputs.get(item.request_id)
            self._outputs[item.request_id] = item if unread is None else _merged(unread, item)
            now = time.monotonic()
            if self._unread_since is None:
                self._unread_since = now
            elif self._error is None and now - self._unread_since > self.stall_seconds:
                self._error = ClientStalledError(
                    f"the client read nothing for {self.stall_seconds:.0f} s; its requests "
                    "were aborted"
                )
                self.on_stall()
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._outputs and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._outputs:
            assert self._error is not None
            return self._error
        request_id = next(iter(self._outputs))
        output = self._outputs.pop(request_id)
        self._unread_since = time.monotonic() if self._outputs else None
        return output


def _merged(unread: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` with the deltas of the unread output before it prepended."""
    logprobs = later.delta_logprobs
    if logprobs is not None:
        logprobs = (unread.delta_logprobs or []) + logprobs
    return dataclasses.replace(
        later,
        delta_text=unread.delta_text + later.delta_text,
        delta_token_ids=unread.delta_token_ids + later.delta_token_ids,
        delta_logprobs=logprobs,
    )


class OutputStream:
    """Outputs of one call's requests as (index, output), until all have finished.
    ``close()`` aborts those still running and frees their blocks; call it when the caller
    stops reading early (client gone). A request that fails raises ``RequestFailedError``
    (the call's other requests are aborted: a call succeeds or fails as a whole)."""

    def __init__(
        self, abort: Callable[[list[str]], None], sink: Sink, request_ids: list[str]
    ) -> None:
        self._abort = abort
        self._sink = sink
        self._index = {request_id: i for i, request_id in enumerate(request_ids)}
        self._pending = set(request_ids)
        self._stalled = False  # aborted for not reading: the caller gets the error still
        sink.on_stall = self._on_stall

    @property
    def num_unread(self) -> int:
        return self._sink.num_unread

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._pending and not self._stalled:
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, RequestOutput) and item.error is not None:
            self._pending.discard(item.request_id)
            item = RequestFailedError(f"request failed: {item.error}")
        if isinstance(item, BaseException):
            self._stalled = False
            self.close()
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return self._index[item.request_id], item

    def _on_stall(self) -> None:
        self.close()
        self._stalled = True

    def close(self) -> None:
        if self._pending:
            self._abort(sorted(self._pending))
            self._pending.clear()
