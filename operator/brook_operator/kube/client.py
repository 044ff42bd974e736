"""The operator's Kubernetes calls over the official client's HTTP layer, with plain dicts.

Children are written by server-side apply (field manager ``brook-operator``), so a field
another controller owns (an HPA's replicas, a mutating webhook's additions) is never fought
over silently, and re-applying an unchanged object is a no-op. Errors come back as
``KubeError`` with the API's status code and message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from brook_operator import __version__

FIELD_MANAGER = "brook-operator"
USER_AGENT = f"brook-operator/{__version__}"

#: Plural and scope of every kind the operator touches.
_KINDS: dict[str, tuple[str, bool]] = {
    "ConfigMap": ("configmaps", True),
    "Service": ("services", True),
    "Pod": ("pods", True),
    "Event": ("events", True),
    "Deployment": ("deployments", True),
    "LeaderWorkerSet": ("leaderworkersets", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "LLMInference": ("llminferences", True),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retriable(self) -> bool:
        """Conflicts, throttling and server-side failures pass; the rest will not."""
        return self.status in (0, 409, 429) or self.status >= 500


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

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> KubeClient:
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
        api = k8s.ApiClient(configuration)
        api.user_agent = USER_AGENT
        return cls(api)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
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
                method, url, header_params=headers, body=data, post_params=post
            )
            raw = response.read()  # type: ignore[no-untyped-call]
        except k8s.ApiException as exc:  # transport-level failures the client raises
            raise KubeError(exc.status or 0, str(exc.reason), str(exc.body)) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # refused, reset, timed out
            raise KubeError(0, "Transport", str(exc)) from None
        status = int(response.status)
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:  # a proxy's HTML error page, say
            payload = None
            if status < 400:
                raise KubeError(status, "BadResponse", raw[:200].decode(errors="replace")) from None
        if status >= 400:
            text = raw.decode(errors="replace")[:500] if raw else ""
            message = payload.get("message", "") if isinstance(payload, dict) else text
            reason = payload.get("reason", "") if isinstance(payload, dict) else ""
            raise KubeError(status, reason, message)
        return payload

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as the operator (creating it if absent)."""
        metadata = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], metadata.get("namespace"), None)
        result: dict[str, Any] = self.request(
            "PATCH",
            f"{path}/{quote(metadata['name'])}",
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
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

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Any
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
        return result

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
