"""GET from a pod (or a server) directly, as the operator reads an engine's ``/metrics`` and
a model download's progress, and ``brook monitor`` reads servers and Prometheus: no proxy
from the environment and no redirect (a pod must not be able to point the operator
elsewhere), and bounded — in time overall, headers included (a watchdog cuts the connection
at the deadline, so a server sending a byte a second cannot hold a reader), and in size."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse

#: Largest body read by default (an engine's /metrics is a few tens of KiB).
MAX_BODY_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024


class PodReadError(Exception):
    """The endpoint did not answer in time, or its answer is not what the reader needs."""


def read_body(
    url: str, timeout: float, accept: str = "*/*", max_bytes: int = MAX_BODY_BYTES
) -> str:
    """GET ``url`` (http or https) within ``timeout`` overall and at most ``max_bytes``;
    ``PodReadError`` naming the URL otherwise (an answer other than 200 included)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PodReadError(f"{url}: not an http(s) URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        connection = kind(parts.hostname, parts.port, timeout=timeout)
    except ValueError as exc:  # a port that is not a number
        raise PodReadError(f"{url}: {exc}") from None
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    try:
        connection.request("GET", path, headers={"Accept": accept})
        response = connection.getresponse()
        if response.status != 200:
            raise PodReadError(f"{url}: HTTP {response.status}")
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(_CHUNK):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise PodReadError(f"{url}: more than {max_bytes} bytes")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise PodReadError(f"{url}: no complete answer within {timeout:g} s") from None
        raise PodReadError(f"{url}: {exc}") from None
    finally:
        watchdog.cancel()
        connection.close()
    if expired.is_set():
        raise PodReadError(f"{url}: no complete answer within {timeout:g} s")
    return b"".join(chunks).decode("utf-8", errors="replace")
