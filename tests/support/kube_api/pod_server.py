"""A stand-in for a pod's container port: an HTTP server on 127.0.0.1 (a free port, its own
thread) answering set paths, for the pods ``proxy`` subresource (:mod:`.proxy`) to reach
once a test has set the pod's ``status.podIP`` to ``127.0.0.1``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class PodRequest:
    method: str
    path: str
    #: The raw query string (``a=1&b=2``), as it arrived.
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class PodAnswer:
    status: int
    content_type: str
    body: bytes


class PodServer:
    """``with PodServer() as pod:`` -- ``pod.port``; ``pod.answer(path, text, status=200,
    content_type=PROMETHEUS_TEXT)`` sets what a path answers (any method; other paths get a
    404); ``pod.requests`` lists what arrived."""

    def __init__(self) -> None:
        self.answers: dict[str, PodAnswer] = {}
        self.requests: list[PodRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"pod-server-{self.port}", daemon=True
        )
        self._thread.start()

    def answer(
        self,
        path: str,
        body: str | bytes,
        *,
        status: int = 200,
        content_type: str = PROMETHEUS_TEXT,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        with self._lock:
            self.answers[path] = PodAnswer(status, content_type, data)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> PodServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _serve(self, request: PodRequest) -> PodAnswer:
        with self._lock:
            self.requests.append(request)
            found = self.answers.get(request.path)
        return found or PodAnswer(404, "text/plain", b"404 page not found\n")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                request = PodRequest(
                    method=self.command,
                    path=url.path,
                    query=url.query,
                    headers=dict(self.headers.items()),
                    body=self.rfile.read(length) if length else b"",
                )
                answer = pod._serve(request)
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: tests read ``requests``

        return Handler
