"""Where ``brook monitor`` reads its frames:

- ``ClusterSource``: the ``LLMInference`` from the API server and each replica's leader pod's
  ``/metrics`` through the API server's pod proxy (what ``kubectl get --raw`` reads; RBAC:
  ``get`` on ``llminferences``, ``list`` on ``pods``, ``get`` on ``pods/proxy``).
- ``PrometheusSource``: the same resource and pods, their metrics from a Prometheus server
  that scrapes them (its instant query API; series labelled with ``pod``, as the Prometheus
  Operator's pod and service monitors label them).
- ``LocalSource``: the servers ``brook up`` runs on this machine (their registry files),
  read directly.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from brook_operator.api import API_VERSION
from brook_operator.kube import KubeClient, KubeError
from brook_operator.local_run import LocalServer, local_servers
from brook_operator.monitor.figures import Frame
from brook_operator.monitor.readings import Reading, ReadingError
from brook_operator.pod_http import PodReadError, read_body
from brook_operator.render.labels import INSTANCE_LABEL, ROLE_LABEL
from brook_operator.render.pod import HTTP_PORT, http_port

#: Longest one read of a server's metrics or of Prometheus may take.
READ_TIMEOUT_SECONDS = 5.0


class MonitorError(Exception):
    """Nothing to watch (no such resource, no server), or a source that cannot answer."""


class Source(Protocol):
    """Frames of one resource (or one local server)."""

    @property
    def name(self) -> str: ...

    @property
    def namespace(self) -> str | None: ...

    def read(self) -> Frame: ...


def _http_get(url: str, accept: str = "text/plain") -> str:
    """The autoscaler's bounded, direct read of a server, its errors as ``MonitorError``."""
    try:
        return read_body(url, READ_TIMEOUT_SECONDS, accept)
    except PodReadError as exc:
        raise MonitorError(str(exc)) from None


def _read_all(
    targets: Sequence[str], read: Callable[[str], Reading]
) -> tuple[dict[str, Reading], dict[str, str]]:
    """Every target at once (a slow pod must not hold the others)."""
    readings: dict[str, Reading] = {}
    errors: dict[str, str] = {}

    def one(target: str) -> Reading | str:
        try:
            return read(target)
        except (KubeError, MonitorError, ReadingError) as exc:
            return str(exc)

    if targets:
        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            for target, result in zip(targets, pool.map(one, targets), strict=True):
                if isinstance(result, Reading):
                    readings[target] = result
                else:
                    errors[target] = result
    return readings, errors


def _serving_pods(kube: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    """The leader pod of every replica (the pod that serves the API and /metrics), not
    terminating."""
    selector = f"{INSTANCE_LABEL}={name},{ROLE_LABEL}=leader"
    pods = kube.list("v1", "Pod", namespace, selector)
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]


def list_resources(kube: KubeClient, namespace: str | None) -> list[dict[str, Any]]:
    """The ``LLMInference`` objects of ``namespace`` (None: every namespace)."""
    try:
        return kube.list(API_VERSION, "LLMInference", namespace, "")
    except KubeError as exc:
        raise MonitorError(f"listing LLMInference resources: {exc}") from None


def _read_errors(what: str) -> Callable[[Callable[[], Frame]], Callable[[], Frame]]:
    """API errors as ``MonitorError``: a refresh that fails says why and the next retries."""

    def wrap(read: Callable[[], Frame]) -> Callable[[], Frame]:
        def wrapped() -> Frame:
            try:
                return read()
            except KubeError as exc:
                raise MonitorError(f"{what}: the API server: {exc}") from None

        return wrapped

    return wrap


