"""``read_body``, the operator's direct GET of a pod, against real servers on loopback that
misbehave: a redirect, a body too big, headers sent a byte at a time, silence."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from brook_operator.pod_http import PodReadError, read_body


@contextmanager
def _server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-connection-at-a-time server on 127.0.0.1 that reads the request, then hands
    the connection to ``answer``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                with contextlib.suppress(OSError):  # the reader cut the connection
                    answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/download"
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


def _reply(body: bytes, status: str = "200 OK", extra: str = "") -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        conn.sendall(head.encode() + body)

    return answer


def test_a_plain_answer_is_read() -> None:
    with _server(_reply(b'{"state": "downloading"}')) as url:
        assert read_body(url, 2.0) == '{"state": "downloading"}'


def test_a_redirect_is_not_followed() -> None:
    redirect = _reply(b"", "302 Found", "Location: http://169.254.169.254/\r\n")
    with _server(redirect) as url, pytest.raises(PodReadError, match="HTTP 302"):
        read_body(url, 2.0)


def test_a_body_over_the_limit_is_cut_off() -> None:
    too_big = pytest.raises(PodReadError, match="more than 65536 bytes")
    with _server(_reply(b"x" * 200_000)) as url, too_big:
        read_body(url, 2.0, max_bytes=65536)


@pytest.mark.parametrize("where", ["headers", "body", "silence"])
def test_a_server_dripping_its_answer_is_cut_at_the_deadline(where: str) -> None:
    def drip(conn: socket.socket) -> None:
        if where == "silence":
            time.sleep(2)
            return
        if where == "body":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(50):  # a byte every 0.1 s: each read alone is within the timeout
            conn.sendall(b"X-Header: 1\r\n"[:1] if where == "headers" else b"x")
            time.sleep(0.1)

    with _server(drip) as url:
        started = time.monotonic()
        with pytest.raises(PodReadError, match="no complete answer within 1 s"):
            read_body(url, 1.0)
        assert time.monotonic() - started < 2.5


def test_not_an_http_url_is_refused() -> None:
    with pytest.raises(PodReadError, match="not an http"):
        read_body("file:///etc/passwd", 1.0)
