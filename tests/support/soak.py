"""A soak of the real HTTP server: random valid requests from many concurrent clients (whole
and streamed, n > 1, stops, seeds, logprobs, prefix-cache salts), a share of them cancelled
mid-flight, a few clients that stop reading a long stream, and malformed requests between
them. Plain asyncio sockets, so a client can close at any byte or keep a tiny receive
buffer (a stalled reader the server must notice).

``tests/integration/test_soak.py`` runs a short soak in every test run; the long form is a
benchmark (``BROOK_SOAK_REQUESTS=10000 pytest tests/integration/test_soak.py -s``) that
prints the figures docs/reliability.md reports."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WORDS = ("the", "river", "runs", "past", "stone", "and", "light", "over", "water", "a", "b")


@dataclass
class Reply:
    status: int
    body: bytes
    events: list[str] = field(default_factory=list)  # SSE data lines, when streamed


@dataclass
class SoakReport:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    cancelled: int = 0
    stalled: int = 0
    streamed: int = 0
    choices: int = 0
    failures: list[str] = field(default_factory=list)  # what broke a request's contract
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


class Client:
    """HTTP/1.1 over one connection per request (``Connection: close``)."""

    def __init__(self, host: str, port: int, api_key: str | None) -> None:
        self.host, self.port, self.api_key = host, port, api_key

    async def open(
        self, method: str, path: str, body: bytes = b"", receive_buffer: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connect, so the window starts small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        headers = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Connection: close",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        if self.api_key:
            headers.append(f"Authorization: Bearer {self.api_key}")
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + body)
        await writer.drain()
        return reader, writer

    async def request(
        self, method: str, path: str, body: bytes = b"", stop_after_events: int | None = None
    ) -> Reply:
        """The whole reply; with ``stop_after_events`` the connection is closed after that
        many SSE events (a client that goes away mid-stream)."""
        reader, writer = await self.open(method, path, body)
        try:
            status, headers = await _read_head(reader)
            chunked = headers.get("transfer-encoding") == "chunked"
            if not chunked:
                length = int(headers.get("content-length", "0"))
                return Reply(status, await reader.readexactly(length))
            events: list[str] = []
            buffer = b""
            async for piece in _chunks(reader):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    events.append(event.decode().removeprefix("data: "))
                    if stop_after_events is not None and len(events) >= stop_after_events:
                        return Reply(status, b"", events)
            return Reply(status, b"", events)
        finally:
            writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader) -> Any:
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


def random_request(rng: random.Random, vocab: int) -> tuple[str, dict[str, Any]]:
    """A valid request of any shape the server supports."""
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": rng.randint(1, 24),
        "temperature": rng.choice([0, 0, 0.7, 1.3, 1e-30]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    if rng.random() < 0.2:
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([1, 5, 50])
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "Answer briefly."})
        if rng.random() < 0.25:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        return CHAT, body
    if rng.random() < 0.5:
        body["prompt"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    else:
        body["prompt"] = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
    if rng.random() < 0.25:
        body["logprobs"] = rng.randint(0, 3)
    return COMPLETIONS, body


def _check(reply: Reply, body: dict[str, Any], cancelled: bool) -> str | None:
    """What is wrong with a reply to a valid request, or None."""
    if reply.status != 200:
        return f"status {reply.status}: {reply.body[:200]!r} {reply.events[-1:]}"
    if not body["stream"]:
        choices = json.loads(reply.body)["choices"]
        return None if len(choices) == body["n"] else f"{len(choices)} choices for n={body['n']}"
    if cancelled:
        return None
    if not reply.events or reply.events[-1] != "[DONE]":
        return f"stream ended without [DONE]: {reply.events[-2:]}"
    if any('"error"' in e for e in reply.events[:-1]):
        return f"error event: {[e for e in reply.events if 'error' in e][:1]}"
    return None


async def _one(client: Client, rng: random.Random, vocab: int, report: SoakReport) -> None:
    path, body = random_request(rng, vocab)
    cancel = rng.random() < 0.25
    data = json.dumps(body).encode()
    report.requests += 1
    report.choices += body["n"]
    report.streamed += body["stream"]
    if cancel and body["stream"]:
        reply = await client.request("POST", path, data, stop_after_events=rng.randint(1, 4))
    elif cancel:  # a whole-body client that gives up before the answer
        task = asyncio.ensure_future(client.request("POST", path, data))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        if not task.done():
            task.cancel()
            report.cancelled += 1
            report.statuses[499] += 1
            return
        reply = task.result()
        cancel = False
    else:
        reply = await client.request("POST", path, data)
    report.cancelled += cancel
    report.statuses[reply.status] += 1
    problem = _check(reply, body, cancel)
    if problem is not None:
        report.failures.append(f"{path} {json.dumps(body)[:300]}: {problem}")


async def stalled_reader(client: Client, hold_seconds: float) -> Reply:
    """A streaming client that reads the first bytes of a long answer, then nothing for
    ``hold_seconds`` (a tiny receive window, so the server's writes soon block)."""
    body = {
        "model": "tiny",
        "prompt": "the river",
        "max_tokens": 400,
        "n": 4,
        "logprobs": 20,
        "ignore_eos": True,
        "stream": True,
    }
    reader, writer = await client.open(
        "POST", COMPLETIONS, json.dumps(body).encode(), receive_buffer=2048
    )
    try:
        status, _ = await _read_head(reader)
        await reader.read(512)
        await asyncio.sleep(hold_seconds)
        return Reply(status, b"")
    finally:
        writer.close()


async def soak(
    client: Client,
    *,
    num_requests: int,
    concurrency: int,
    vocab: int,
    seed: int = 0,
    num_stalled: int = 0,
    stall_hold_seconds: float = 0.0,
) -> SoakReport:
    """``num_requests`` random requests, ``concurrency`` at a time, and ``num_stalled``
    stalled readers alongside."""
    rng = random.Random(seed)
    report = SoakReport()
    started = time.monotonic()
    queue = list(range(num_requests))

    async def worker(index: int) -> None:
        local = random.Random(rng.randrange(1 << 62) + index)
        while queue:
            queue.pop()
            await _one(client, local, vocab, report)

    stalls = [stalled_reader(client, stall_hold_seconds) for _ in range(num_stalled)]
    results = await asyncio.gather(
        *(worker(i) for i in range(concurrency)), *stalls, return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException):
            report.failures.append(f"client crashed: {result!r}")
        elif isinstance(result, Reply):
            report.stalled += 1
            if result.status != 200:
                report.failures.append(f"stalled reader got {result.status}")
    report.seconds = time.monotonic() - started
    return report


async def malformed(
    client: Client, cases: list[tuple[str, str, bytes | dict[str, Any], int, str | None]]
) -> list[str]:
    """Send each malformed request; returns what did not get its 4xx naming the field."""
    problems = []
    for name, path, body, status, param in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply = await client.request("POST", path, data)
        if reply.status != status or not 400 <= reply.status < 500:
            problems.append(f"{name}: status {reply.status}, expected {status}")
            continue
        error = json.loads(reply.body).get("error", {})
        if (
            param is not None
            and param != error.get("param")
            and param not in error.get("message", "")
        ):
            problems.append(f"{name}: the error does not name {param!r}: {error}")
    return problems
