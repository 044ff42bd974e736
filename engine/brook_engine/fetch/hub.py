"""A Hub model into a folder, once: only the files the engine reads (or the patterns given),
under a lock, with a marker written last. Replicas sharing the folder (a ReadWriteMany claim
as ``model.cache``) download it once: the first holds the lock and downloads, the others wait
for it and find the marker. A folder without the marker (a download cut short) is completed
on the next try; the Hub client skips the files it already has."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from brook_engine.config import MODEL_FILES
from brook_engine.fetch.progress import CLIENT_FOLDER, Progress

#: Written last, naming what is there; its presence means the folder is complete.
MARKER = ".brook-fetched.json"
_LOCK = ".brook-fetch.lock"


class FetchError(Exception):
    """The download failed; the message says why and what to check."""


@dataclass(frozen=True)
class Fetched:
    folder: Path
    commit: str | None
    downloaded: bool
    """False when the folder was already complete (another replica, an earlier run)."""


@contextmanager
def _locked(folder: Path, progress: Progress | None) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / _LOCK, "a+") as handle:
        started = time.monotonic()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress.set_state("waiting")
            print(f"waiting for another download into {folder}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            print(f"the other download ended after {waited:.0f} s", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetched(folder: Path) -> dict[str, object] | None:
    """The marker of a complete folder, or None."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def file_patterns(include: Sequence[str] | None) -> list[str]:
    """The files a download takes: ``include``, or those the engine reads."""
    return list(include) if include else list(MODEL_FILES)


def fetch_hub(
    repo: str,
    folder: Path,
    revision: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    progress: Progress | None = None,
) -> Fetched:
    """``repo`` at ``revision`` into ``folder`` (see the module docstring). The token comes
    from ``HF_TOKEN``, a mirror from ``HF_ENDPOINT``, as the Hub client reads them. A folder
    complete for other patterns or another revision is completed for these. ``progress``
    is told the state as it changes (its bytes are counted on disk)."""
    try:
        fetched_now = _fetch_hub(repo, folder, revision, include, exclude, progress)
    except BaseException:
        if progress is not None:
            progress.set_state("failed")
        raise
    if progress is not None:
        progress.set_state("complete")
    return fetched_now


def _fetch_hub(
    repo: str,
    folder: Path,
    revision: str | None,
    include: Sequence[str] | None,
    exclude: Sequence[str],
    progress: Progress | None,
) -> Fetched:
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from huggingface_hub import snapshot_download

    patterns = file_patterns(include)
    wanted = {"repo": repo, "revision": revision, "include": patterns, "exclude": list(exclude)}
    try:
        with _locked(folder, progress):
            done = fetched(folder)
            if done is not None and all(done.get(k) == v for k, v in wanted.items()):
                commit = done.get("commit")
                return Fetched(folder, commit if isinstance(commit, str) else None, False)
            _drop_partials(folder)
            if progress is not None:
                progress.set_state("downloading")
            print(f"downloading hf://{repo} into {folder}", file=sys.stderr, flush=True)
            try:
                snapshot_download(
                    repo,
                    revision=revision,
                    local_dir=folder,
                    allow_patterns=patterns,
                    ignore_patterns=list(exclude) or None,
                )
            except Exception as exc:  # the Hub client's errors share no base but Exception
                text = str(exc).splitlines()[0] if str(exc) else ""
                hint = ""
                if "401" in text or "403" in text or "gated" in text.lower():
                    hint = " (a gated or private model: set HF_TOKEN, the credentials Secret)"
                raise FetchError(f"hf://{repo}: {type(exc).__name__}: {text}{hint}") from None
            if not any(p.is_file() for p in folder.iterdir() if not p.name.startswith(".")):
                raise FetchError(
                    f"hf://{repo}: no file matched {', '.join(patterns)}"
                    + (f" minus {', '.join(exclude)}" if exclude else "")
                )
            commit = _commit(folder)
            partial = folder / (MARKER + ".tmp")
            partial.write_text(json.dumps({**wanted, "commit": commit}), encoding="utf-8")
            os.replace(partial, folder / MARKER)  # the marker appears whole or not at all
            return Fetched(folder, commit, True)
    except PermissionError as exc:
        raise FetchError(
            f"{folder}: {exc.strerror} for uid {os.getuid()} gid {os.getgid()}: the model "
            "volume must be writable by the engine's user (a shared claim: an export that "
            "maps writes to that user, or a group-writable folder; see docs/operator.md)"
        ) from None


def _drop_partials(folder: Path) -> None:
    """Delete the partial files of downloads cut short (a pod killed mid-download): the Hub
    client names them per process, so none can be resumed, and they would fill a shared
    claim and count as progress. Only under the lock: no other fetch is writing here."""
    for partial in (folder / CLIENT_FOLDER).rglob("*.incomplete"):
        partial.unlink(missing_ok=True)


def _commit(folder: Path) -> str | None:
    """The commit the Hub client recorded for the files it wrote (its local-dir metadata)."""
    for meta in sorted((folder / CLIENT_FOLDER).rglob("*.metadata")):
        first = meta.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
        if first and len(first[0]) == 40:
            return first[0]
    return None
