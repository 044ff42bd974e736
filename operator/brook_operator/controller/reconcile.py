"""One reconciliation of one ``LLMInference``: validate, apply the children, remove those
the spec no longer wants, read the workload back, write status. Idempotent: running it again
(after a restart mid-way, say) applies the same objects and creates nothing twice."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from brook_operator.api import API_VERSION, KIND, LLMInference, topology
from brook_operator.controller.conditions import (
    Observed,
    compute_status,
    invalid_status,
    spec_error,
)
from brook_operator.kube import KubeClient, KubeError
from brook_operator.render import (
    PRUNABLE_KINDS,
    OperatorSettings,
    desired_replicas,
    render_children,
    with_owner,
)
from brook_operator.render.labels import INSTANCE_LABEL
from brook_operator.render.workload import LWS_API_VERSION

log = logging.getLogger(__name__)


@dataclass
class ReconcileResult:
    status: dict[str, Any]
    applied: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of each child applied."""

    deleted: list[tuple[str, str]] = field(default_factory=list)
    error: KubeError | None = None
    """The first API error met (the rest of the round was skipped); retried by the caller."""


def parse(body: dict[str, Any]) -> LLMInference:
    """The resource as the operator's models read it (status is not needed here)."""
    return LLMInference.model_validate(
        {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    )


@dataclass
class Reconciler:
    kube: KubeClient
    settings: OperatorSettings = field(default_factory=OperatorSettings)

    def reconcile(self, body: dict[str, Any]) -> ReconcileResult:
        metadata = body.get("metadata") or {}
        name: str = metadata["name"]
        namespace: str | None = metadata.get("namespace")
        try:
            llmi = parse(body)
        except ValidationError as exc:
            message = spec_error(exc)
            log.warning("%s/%s: invalid spec, nothing applied: %s", namespace, name, message)
            status = invalid_status(body, message)
            self.kube.patch_status(API_VERSION, KIND, namespace, name, status)
            return ReconcileResult(status=status)
        result = ReconcileResult(status={})
        lws_missing = False
        try:
            lws_missing = topology(
                llmi.spec
            ).workload == "LeaderWorkerSet" and not self.kube.has_api(
                LWS_API_VERSION, "LeaderWorkerSet"
            )
            self._apply(llmi, body, lws_missing, result)
        except KubeError as exc:
            log.warning("%s/%s: %s", namespace, name, exc)
            result.error = exc
        workload = self.read_workload(llmi)
        observed = Observed(
            workload=workload,
            desired_replicas=self._desired(llmi, body),
            lws_missing=lws_missing,
            error=str(result.error) if result.error else None,
        )
        result.status = compute_status(llmi, observed, body.get("status"))
        self.kube.patch_status(API_VERSION, KIND, namespace, name, result.status)
        return result

    def refresh_status(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Status only (a child changed): no apply. None for an invalid spec."""
        try:
            llmi = parse(body)
        except ValidationError:
            return None
        lws_missing = topology(llmi.spec).workload == "LeaderWorkerSet" and not (
            self.kube.has_api(LWS_API_VERSION, "LeaderWorkerSet")
        )
        observed = Observed(
            workload=self.read_workload(llmi),
            desired_replicas=self._desired(llmi, body),
            lws_missing=lws_missing,
        )
        previous = body.get("status") or {}
        status = compute_status(llmi, observed, previous)
        if _same(status, previous):
            return status
        metadata = body["metadata"]
        self.kube.patch_status(
            API_VERSION, KIND, metadata.get("namespace"), metadata["name"], status
        )
        return status

    # -- steps ---------------------------------------------------------------------------

    @staticmethod
    def _desired(llmi: LLMInference, body: dict[str, Any]) -> int:
        autoscaled = None
        if llmi.spec.autoscaling is not None:
            autoscaled = (body.get("status") or {}).get("desiredReplicas")
        return desired_replicas(llmi, autoscaled)

    def _apply(
        self, llmi: LLMInference, body: dict[str, Any], lws_missing: bool, result: ReconcileResult
    ) -> None:
        autoscaled = None
        if llmi.spec.autoscaling is not None:
            autoscaled = (body.get("status") or {}).get("desiredReplicas")
        wanted: set[tuple[str, str]] = set()
        for child in render_children(llmi, self.settings, autoscaled):
            key = (child["kind"], child["metadata"]["name"])
            if child["kind"] == "LeaderWorkerSet" and lws_missing:
                continue
            wanted.add(key)
            self.kube.apply(with_owner(child, llmi))
            result.applied.append(key)
        for api_version, kind in PRUNABLE_KINDS:
            if kind == "LeaderWorkerSet" and (
                lws_missing or not self.kube.has_api(LWS_API_VERSION, kind)
            ):
                continue
            for obj in self.kube.list(
                api_version,
                kind,
                llmi.metadata.namespace,
                f"{INSTANCE_LABEL}={llmi.metadata.name}",
            ):
                child_name = obj["metadata"]["name"]
                if (kind, child_name) in wanted or not _owned_by(obj, llmi):
                    continue
                if self.kube.delete(api_version, kind, llmi.metadata.namespace, child_name):
                    log.info("%s: deleted %s %s", llmi.metadata.name, kind, child_name)
                    result.deleted.append((kind, child_name))

    def read_workload(self, llmi: LLMInference) -> dict[str, Any] | None:
        namespace, name = llmi.metadata.namespace, llmi.metadata.name
        if topology(llmi.spec).workload == "Deployment":
            return self.kube.get("apps/v1", "Deployment", namespace, name)
        try:
            return self.kube.get(LWS_API_VERSION, "LeaderWorkerSet", namespace, name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise


def _owned_by(obj: dict[str, Any], llmi: LLMInference) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == llmi.metadata.uid for ref in refs)


def _same(status: dict[str, Any], previous: dict[str, Any]) -> bool:
    return all(previous.get(k) == v for k, v in status.items())
