"""A stand-in for the Hugging Face Hub on 127.0.0.1, serving one folder as a model repository:
the three endpoints ``huggingface_hub.snapshot_download`` calls (the revision's commit, the
file tree at that commit, each file). No Hub is reachable from the tests; the answers follow
the Hub's documented shapes, enough for the official client to download and verify."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "3f4e5d6c7b8a99887766554433221100ffeeddcc"


@dataclass
class Hub:
    url: str
    repo: str
    paths: list[str] = field(default_factory=list)
    """Every request as ``METHOD /path``, in order."""


def _handler(hub: Hub, folder: Path, rate: float | None) -> type[BaseHTTPRequestHandler]:
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(code)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if rate is None or not headers.get("ETag"):
                self.wfile.write(body)
                return
            step = max(1, int(rate / 20))  # a file at ``rate`` bytes/s, in 20 pieces a second
            for start in range(0, len(body), step):
                self.wfile.write(body[start : start + step])
                self.wfile.flush()
                time.sleep(0.05)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            hub.paths.append(f"{self.command} {self.path}")
            path = self.path.split("?", 1)[0]
            if path.startswith(f"/api/models/{hub.repo}/tree/"):
                tree = [
                    {"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for n, d in files.items()
                ]
                return self._json(tree)
            if path.startswith(f"/api/models/{hub.repo}/revision/"):
                siblings = [{"rfilename": n} for n in files]
                return self._json({"id": hub.repo, "sha": COMMIT, "siblings": siblings})
            prefix = f"/{hub.repo}/resolve/"
            if path.startswith(prefix):
                name = path.removeprefix(prefix).split("/", 1)[-1]
                if name in files:
                    etag = hashlib.sha1(files[name]).hexdigest()
                    headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
                    return self._send(200, files[name], headers)
            message = json.dumps({"error": "Repository not found"}).encode()
            self._send(404, message, {"X-Error-Code": "RepoNotFound"})

        def _json(self, document: object) -> None:
            self._send(200, json.dumps(document).encode(), {"Content-Type": "application/json"})

        def log_message(self, *args: object) -> None:
            del args

    return Handler


@contextmanager
def serving(folder: Path, repo: str, rate: float | None = None) -> Iterator[Hub]:
    """``folder`` as the Hub repository ``repo`` until the block ends; files sent at ``rate``
    bytes per second when given (a download slow enough to watch)."""
    hub = Hub("", repo)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, folder, rate))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def fetch(url: str, repo: str, output: Path, *extra: str) -> subprocess.Popen[str]:
    """``brook-engine fetch hf://repo --output output`` against the stand-in at ``url``, as
    an init container runs it (its own process)."""
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1"}
    command = [sys.executable, "-m", "brook_engine.cli", "fetch", f"hf://{repo}"]
    command += ["--output", str(output), "--revision", "main", *extra]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
