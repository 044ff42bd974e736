"""The operator's Kubernetes calls over the official client's HTTP layer, with plain dicts.

Children are written by server-side apply (field manager ``brook-operator``) WITHOUT
``force``: a field another manager owns (an HPA's replicas, someone's ``kubectl edit``) is
never taken over; the API answers 409 and the conflict is reported (``KubeError.conflicts``).
Status is written by server-side apply too, one field manager per writer
(``STATUS_MANAGER``, ``AUTOSCALER_MANAGER``), each owning only its own fields and
conditions, so no writer's update is lost to another's older snapshot.

Every call times out (``timeout_seconds``, 30 s by default): a half-open connection costs a
round, never the loop. Throttling (429, honouring ``Retry-After``), server errors (5xx) and
transport failures (refused, reset, timed out) are retried with exponential backoff, up to
``attempts`` tries; 4xx answers (403, 404, 409, 422, ...) are not — retrying them changes
nothing — and a create (POST) is retried only on 429 (a lost answer may hide a done create).
Errors come back as ``KubeError`` with the API's status code and message.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from brook_operator import __version__

log = logging.getLogger(__name__)

FIELD_MANAGER = "brook-operator"
"""Field manager of the children's server-side applies."""

STATUS_MANAGER = "brook-operator-status"
"""Field manager of the status the reconciler computes (counts, topology, endpoint and the
SpecValid, Degraded, Ready and Progressing conditions), whoever runs it: a create/update
handler, a child's event or the resync."""

AUTOSCALER_MANAGER = "brook-operator-autoscaler"
"""Field manager of the autoscaler's status (signals, decisions, desiredReplicas of an
autoscaled resource, and the MetricsAvailable, ScalingActive and ScalingLimited conditions)."""

USER_AGENT = f"brook-operator/{__version__}"
#: Longest one API call may take, each try (``--api-timeout-seconds``).
DEFAULT_TIMEOUT_SECONDS = 30.0
#: Tries of one call that fails retriably (the first included).
DEFAULT_ATTEMPTS = 3
#: First backoff between tries (doubling, with jitter), and the longest wait between two.
BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 10.0
#: Largest text answer read (``pod_proxy_get``): a pod's /metrics is far smaller.
MAX_TEXT_BYTES = 8 * 1024 * 1024

#: Plural and scope of every kind the operator touches.
_KINDS: dict[str, tuple[str, bool]] = {
    "ConfigMap": ("configmaps", True),
    "Service": ("services", True),
    "Pod": ("pods", True),
    "Event": ("events", True),
    "Deployment": ("deployments", True),
    "LeaderWorkerSet": ("leaderworkersets", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "NetworkPolicy": ("networkpolicies", True),
    "InferencePool": ("inferencepools", True),
    "HTTPRoute": ("httproutes", True),
    "LLMInference": ("llminferences", True),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
}
_MANAGER = re.compile(r'conflict with "([^"]*)"')


class KubeError(Exception):
    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        retry_after: float | None = None,
        causes: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        """Seconds the server asked to wait (``Retry-After``), if it said."""
        self.causes = causes or []
        """``details.causes`` of the API's Status."""

    @property
    def retriable(self) -> bool:
        """Throttling, server-side failures and transport failures (status 0): the same
        call may pass later. A 4xx (403, 404, 409, 422, ...) will not."""
        return self.status in (0, 429) or self.status >= 500

    @property
    def conflicts(self) -> list[tuple[str, str]]:
        """(manager, field) of each field another manager owns, from a server-side apply's
        409 (``FieldManagerConflict`` causes); empty for any other error."""
        if self.status != 409:
            return []
        found = []
        for cause in self.causes:
            if cause.get("reason") != "FieldManagerConflict":
                continue
            match = _MANAGER.search(str(cause.get("message", "")))
            found.append((match.group(1) if match else "?", str(cause.get("field", "?"))))
        return found


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None) -> str:
    plural, namespaced = _KINDS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{quote(namespace)}"
    path = f"{base}/{plural}"
    return f"{path}/{quote(name)}" if name else path


