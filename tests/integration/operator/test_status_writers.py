"""Status has several writers — the reconciler (create/update handlers, child events, the
resync) and the autoscaler — each working from its own snapshot of the resource. None may
lose another's update: each applies only its own fields as its own field manager, and the
conditions are a list map keyed by ``type`` (the CRD says so; the emulated API server merges
such lists item by item, as the real one does)."""

from __future__ import annotations

from typing import Any

import pytest

from brook_operator.autoscaler.loop import Autoscaler
from brook_operator.controller import Reconciler
from brook_operator.kube import AUTOSCALER_MANAGER, STATUS_MANAGER, KubeClient
from support import operator_scenarios as scenarios
from support.kube_api import KubeApi

NAMESPACE = "ai"
NAME = "tiny-cpu"
AUTOSCALER_CONDITIONS = {"MetricsAvailable", "ScalingActive", "ScalingLimited"}
RECONCILER_CONDITIONS = {"SpecValid", "Degraded", "Ready", "Progressing", "Reconciling", "Stalled"}


@pytest.fixture
def api(kube_api: KubeApi, brook_crd: dict[str, Any]) -> KubeApi:
    kube_api.create_namespace(NAMESPACE)
    manifest = scenarios.manifest(NAME, NAMESPACE, autoscaling={"minReplicas": 1, "maxReplicas": 4})
    del manifest["spec"]["replicas"]
    kube_api.create(manifest)
    return kube_api


def _body(api: KubeApi) -> dict[str, Any]:
    body = api.get("llmi", NAME, NAMESPACE)
    assert body is not None
    return body


def _conditions(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in body["status"]["conditions"]}


def test_a_reconcile_from_an_older_snapshot_keeps_the_autoscalers_status(api: KubeApi) -> None:
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    snapshot = _body(api)  # what a handler or the resync holds while the autoscaler runs
    decision = Autoscaler(reconciler).run_once(_body(api))
    assert decision is not None and not decision.metrics_available  # no pods: stale
    written = _body(api)["status"]
    assert set(_conditions(_body(api))) >= AUTOSCALER_CONDITIONS

    reconciler.reconcile(snapshot)
    reconciler.refresh_status(snapshot)
    status = _body(api)["status"]
    conditions = _conditions(_body(api))
    assert set(conditions) >= AUTOSCALER_CONDITIONS | RECONCILER_CONDITIONS
    for kind in AUTOSCALER_CONDITIONS:
        assert conditions[kind] == _conditions({"status": written})[kind], kind
    assert status["autoscaling"] == written["autoscaling"]
    assert status["desiredReplicas"] == written["desiredReplicas"]


def test_an_autoscaler_round_from_an_older_snapshot_keeps_the_reconcilers_status(
    api: KubeApi,
) -> None:
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    snapshot = _body(api)  # the autoscaler's round starts here ...
    # ... while the spec changes and is reconciled (observedGeneration 2).
    body = _body(api)
    body["spec"]["image"] = "registry.example/brook-engine:v2"
    api.apply(body, manager="kubectl-client-side-apply")
    reconciler.reconcile(_body(api))
    assert _body(api)["status"]["observedGeneration"] == 2

    Autoscaler(reconciler).run_once(snapshot)
    status = _body(api)["status"]
    conditions = _conditions(_body(api))
    assert status["observedGeneration"] == 2
    assert conditions["SpecValid"]["observedGeneration"] == 2, "an older condition came back"
    assert set(conditions) >= AUTOSCALER_CONDITIONS


def test_each_writer_owns_its_own_conditions(api: KubeApi) -> None:
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    Autoscaler(reconciler).run_once(_body(api))
    managers = {
        entry["manager"]: entry["fieldsV1"]["f:status"]
        for entry in _body(api)["metadata"]["managedFields"]
        if entry.get("subresource") == "status"
    }
    owned = {
        manager: {key[len('k:{"type":"') : -2] for key in fields.get("f:conditions", {})}
        for manager, fields in managers.items()
    }
    assert owned[STATUS_MANAGER] == RECONCILER_CONDITIONS
    assert owned[AUTOSCALER_MANAGER] == AUTOSCALER_CONDITIONS
    assert "f:autoscaling" in managers[AUTOSCALER_MANAGER]
    assert "f:autoscaling" not in managers[STATUS_MANAGER]
