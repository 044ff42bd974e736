"""Brook writes only what it owns, against the emulated API server, one reconciliation at
a time: an object of a child's name that it did not create is never adopted, and a field
another manager owns is never taken over (server-side apply without force)."""

from __future__ import annotations

from typing import Any

import pytest

from brook_operator.controller import Reconciler
from brook_operator.kube import KubeClient
from support import operator_scenarios as scenarios
from support.kube_api import KubeApi

NAMESPACE = "ai"
NAME = "tiny-cpu"


@pytest.fixture
def api(kube_api: KubeApi, brook_crd: dict[str, Any]) -> KubeApi:
    kube_api.create_namespace(NAMESPACE)
    return kube_api


def _body(api: KubeApi) -> dict[str, Any]:
    body = api.get("llmi", NAME, NAMESPACE)
    assert body is not None
    return body


def _degraded(api: KubeApi) -> dict[str, Any]:
    return scenarios.condition(_body(api), "Degraded")


def _foreign_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": {"app": "billing"}},
        "spec": {"selector": {"app": "billing"}, "ports": [{"port": 80}]},
    }


def test_a_foreign_object_is_never_adopted(api: KubeApi) -> None:
    """Someone's Service already has the name: nothing is applied (no half-made set of
    children around a Service that routes elsewhere), the resource says why, deleting it
    leaves the Service alone, and removing the Service lets the next round proceed."""
    api.create(_foreign_service())
    api.create(scenarios.manifest(NAME, NAMESPACE))
    reconciler = Reconciler(KubeClient.from_environment())
    result = reconciler.reconcile(_body(api))
    service = api.get("services", NAME, NAMESPACE)
    assert service is not None
    assert service["spec"]["selector"] == {"app": "billing"}, "the Service was rewritten"
    assert not service["metadata"].get("ownerReferences"), "the Service was adopted"
    for kind in ("configmaps", "deployments", "poddisruptionbudgets"):
        assert api.list(kind, NAMESPACE) == [], kind
    assert result.applied == []
    assert result.problem is not None and result.problem[0] == "ForeignObject"
    degraded = _degraded(api)
    assert (degraded["status"], degraded["reason"]) == ("True", "ForeignObject")
    assert f"Service {NAMESPACE}/{NAME} already exists" in degraded["message"]
    assert "Delete or rename that object" in degraded["message"]

    # Deleting the resource does not take the Service with it (it was never owned).
    api.delete("llmi", NAME, NAMESPACE)
    assert api.get("services", NAME, NAMESPACE) is not None

    # Without the foreign object, the same name reconciles.
    api.delete("services", NAME, NAMESPACE)
    api.create(scenarios.manifest(NAME, NAMESPACE))
    result = reconciler.reconcile(_body(api))
    assert result.problem is None and result.error is None
    assert api.get("services", NAME, NAMESPACE)["spec"]["selector"] != {"app": "billing"}  # type: ignore[index]
    assert _degraded(api)["status"] == "False"


def test_an_object_owned_by_a_deleted_namesake_is_not_adopted(api: KubeApi) -> None:
    """The children of an LLMInference deleted and created again under the same name
    belong to the old uid until the garbage collector removes them."""
    api.create(scenarios.manifest(NAME, NAMESPACE))
    old = _body(api)
    stale = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{NAME}-engine",
            "namespace": NAMESPACE,
            "ownerReferences": [
                {
                    "apiVersion": "brook.dev/v1alpha1",
                    "kind": "LLMInference",
                    "name": NAME,
                    "uid": "00000000-0000-4000-8000-0000000000aa",
                    "controller": True,
                }
            ],
        },
        "data": {"engine.yaml": "old"},
    }
    api.create(stale)
    result = Reconciler(KubeClient.from_environment()).reconcile(old)
    configmap = api.get("configmaps", f"{NAME}-engine", NAMESPACE)
    assert configmap is not None and configmap["data"] == {"engine.yaml": "old"}
    assert len(configmap["metadata"]["ownerReferences"]) == 1
    assert result.problem is not None and result.problem[0] == "ForeignObject"
    assert "00000000-0000-4000-8000-0000000000aa" in result.problem[1]


def test_replicas_another_manager_owns_are_left_to_it(api: KubeApi) -> None:
    """An HPA (here: kubectl scale) owns the Deployment's replicas: the next round applies
    the rest of the Deployment (a new image rolls out) and leaves the count alone, and the
    resource names the field and its manager."""
    api.create(scenarios.manifest(NAME, NAMESPACE))
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    assert api.get("deployments", NAME, NAMESPACE)["spec"]["replicas"] == 1  # type: ignore[index]
    api.kubectl("scale", "deployment", NAME, "-n", NAMESPACE, "--replicas=4")
    body = _body(api)
    body["spec"]["image"] = "registry.example/brook-engine:v2"
    api.apply(body, manager="kubectl-client-side-apply")
    result = reconciler.reconcile(_body(api))
    deployment = api.get("deployments", NAME, NAMESPACE)
    assert deployment is not None
    assert deployment["spec"]["replicas"] == 4, "the other manager's replicas were overridden"
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example/brook-engine:v2"
    assert result.problem is not None and result.problem[0] == "FieldConflict"
    degraded = _degraded(api)
    assert (degraded["status"], degraded["reason"]) == ("True", "FieldConflict")
    assert '.spec.replicas is managed by "kubectl' in degraded["message"]


def test_another_field_conflict_is_reported_not_forced(api: KubeApi) -> None:
    """Someone edited the engine config by hand: Brook does not revert it (no force); the
    round stops there and says whose field it is."""
    api.create(scenarios.manifest(NAME, NAMESPACE))
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    api.kubectl(
        "patch", "configmap", f"{NAME}-engine", "-n", NAMESPACE, "--type=merge",
        "-p", '{"data": {"engine.yaml": "edited: by hand"}}',
    )  # fmt: skip
    body = _body(api)
    body["spec"]["scheduler"]["maxNumSeqs"] = 8
    api.apply(body, manager="kubectl-client-side-apply")
    result = reconciler.reconcile(_body(api))
    assert result.error is not None and result.error.status == 409
    configmap = api.get("configmaps", f"{NAME}-engine", NAMESPACE)
    assert configmap is not None and configmap["data"]["engine.yaml"] == "edited: by hand"
    degraded = _degraded(api)
    assert (degraded["status"], degraded["reason"]) == ("True", "FieldConflict")
    assert '.data.engine.yaml is managed by "kubectl' in degraded["message"]