@dataclass
class KubeClient:
    api: k8s.ApiClient
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    attempts: int = DEFAULT_ATTEMPTS
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    @classmethod
    def from_environment(
        cls, kubeconfig: str | None = None, *, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    ) -> KubeClient:
        """In-cluster credentials in a pod, else the kubeconfig (``KUBECONFIG`` or ~/.kube)."""
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration
            )
        # No hidden retries below ours (urllib3 retries 3 times by default, PATCH included).
        configuration.retries = urllib3.Retry(total=0, redirect=False)
        api = k8s.ApiClient(configuration)
        api.user_agent = USER_AGENT
        return cls(api, timeout_seconds=timeout_seconds)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        as_text: bool = False,
    ) -> Any:
        """One API call, within ``timeout_seconds`` per try, retried while it may pass.
        ``as_text``: the answer as text (``Accept: text/plain``), not parsed JSON."""
        attempt = 1
        while True:
            try:
                return self._request_once(method, path, query, body, content_type, as_text=as_text)
            except KubeError as exc:
                retry = exc.retriable and (method != "POST" or exc.status == 429)
                if not retry or attempt >= self.attempts:
                    raise
                delay = self._backoff(attempt, exc.retry_after)
                log.info("%s %s: %s; try %d in %.1f s", method, path, exc, attempt + 1, delay)
                self.sleep(delay)
                attempt += 1

    @staticmethod
    def _backoff(attempt: int, retry_after: float | None) -> float:
        """Exponential with jitter; the server's ``Retry-After`` when it asked for longer."""
        base = min(BACKOFF_SECONDS * 2.0 ** (attempt - 1), MAX_BACKOFF_SECONDS)
        delay: float = base * random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_BACKOFF_SECONDS))
        return delay

    def _request_once(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None,
        body: Any,
        content_type: str,
        *,
        as_text: bool = False,
    ) -> Any:
        accept = "text/plain, */*" if as_text else "application/json"
        headers = {"Accept": accept, "Content-Type": content_type}
        # JSON bodies go as objects (the client encodes them); an apply patch as JSON text,
        # which is YAML and is sent as it is.
        data = json.dumps(body) if "yaml" in content_type and body is not None else body
        try:
            # param_serialize adds the default headers (User-Agent) and the credentials.
            method, url, headers, data, post = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=data,
                auth_settings=["BearerToken"],
            )
            response = self.api.call_api(
                method,
                url,
                header_params=headers,
                body=data,
                post_params=post,
                _request_timeout=self.timeout_seconds,
            )
            if as_text:  # read no more than the limit, whatever the pod sends
                raw, complete = _read_at_most(response.response, MAX_TEXT_BYTES)
            else:
                raw = response.read()  # type: ignore[no-untyped-call]
        except k8s.ApiException as exc:  # transport-level failures the client raises
            raise KubeError(exc.status or 0, str(exc.reason), str(exc.body)) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # refused, reset, timed out
            raise KubeError(0, "Transport", str(exc)) from None
        status = int(response.status)
        if as_text:
            return _text(status, raw, complete, response.headers.get("Retry-After"))
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:  # a proxy's HTML error page, say
            payload = None
            if status < 400:
                raise KubeError(status, "BadResponse", raw[:200].decode(errors="replace")) from None
        if status >= 400:
            raise _error(status, raw, payload, response.headers.get("Retry-After"))
        return payload

    def apply(
        self, obj: dict[str, Any], *, manager: str = FIELD_MANAGER, dry_run: bool = False
    ) -> dict[str, Any]:
        """Server-side apply ``obj`` as ``manager`` (the operator unless told), creating it if
        absent, without force: a 409 ``KubeError`` names the fields other managers own
        (``conflicts``). ``dry_run``: the server checks and answers, and stores nothing."""
        metadata = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], metadata.get("namespace"), None)
        query = {"fieldManager": manager}
        if dry_run:
            query["dryRun"] = "All"
        result: dict[str, Any] = self.request(
            "PATCH",
            f"{path}/{quote(metadata['name'])}",
            query=query,
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return result

    def apply_status(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        status: dict[str, Any],
        manager: str,
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Server-side apply of ``status`` (the fields ``manager`` owns, all of them: those
        it leaves out are removed unless another manager owns them too). Forced: each
        writer is the one authority on its own fields. With ``resource_version``, only if
        the object is still at that version (409 otherwise)."""
        metadata: dict[str, Any] = {"name": name}
        if namespace:
            metadata["namespace"] = namespace
        if resource_version:
            metadata["resourceVersion"] = resource_version
        body = {"apiVersion": api_version, "kind": kind, "metadata": metadata, "status": status}
        result: dict[str, Any] = self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            query={"fieldManager": manager, "force": "true"},
            body=body,
            content_type="application/apply-patch+yaml",
        )
        return result

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        metadata = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], metadata.get("namespace"), None)
        result: dict[str, Any] = self.request("POST", path, body=obj)
        return result

    def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.request(
                "GET", resource_path(api_version, kind, namespace, name)
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str
    ) -> list[dict[str, Any]]:
        try:
            result = self.request(
                "GET",
                resource_path(api_version, kind, namespace, None),
                query={"labelSelector": label_selector},
            )
        except KubeError as exc:
            if exc.status == 404:  # the kind is not installed (no LeaderWorkerSet CRD)
                return []
            raise
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete in the background (dependents follow); False if it was already gone."""
        try:
            self.request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def annotate(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        annotations: dict[str, str | None],
    ) -> dict[str, Any]:
        """Set (or, with None, remove) annotations by a merge patch."""
        result: dict[str, Any] = self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name),
            body={"metadata": {"annotations": annotations}},
            content_type="application/merge-patch+json",
        )
        return result

    def pod_proxy_get(self, namespace: str, pod: str, port: int, path: str) -> str:
        """GET ``path`` (``/metrics``) from ``port`` of a pod through the API server's pod
        proxy, as ``kubectl get --raw`` does: the pod's answer as text (at most
        ``MAX_TEXT_BYTES``). Its error answers (and the API server's: 404 no such pod, 503
        unreachable) raise ``KubeError``; retried as any GET."""
        url = (
            f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}:{port}"
            f"/proxy/{path.lstrip('/')}"
        )
        text: str = self.request("GET", url, as_text=True)
        return text

    def has_api(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` (its CRD is installed)."""
        plural, _ = _KINDS[kind]
        try:
            resources = self.request("GET", f"/apis/{api_version}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in resources.get("resources") or [])


def _error(status: int, raw: bytes, payload: Any, retry_after: str | None) -> KubeError:
    """The ``KubeError`` of an error answer (a ``Status`` object, or any text)."""
    if not isinstance(payload, dict) or not (payload.get("reason") or payload.get("message")):
        # not a Status: a pod's own error answer through the proxy, a proxy's page
        text = raw.decode(errors="replace")[:500] if raw else ""
        return KubeError(status, "", text, retry_after=_seconds(retry_after))
    details: dict[str, Any] = payload.get("details") or {}
    if not isinstance(details, dict):
        details = {}
    return KubeError(
        status,
        str(payload.get("reason", "")),
        str(payload.get("message", "")),
        retry_after=_seconds(retry_after) or _seconds(details.get("retryAfterSeconds")),
        causes=[c for c in details.get("causes") or [] if isinstance(c, dict)],
    )


def _read_at_most(response: urllib3.BaseHTTPResponse, limit: int) -> tuple[bytes, bool]:
    """The body's first ``limit`` bytes, and whether that was all of it (if not, the
    connection is closed rather than drained)."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.stream(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            response.close()
            return b"".join(chunks)[:limit], False
    return b"".join(chunks), True


def _text(status: int, raw: bytes, complete: bool, retry_after: str | None) -> str:
    """A text answer, or the ``KubeError`` of an error answer (the API server's Status, or
    the pod's own text)."""
    if status >= 400:
        try:
            payload = json.loads(raw) if raw and complete else None
        except ValueError:
            payload = None
        raise _error(status, raw, payload, retry_after)
    if not complete:
        raise KubeError(
            status, "TooLarge", f"the answer is larger than {MAX_TEXT_BYTES // 2**20} MiB"
        )
    return raw.decode("utf-8", errors="replace")


def _seconds(value: Any) -> float | None:
    """``Retry-After`` in seconds (the API server sends an integer; an HTTP date is ignored)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds >= 0 else None