@dataclass
class ClusterSource:
    kube: KubeClient
    namespace: str
    name: str
    clock: Callable[[], float] = time.time

    def resource(self) -> dict[str, Any]:
        obj = self.kube.get(API_VERSION, "LLMInference", self.namespace, self.name)
        if obj is None:
            raise MonitorError(f"LLMInference {self.namespace}/{self.name} not found")
        return obj

    def read(self) -> Frame:
        return _read_errors(f"{self.namespace}/{self.name}")(self._read)()

    def _read(self) -> Frame:
        obj = self.resource()
        pods = {
            str(p["metadata"]["name"]): p
            for p in _serving_pods(self.kube, self.namespace, self.name)
        }

        def read_pod(pod: str) -> Reading:
            port = http_port(pods[pod])
            if port is None:
                raise MonitorError(f"no container port named {HTTP_PORT!r}")
            try:
                text = self.kube.pod_proxy_get(self.namespace, pod, port, "/metrics")
            except KubeError as exc:
                if exc.status == 401:
                    raise MonitorError(
                        f"{exc}: the engine asks for its API key on /metrics "
                        "(server.metricsRequireApiKey); use --prometheus"
                    ) from None
                raise
            return Reading.parse(text)

        readings, errors = _read_all(sorted(pods), read_pod)
        return Frame(self.clock(), obj, readings, errors)


@dataclass
class PrometheusSource:
    kube: KubeClient
    namespace: str
    name: str
    url: str
    """Prometheus's base URL (``http://prometheus:9090``)."""
    clock: Callable[[], float] = time.time

    def query(self, promql: str) -> list[tuple[dict[str, str], float, float]]:
        """An instant query's series: labels, value, and when it was scraped."""
        query = urllib.parse.urlencode({"query": promql})
        body = _http_get(f"{self.url.rstrip('/')}/api/v1/query?{query}", "application/json")
        try:
            answer = json.loads(body)
            if answer.get("status") != "success":
                raise MonitorError(f"Prometheus: {answer.get('errorType')}: {answer.get('error')}")
            series = []
            for item in answer["data"]["result"]:
                at, value = item["value"]
                labels = {str(k): str(v) for k, v in item["metric"].items()}
                series.append((labels, float(value), float(at)))
        except (ValueError, TypeError, KeyError, AttributeError):
            raise MonitorError(f"Prometheus: not an instant-query answer: {body[:120]!r}") from None
        return series

    def read(self) -> Frame:
        return _read_errors(f"{self.namespace}/{self.name}")(self._read)()

    def _read(self) -> Frame:
        obj = ClusterSource(self.kube, self.namespace, self.name).resource()
        pods = sorted(
            str(p["metadata"]["name"]) for p in _serving_pods(self.kube, self.namespace, self.name)
        )
        readings: dict[str, Reading] = {}
        errors: dict[str, str] = {}
        if pods:
            alternatives = "|".join(_regex_escape(p) for p in pods)
            promql = (
                f'{{__name__=~"brook_engine_.+",namespace="{self.namespace}",'
                f'pod=~"{alternatives}"}}'
            )
            by_pod: dict[str, list[tuple[dict[str, str], float]]] = {}
            scraped: dict[str, float] = {}
            for labels, value, at in self.query(promql):
                pod = labels.get("pod", "")
                by_pod.setdefault(pod, []).append((labels, value))
                scraped[pod] = max(scraped.get(pod, at), at)
            for pod in pods:
                if pod in by_pod:
                    readings[pod] = Reading.from_series(by_pod[pod], scraped[pod])
                else:
                    errors[pod] = "Prometheus has no brook_engine_* series of this pod"
        return Frame(self.clock(), obj, readings, errors)


def _regex_escape(text: str) -> str:
    # pod names are DNS labels ([a-z0-9-.]): only the dot is special in RE2
    return text.replace(".", "\\\\.")


@dataclass
class LocalSource:
    server: LocalServer
    clock: Callable[[], float] = time.time
    name: str = field(init=False)
    namespace: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.name = self.server.name

    def read(self) -> Frame:
        def read_server(url: str) -> Reading:
            return Reading.parse(_http_get(f"{url}/metrics"))

        readings, errors = _read_all([self.server.url], read_server)
        return Frame(self.clock(), None, readings, errors)


def local_sources(names: Sequence[str] = ()) -> list[LocalSource]:
    """A source for each server ``brook up`` runs here (those named, when names are given)."""
    servers = [s for s in local_servers() if not names or s.name in names]
    if not servers:
        which = f" named {', '.join(names)}" if names else ""
        raise MonitorError(f"no `brook up` server{which} is running on this machine")
    return [LocalSource(s) for s in servers]
