"""GET from a pod directly, as the operator does for its ``/metrics`` and its download
progress: no proxy from the environment, no redirect (a pod must not be able to point the
operator elsewhere), bounded in time and in size."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

#: Largest body read (an engine's /metrics is a few tens of KiB).
MAX_BODY_BYTES = 4 * 1024 * 1024


class ScrapeError(Exception):
    """The endpoint did not answer, or its answer lacks what the reader needs."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a redirect is an error: the operator only talks to the pod itself


#: Direct connections only: no proxy from the environment, no redirects (a pod must not be
#: able to point the operator elsewhere).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
_CHUNK = 64 * 1024


def read_body(url: str, timeout: float, accept: str = "*/*") -> str:
    """GET ``url`` directly (no proxy, no redirect) within ``timeout`` overall and at most
    ``MAX_BODY_BYTES`` (a pod that sends its answer a byte at a time is cut off, not waited
    for); ``ScrapeError`` naming the URL otherwise."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            if response.status != 200:
                raise ScrapeError(f"{url}: HTTP {response.status}")
            while chunk := response.read1(_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ScrapeError(f"{url}: more than {MAX_BODY_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ScrapeError(f"{url}: no complete answer within {timeout:g} s")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ScrapeError(f"{url}: {exc}") from None
    return b"".join(chunks).decode("utf-8", errors="replace")
