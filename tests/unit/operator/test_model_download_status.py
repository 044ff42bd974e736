"""``status.modelDownload`` and Ready's ``ModelDownloading``: which pods are fetching their
model, what they answer (a pod's answer is not trusted), and the furthest behind in a
sentence (pure; the progress a real ``brook-engine fetch`` serves is read in
``tests/integration/operator/test_operator.py``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from brook_operator.controller.conditions import Observed, compute_status, invalid_status
from brook_operator.controller.downloads import (
    READ_AT_MOST,
    FetchProgress,
    PodDownload,
    download_status,
    fetching,
    parse_progress,
    parse_time,
    read_downloads,
)
from brook_operator.controller.reconcile import _same
from brook_operator.pod_http import PodReadError

from .test_status import _conditions, _deployment, _llmi

NOW = datetime(2026, 12, 7, 12, 0, 0, tzinfo=UTC)
NOW_TEXT = "2026-12-07T12:00:00Z"
GIB = 1024**3


def _pod(
    name: str,
    ip: str | None = "10.1.2.3",
    state: dict[str, Any] | None = None,
    command: tuple[str, ...] = ("brook-engine", "fetch", "hf://o/m", "--progress-port=9999"),
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Pending",
        "initContainerStatuses": [
            {
                "name": "fetch-model",
                "state": state
                if state is not None
                else {"running": {"startedAt": "2026-12-07T11:57:00Z"}},
            }
        ],
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {"name": name},
        "spec": {
            "initContainers": [{"name": "fetch-model", "command": list(command)}],
            "containers": [{"name": "engine"}],
        },
        "status": status,
    }


def _answer(state: str = "downloading", done: int = GIB, total: int | None = 4 * GIB) -> str:
    return json.dumps(
        {
            "model": "hf://o/m",
            "state": state,
            "bytesDone": done,
            "bytesTotal": total,
            "filesDone": 1,
            "filesTotal": 3,
            "bytesPerSecond": 64 * 1024**2,
            "startedAt": 1.0,
        }
    )


def test_a_pod_is_fetching_while_its_fetch_container_runs() -> None:
    download = fetching(_pod("a"), 8000)
    assert download is not None
    # the resource's API port, not the one the pod's own command names
    assert download.url == "http://10.1.2.3:8000/download"
    assert download.started_at == datetime(2026, 12, 7, 11, 57, tzinfo=UTC)
    six = fetching(_pod("b", ip="fd00::7"), 8000)
    assert six is not None and six.url == "http://[fd00::7]:8000/download"
    # done, or not yet started: not fetching
    assert fetching(_pod("c", state={"terminated": {"exitCode": 0}}), 8000) is None
    assert fetching(_pod("d", state={"waiting": {"reason": "PodInitializing"}}), 8000) is None
    # an s3:// fetcher serves no progress; a pod without an IP, or on the host's network
    # (its IP is the node's), is not asked
    s3 = fetching(_pod("e", command=("aws", "s3", "sync", "s3://b/m", "/models/m")), 8000)
    assert s3 is not None and s3.url is None
    no_ip = fetching(_pod("f", ip=None), 8000)
    assert no_ip is not None and no_ip.url is None
    host = _pod("g")
    host["spec"]["hostNetwork"] = True
    on_host = fetching(host, 8000)
    assert on_host is not None and on_host.url is None


def test_times_are_read_as_utc() -> None:
    assert parse_time("2026-12-07T13:57:00+02:00") == datetime(2026, 12, 7, 11, 57, tzinfo=UTC)
    assert parse_time("2026-12-07T11:57:00") == datetime(2026, 12, 7, 11, 57, tzinfo=UTC)
    assert parse_time("T1") is None and parse_time(None) is None and parse_time(7) is None
    east = _pod("a", state={"running": {"startedAt": "2026-12-07T13:57:00+02:00"}})
    download = fetching(east, 8000)
    assert download is not None
    status = download_status([download], NOW)
    assert status is not None and status["startedAt"] == "2026-12-07T11:57:00Z"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        json.dumps({"state": "sleeping", "bytesDone": 1}),
        json.dumps({"state": ["downloading"], "bytesDone": 1}),
        json.dumps({"state": "downloading", "bytesDone": -1}),
        json.dumps({"state": "downloading", "bytesDone": True}),
        json.dumps({"state": "downloading", "bytesDone": "12"}),
        json.dumps({"state": "downloading", "bytesDone": 10**400}),
        json.dumps({"state": "downloading", "bytesDone": 1e308}),
        '{"state": "downloading", "bytesDone": NaN}',
        '{"state": "downloading", "bytesDone": 1, "bytesTotal": Infinity}',
        "[" * 100_000,
    ],
)
def test_an_answer_that_is_not_a_progress_is_refused(text: str) -> None:
    with pytest.raises((ValueError, RecursionError)):
        parse_progress(text)


def test_a_rate_that_is_not_a_rate_is_dropped_not_the_answer() -> None:
    for rate in (-5, "fast", 10**400, float("nan")):
        answer = json.dumps({"state": "downloading", "bytesDone": 7, "bytesPerSecond": rate})
        progress = parse_progress(answer)
        assert progress.bytes_done == 7 and progress.bytes_per_second is None


def test_reads_the_latest_pods_that_serve_a_progress_and_counts_the_others() -> None:
    pods = [
        _pod(
            f"p{i}", ip=f"10.1.2.{i}", state={"running": {"startedAt": f"2026-12-07T11:{i:02}:00Z"}}
        )
        for i in range(READ_AT_MOST + 2)
    ]
    pods.append(_pod("s3", command=("aws", "s3", "sync")))
    pods.append(_pod("serving", state={"running": {}}) | {"status": {"podIP": "10.1.2.99"}})
    asked: list[str] = []

    def reader(url: str) -> str:
        asked.append(url)
        if "10.1.2.5:" in url:
            raise PodReadError(f"{url}: connection refused")
        if "10.1.2.6:" in url:
            return "[" * 100_000  # a pod answering anything must not end the round
        if "10.1.2.7:" in url:
            raise OSError("anything else")
        return _answer()

    downloads = read_downloads(pods, 8000, reader)
    # bounded, the most recently started first; the rest are counted
    assert sorted(asked) == sorted(
        f"http://10.1.2.{i}:8000/download" for i in range(2, READ_AT_MOST + 2)
    )
    names = [d.pod for d in downloads]
    assert names == [f"p{i}" for i in range(READ_AT_MOST + 2)] + ["s3"]
    answered = {d.pod for d in downloads if d.progress is not None}
    assert answered == {f"p{i}" for i in range(2, READ_AT_MOST + 2)} - {"p5", "p6", "p7"}


def test_status_gives_the_furthest_behind_with_its_rate_and_time_left() -> None:
    started = datetime(2026, 12, 7, 11, 57, tzinfo=UTC)

    def download(name: str, done: int, state: str = "downloading") -> PodDownload:
        progress = FetchProgress(state, done, 4 * GIB, 64 * 1024**2)
        return PodDownload(name, started, "http://x", progress)

    downloads = [download("a", 3 * GIB), download("b", GIB), download("c", 2 * GIB, "waiting")]
    downloads.append(PodDownload("d", None, None))
    status = download_status(downloads, NOW)
    assert status is not None
    assert status["pods"] == 4 and status["podsReporting"] == 3
    assert status["bytesDone"] == GIB and status["bytesTotal"] == 4 * GIB
    assert status["bytesPerSecond"] == 64 * 1024**2
    assert status["startedAt"] == "2026-12-07T11:57:00Z"
    assert status["message"] == (
        "downloading the model in 4 pods for 3 min (1 waiting on the shared cache's "
        "download); the furthest behind: 1.0 GiB of 4.0 GiB (25%) at 64.0 MiB/s, about "
        "48 s left"
    )
    one = download_status([PodDownload("a", started, None)], NOW)
    assert one is not None and one["message"] == "downloading the model in 1 pod for 3 min"
    assert "bytesDone" not in one and one["podsReporting"] == 0
    assert download_status([], NOW) is None


def test_ready_says_the_replicas_wait_for_the_download_and_status_carries_it() -> None:
    workload = _deployment(2, 2, replicas=2, readyReplicas=0, updatedReplicas=2)
    progress = FetchProgress("downloading", GIB, 2 * GIB, None)
    downloads = (PodDownload("tiny-cpu-a", None, "http://x", progress),)
    observed = Observed(workload, desired_replicas=2, downloads=downloads)
    status = compute_status(_llmi(), observed, None, now=NOW_TEXT)
    ready = _conditions(status)["Ready"]
    assert ready["reason"] == "ModelDownloading"
    assert ready["message"] == (
        "0/2 replicas ready: downloading the model in 1 pod: 1.0 GiB of 2.0 GiB (50%)"
    )
    assert status["modelDownload"]["bytesDone"] == GIB
    assert _conditions(status)["Reconciling"]["reason"] == "ModelDownloading"
    # a pod's own problem comes first; the download is said after it
    from brook_operator.controller.pod_reasons import PodProblem

    problem = PodProblem("tiny-cpu-b", "engine", "CrashLoopBackOff", "exit code 1")
    observed = Observed(workload, desired_replicas=2, pod_problems=(problem,), downloads=downloads)
    ready = _conditions(compute_status(_llmi(), observed, None, now=NOW_TEXT))["Ready"]
    assert ready["reason"] == "CrashLoopBackOff"
    assert ready["message"].endswith("; downloading the model in 1 pod: 1.0 GiB of 2.0 GiB (50%)")
    # once no pod fetches, the field goes, and writing it away is a change
    done = compute_status(_llmi(), Observed(workload, desired_replicas=2), status, now=NOW_TEXT)
    assert "modelDownload" not in done
    assert not _same(done, status)
    assert _same(done, done)
    # nor is it kept by a spec turned invalid: nothing would read it again
    body = {"metadata": {"generation": 4}, "spec": {}, "status": status}
    assert "modelDownload" not in invalid_status(body, "spec.model: required", NOW_TEXT)
