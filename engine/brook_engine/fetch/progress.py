"""A download's progress, served as JSON on the pod's API port while the init container runs
(``brook-engine fetch --progress-port``): the operator reads it into the resource's status.
The pod holds no API token, so it cannot write status itself; the engine's port is free
until the engine starts, and the operator already reaches it for ``/metrics``.

The bytes are counted on disk, not inside the Hub client: the listed files in place, plus
the client's partial files (``*.incomplete`` under ``.cache/huggingface/download``, where
huggingface_hub keeps them; it writes them in 10 MiB pieces, so the count moves in such
steps). A replica waiting on another's download into a shared folder thus reports that
download too. One sampler thread lists the files (once the download starts, retried until
the Hub answers) and counts them every ``SAMPLE_SECONDS``; a request is answered with its
latest count, so no request waits on the Hub or the disk.
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

#: Where the Hub client keeps, inside the folder it downloads into, its metadata and the
#: partial files of the downloads under way (``*.incomplete``).
CLIENT_FOLDER = Path(".cache", "huggingface", "download")
#: How often the bytes on disk are counted, and over how long the rate is taken.
SAMPLE_SECONDS = 1.0
RATE_WINDOW_SECONDS = 30.0
#: Wait before asking the Hub for the listing again after it failed.
LIST_RETRY_SECONDS = 10.0

State = Literal["starting", "waiting", "downloading", "complete", "failed"]
#: ``{path in the repository: size}`` of the files this download takes.
Lister = Callable[[], dict[str, int]]


class Progress:
    """What one ``fetch`` has done so far. ``state`` is set by the fetch; ``sample`` (the
    sampler thread's, or a test's) lists the files once the state has left ``starting``
    (an already-complete folder asks the Hub nothing) and counts them."""

    def __init__(self, model: str, folder: Path, lister: Lister) -> None:
        self.model = model
        self.folder = folder
        self.started_at = time.time()
        self.state: State = "starting"
        self._lister = lister
        self._files: dict[str, int] | None = None
        self._next_list = 0.0
        self._samples: deque[tuple[float, int]] = deque()
        self.latest: dict[str, object] = self._document(self.state, 0, None, 0, None)

    def set_state(self, state: State) -> None:
        self.state = state

    def _listing(self, state: State) -> dict[str, int] | None:
        now = time.monotonic()
        if self._files is None and state in ("waiting", "downloading") and now >= self._next_list:
            try:
                self._files = self._lister()
            except Exception as exc:  # no total is a lesser answer, never a failure
                self._next_list = now + LIST_RETRY_SECONDS
                print(f"download size unknown for now: {exc}", file=sys.stderr, flush=True)
            else:
                self._samples.clear()  # the bytes already there are not this second's
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
        for dirpath, _, names in os.walk(self.folder / CLIENT_FOLDER):
            for name in names:
                if name.endswith(".incomplete"):
                    try:
                        info = (Path(dirpath) / name).stat()
                    except OSError:
                        continue  # moved into place meanwhile
                    # a file written out of order may be longer than what it holds
                    done += min(info.st_size, info.st_blocks * 512)
        return done, whole

    def sample(self) -> dict[str, object]:
        """Count now; the answer (camelCase, like the status it becomes) is also kept as
        ``latest``."""
        state = self.state
        files = self._listing(state)
        done, whole = self._on_disk(files)
        total = sum(files.values()) if files is not None else None
        if total is not None:
            done = min(done, total)
            if state == "complete":
                done, whole = total, len(files or {})
        rate = None
        if files is not None:
            now = time.monotonic()
            self._samples.append((now, done))
            while now - self._samples[0][0] > RATE_WINDOW_SECONDS:
                self._samples.popleft()
            first_time, first_done = self._samples[0]
            if now > first_time:  # a dip (a file between partial and place) is no rate
                rate = max(0.0, (done - first_done) / (now - first_time))
        self.latest = self._document(state, done, total, whole, rate)
        return self.latest

    def _document(
        self, state: State, done: int, total: int | None, whole: int, rate: float | None
    ) -> dict[str, object]:
        return {
            "model": self.model,
            "state": state,
            "bytesDone": done,
            "bytesTotal": total,
            "filesDone": whole,
            "filesTotal": len(self._files) if self._files is not None else None,
            "bytesPerSecond": round(rate, 1) if rate is not None else None,
            "startedAt": round(self.started_at, 3),
        }


def _handler(progress: Progress) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # an idle connection does not hold a thread

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != DOWNLOAD_PROGRESS_PATH:
                self.send_error(404)
                return
            body = json.dumps(progress.latest).encode()
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
        while True:
            try:
                self.progress.sample()
            except Exception as exc:  # the download goes on; the answer stays as it was
                print(f"progress not counted: {exc}", file=sys.stderr, flush=True)
            if self._stop.wait(SAMPLE_SECONDS):
                return

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

    def listing() -> dict[str, int]:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        # the patterns as snapshot_download matches them (public; its typing does not
        # re-export it)
        from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

        tree = HfApi().list_repo_tree(repo, revision=revision, recursive=True)
        sizes = {e.path: int(e.size) for e in tree if isinstance(e, RepoFile)}
        kept = filter_repo_objects(
            sizes, allow_patterns=list(include), ignore_patterns=list(exclude) or None
        )
        return {name: sizes[name] for name in kept}

    return listing
