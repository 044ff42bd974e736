"""The model downloads of engine pods still initializing: which pods are fetching (their
``fetch-model`` init container runs), and how far each has got, read from the progress
``brook-engine fetch`` serves on the resource's API port (``DOWNLOAD_PROGRESS_PATH``). The
pods have no API token to write it; the operator reaches the port as it does for
``/metrics``.

Read directly (``pod_http``), bounded in time and size, a few pods at once (the most recently
started, the likeliest to be furthest behind): a pod that does not answer, or answers
anything but a progress, is counted as fetching with no progress, never waited for and never
a failure of the round. Fetchers that serve nothing (s3://, oci://) and pods on the host's
network are counted by how long they have run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from brook_engine.config import DOWNLOAD_PROGRESS_PATH
from brook_operator.pod_http import read_body
from brook_operator.render.model_source import FETCH_CONTAINER, PROGRESS_PORT_FLAG

#: Pods whose progress is read each round (the others are counted); a shared cache gives
#: them all the same answer, and a fleet of separate downloads moves together.
READ_AT_MOST = 8
READ_TIMEOUT_SECONDS = 2.0
#: Largest answer read (a progress is a few hundred bytes).
MAX_ANSWER_BYTES = 64 * 1024
_STATES = frozenset({"starting", "waiting", "downloading", "complete", "failed"})
#: Largest count taken from a pod: exact in JSON's doubles, and far below the CRD's int64.
_MAX_COUNT = 2**53


@dataclass(frozen=True)
class FetchProgress:
    """One fetch's answer."""

    state: str
    """starting, waiting (on another replica's download into the shared cache), downloading,
    complete or failed."""

    bytes_done: int
    bytes_total: int | None
    bytes_per_second: float | None

    @property
    def fraction(self) -> float:
        if not self.bytes_total:
            return 0.0
        return min(1.0, self.bytes_done / self.bytes_total)


@dataclass(frozen=True)
class PodDownload:
    pod: str
    started_at: datetime | None
    """When the fetch container started (the kubelet's word)."""

    url: str | None
    """Where its progress is served; None for a fetcher that serves none."""

    progress: FetchProgress | None = None
    """What it answered; None when it serves nothing or did not answer."""


def fetching(pod: dict[str, Any], port: int) -> PodDownload | None:
    """``pod``'s download when its fetch container is running, else None; its progress is
    asked of ``port`` (the resource's API port, never one the pod names)."""
    status = pod.get("status") or {}
    for container in status.get("initContainerStatuses") or []:
        running = (container.get("state") or {}).get("running")
        if container.get("name") == FETCH_CONTAINER and running is not None:
            name = str((pod.get("metadata") or {}).get("name", "?"))
            url = _progress_url(pod, port)
            return PodDownload(name, parse_time(running.get("startedAt")), url)
    return None


def _progress_url(pod: dict[str, Any], port: int) -> str | None:
    """Where ``pod`` serves its progress: only a ``brook-engine fetch`` that was told to, on
    the pod's own network (a pod on the host's would be the node's address)."""
    spec = pod.get("spec") or {}
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or spec.get("hostNetwork"):
        return None
    for container in spec.get("initContainers") or []:
        if container.get("name") != FETCH_CONTAINER:
            continue
        args = [*(container.get("command") or []), *(container.get("args") or [])]
        if any(str(arg).partition("=")[0] == PROGRESS_PORT_FLAG for arg in args):
            host = f"[{ip}]" if ":" in ip else ip
            return f"http://{host}:{port}{DOWNLOAD_PROGRESS_PATH}"
    return None


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time as a UTC ``datetime`` (one without a zone is taken as UTC), or
    None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def parse_progress(text: str) -> FetchProgress:
    """A fetch's JSON answer; ``ValueError`` for anything else. A pod's answer is not
    trusted: counts must be whole, non-negative and below 2**53; a rate that is not a
    non-negative number is dropped (a momentary dip), not the answer."""
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ValueError("not a download's progress")
    state = document.get("state")
    if not isinstance(state, str) or state not in _STATES:
        raise ValueError(f"state: {state!r}")
    return FetchProgress(
        state=state,
        bytes_done=_count(document, "bytesDone") or 0,
        bytes_total=_count(document, "bytesTotal"),
        bytes_per_second=_rate(document.get("bytesPerSecond")),
    )


