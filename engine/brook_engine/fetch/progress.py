"""A download's progress, served as JSON on the pod's API port while the init container runs
(``brook-engine fetch --progress-port``): the operator reads it into the resource's status.
The pod holds no API token, so it cannot write status itself; the engine's port is free
until the engine starts, and the operator already reaches it for ``/metrics``.

The bytes are counted on disk, not inside the Hub client: the files of the listing that are
in the folder, plus the client's partial files (``*.incomplete``). So a replica waiting on
another's download into a shared folder reports that download's progress too, and nothing
depends on the client's internals but where it keeps partial files.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

from brook_engine.config import DOWNLOAD_PROGRESS_PATH

#: The path the progress is served at.
PROGRESS_PATH = DOWNLOAD_PROGRESS_PATH
#: How often the bytes on disk are counted (for the rate) and over how long the rate is taken.
SAMPLE_SECONDS = 2.0
RATE_WINDOW_SECONDS = 30.0

State = Literal["starting", "waiting", "downloading", "complete", "failed"]
#: ``{path in the repository: size}`` of the files this download takes, or None (unknown).
Lister = Callable[[], dict[str, int] | None]


class Progress:
    """What one ``fetch`` has done so far. ``state`` is set by the fetch; the listing (what
    the download will take, for the total) is asked for once, off the download's path, when
    the state first leaves ``starting``: an already-complete folder asks the Hub nothing."""

    def __init__(self, model: str, folder: Path, lister: Lister) -> None:
        self.model = model
        self.folder = folder
        self.started_at = time.time()
        self.state: State = "starting"
        self._lister = lister
        self._files: dict[str, int] | None = None
        self._listed = False
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def set_state(self, state: State) -> None:
        self.state = state

    def _listing(self) -> dict[str, int] | None:
        if not self._listed and self.state in ("waiting", "downloading"):
            self._listed = True
            try:
                self._files = self._lister()
            except Exception as exc:  # no total is a lesser answer, never a failure
                print(f"download size unknown: {exc}", file=sys.stderr, flush=True)
        return self._files

    def _on_disk(self, files: dict[str, int] | None) -> tuple[int, int]:
        """(bytes, whole files) of this download in the folder now."""
        done = whole = 0
        for name, size in (files or {}).items():
            try:
                present = (self.folder / name).stat().st_size
            except OSError:
                continue
            done += min(present, size)
            whole += present >= size
        partial = self.folder / ".cache" / "huggingface" / "download"
        for dirpath, _, names in os.walk(partial):
            for name in names:
                if name.endswith(".incomplete"):
                    try:
                        done += (Path(dirpath) / name).stat().st_size
                    except OSError:
                        continue  # moved into place meanwhile
        return done, whole

    def sample(self) -> dict[str, object]:
        """The progress now, as served (camelCase, like the status it becomes)."""
        with self._lock:
            files = self._listing()
            done, whole = self._on_disk(files)
            total = sum(files.values()) if files is not None else None
            if total is not None:
                done = min(done, total)
            if self.state == "complete" and total is not None:
                done, whole = total, len(files or {})
            now = time.monotonic()
            self._samples.append((now, done))
            while self._samples and now - self._samples[0][0] > RATE_WINDOW_SECONDS:
                self._samples.popleft()
            first_time, first_done = self._samples[0]
            rate = (done - first_done) / (now - first_time) if now > first_time else None
            return {
                "model": self.model,
                "state": self.state,
                "bytesDone": done,
                "bytesTotal": total,
                "filesDone": whole,
                "filesTotal": len(files) if files is not None else None,
                "bytesPerSecond": round(rate, 1) if rate is not None else None,
                "startedAt": round(self.started_at, 3),
            }


def _handler(progress: Progress) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != PROGRESS_PATH:
                self.send_error(404)
                return
            body = json.dumps(progress.sample()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            del args  # the init container's log is for the download

    return Handler


class ProgressServer:
    """``progress`` on ``port`` (every interface: the operator reads it by the pod's IP),
    with a sampler keeping the rate current between reads. A port that cannot be bound is
    a warning: the download goes on without its progress."""

    def __init__(self, progress: Progress, port: int) -> None:
        self.progress = progress
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: ThreadingHTTPServer | None = None
        try:
            self._server = ThreadingHTTPServer(("", port), _handler(progress))
        except OSError as exc:
            print(f"progress not served on port {port}: {exc}", file=sys.stderr, flush=True)

    def __enter__(self) -> ProgressServer:
        if self._server is not None:
            self._server.daemon_threads = True
            self._threads = [
                threading.Thread(target=self._server.serve_forever, daemon=True),
                threading.Thread(target=self._sample, daemon=True),
            ]
            for thread in self._threads:
                thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.progress.sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)


def hub_lister(
    repo: str, revision: str | None, include: Sequence[str], exclude: Sequence[str]
) -> Lister:
    """The Hub's file listing of ``repo`` at ``revision``, filtered as the download filters
    it (the Hub client's own pattern matching)."""

    def listing() -> dict[str, int] | None:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
        from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

        # filter_repo_objects: the patterns as snapshot_download matches them (public; the
        # package's typing just does not re-export it)

        tree = HfApi().list_repo_tree(repo, revision=revision, recursive=True)
        sizes = {e.path: int(e.size) for e in tree if isinstance(e, RepoFile)}
        kept = filter_repo_objects(
            sizes, allow_patterns=list(include), ignore_patterns=list(exclude) or None
        )
        return {name: sizes[name] for name in kept}

    return listing