def _count(document: dict[str, Any], key: str) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}: {value}")
    if not 0 <= value < _MAX_COUNT:
        raise ValueError(f"{key}: out of range")
    return int(value)


def _rate(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return float(value) if 0 <= value < _MAX_COUNT else None


Reader = Callable[[str], str]


def read_downloads(
    pods: Sequence[dict[str, Any]], port: int, reader: Reader | None = None
) -> tuple[PodDownload, ...]:
    """The pods fetching their model; the ``READ_AT_MOST`` most recently started of those
    that serve a progress, with what they answered on ``port``."""
    found = [d for d in (fetching(pod, port) for pod in pods) if d is not None]
    serving = [d for d in found if d.url is not None]
    serving.sort(key=lambda d: d.started_at or datetime.max.replace(tzinfo=UTC), reverse=True)
    asked = serving[:READ_AT_MOST]
    if not asked:
        return tuple(found)

    def read(url: str) -> str:
        return read_body(url, READ_TIMEOUT_SECONDS, "application/json", MAX_ANSWER_BYTES)

    def one(download: PodDownload) -> FetchProgress | None:
        try:
            return parse_progress((reader or read)(str(download.url)))
        except Exception:  # whatever a pod answers, the round goes on: counted, not read
            return None

    with ThreadPoolExecutor(max_workers=len(asked)) as pool:
        answers = dict(zip((d.pod for d in asked), pool.map(one, asked), strict=True))
    return tuple(
        PodDownload(d.pod, d.started_at, d.url, answers.get(d.pod)) if d.pod in answers else d
        for d in found
    )


def download_status(downloads: Sequence[PodDownload], now: datetime) -> dict[str, Any] | None:
    """``status.modelDownload``: how many pods fetch, and the one furthest behind (its
    bytes, rate and time left); None when no pod fetches."""
    if not downloads:
        return None
    reporting = [d for d in downloads if d.progress is not None]
    status: dict[str, Any] = {"pods": len(downloads), "podsReporting": len(reporting)}
    started = [d.started_at for d in downloads if d.started_at is not None]
    if started:
        status["startedAt"] = min(started).strftime("%Y-%m-%dT%H:%M:%SZ")
    behind = _furthest_behind(reporting)
    if behind is not None and behind.progress is not None:
        progress = behind.progress
        status["bytesDone"] = progress.bytes_done
        if progress.bytes_total is not None:
            status["bytesTotal"] = progress.bytes_total
        if progress.bytes_per_second is not None:
            status["bytesPerSecond"] = round(progress.bytes_per_second)
    status["message"] = _message(downloads, reporting, behind, now)
    return status


def _furthest_behind(reporting: Sequence[PodDownload]) -> PodDownload | None:
    if not reporting:
        return None
    return min(reporting, key=lambda d: d.progress.fraction if d.progress else 0.0)


def _message(
    downloads: Sequence[PodDownload],
    reporting: Sequence[PodDownload],
    behind: PodDownload | None,
    now: datetime,
) -> str:
    pods = len(downloads)
    text = f"downloading the model in {pods} pod{'s' if pods != 1 else ''}"
    started = [d.started_at for d in downloads if d.started_at is not None]
    if started:
        text += f" for {_duration((now - min(started)).total_seconds())}"
    waiting = sum(1 for d in reporting if d.progress and d.progress.state == "waiting")
    if waiting:
        text += f" ({waiting} waiting on the shared cache's download)"
    if behind is None or behind.progress is None:
        return text
    progress = behind.progress
    where = "" if pods == 1 else "; the furthest behind"
    text += f"{where}: {_bytes(progress.bytes_done)}"
    if progress.bytes_total:
        text += f" of {_bytes(progress.bytes_total)} ({progress.fraction:.0%})"
    rate = progress.bytes_per_second
    if rate:
        text += f" at {_bytes(rate)}/s"
        if progress.bytes_total and progress.bytes_total > progress.bytes_done:
            left = (progress.bytes_total - progress.bytes_done) / rate
            text += f", about {_duration(left)} left"
    return text


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"
