"""The operator under faults: the real ``brook operator`` process against the emulated API
server answering 429, 500, 503 and 409, dropping its watches, hanging a connection, and
the operator killed mid-reconcile. Whatever happens: no object is made twice, no status is
lost, no foreign object is adopted, and the resync brings everything back once the fault
is gone. The operator runs with a 1 s API timeout and a 0.5 s resync so that all of it
takes seconds (faults: ``tests/support/kube_api/faults.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support import operator_scenarios as scenarios
from support.kube_api import KubeApi, leaderworkerset_crd, requests_matching
from support.operator_process import OperatorProcess
from support.rbac_usage import record_rbac

NAMESPACE = "faults"
AGENT = "brook-operator"
TIMEOUT = 20.0
OPERATOR_ARGS = ("--resync-seconds=0.5", "--api-timeout-seconds=1")
CHILD_KINDS = ("configmaps", "services", "deployments", "poddisruptionbudgets")
RECONCILER_CONDITIONS = {"SpecValid", "Degraded", "Ready", "Progressing"}


@pytest.fixture
def api(kube_api: KubeApi, brook_crd: dict[str, Any]) -> KubeApi:
    kube_api.create_namespace(NAMESPACE)
    kube_api.create(leaderworkerset_crd())
    return kube_api


def _start(api: KubeApi, log: Path) -> OperatorProcess:
    return OperatorProcess.start(
        api.kubeconfig, log, namespaces=[NAMESPACE], extra_args=OPERATOR_ARGS
    )


@pytest.fixture
def operator(api: KubeApi, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = _start(api, tmp_path / "operator.log")
    yield process
    code = process.stop()
    record_rbac(api)
    log = process.log()
    assert code == 0, log
    assert "Traceback" not in log, log


def _create(api: KubeApi, name: str) -> None:
    manifest = scenarios.manifest("tiny-cpu", NAMESPACE)
    manifest["metadata"]["name"] = name
    api.create(manifest)


def _wait(check: Callable[[], Any], what: str) -> Any:
    return KubeApi.wait_for(check, timeout=TIMEOUT, message=what)


def _condition(api: KubeApi, name: str, kind: str) -> dict[str, Any]:
    return scenarios.condition(api.get("llmi", name, NAMESPACE), kind)


def _wait_condition(api: KubeApi, name: str, kind: str, status: str, reason: str = "") -> None:
    def met() -> bool:
        found = _condition(api, name, kind)
        return found.get("status") == status and reason in (found.get("reason") or "")

    _wait(met, f"{name}: {kind}={status} {reason}")


def _mark_ready(api: KubeApi, name: str) -> None:
    deployment = _wait(lambda: api.get("deployments", name, NAMESPACE), f"{name}'s Deployment")
    replicas = deployment["spec"]["replicas"]
    api.set_status(
        "deployments",
        name,
        {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": replicas,
        },
        NAMESPACE,
    )


def _converged(api: KubeApi, name: str) -> None:
    """Ready and not Degraded, every reconciler condition there, the status current, and
    exactly one of each child, owned by the resource."""
    _mark_ready(api, name)
    _wait_condition(api, name, "Ready", "True")
    _wait_condition(api, name, "Degraded", "False")
    body = api.get("llmi", name, NAMESPACE)
    assert body is not None
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]
    assert {c["type"] for c in body["status"]["conditions"]} >= RECONCILER_CONDITIONS
    for kind in CHILD_KINDS:
        children = api.list(kind, NAMESPACE, label_selector=f"brook.dev/llminference={name}")
        assert len(children) == 1, (kind, [c["metadata"]["name"] for c in children])
        (owner,) = children[0]["metadata"]["ownerReferences"]
        assert owner["uid"] == body["metadata"]["uid"]


def test_throttling_errors_conflicts_and_dropped_watches(
    api: KubeApi, operator: OperatorProcess
) -> None:
    # 429 with Retry-After and server errors: retried, the resource converges.
    throttled = api.inject(
        verb="patch", resource="deployments", user_agent=AGENT, status=429, retry_after=1, times=2
    )
    api.inject(verb="patch", resource="configmaps", user_agent=AGENT, status=500, times=1)
    api.inject(verb="patch", resource="llminferences/status", user_agent=AGENT, status=503, times=2)
    _create(api, "throttled")
    _converged(api, "throttled")
    assert throttled.hits == 2

    # A 409 is not retried blindly: it is reported, and the resync recovers once it stops.
    conflict = api.inject(
        verb="patch", resource="deployments", name="conflicted", user_agent=AGENT, status=409
    )
    _create(api, "conflicted")
    _wait_condition(api, "conflicted", "Degraded", "True", "FieldConflict")
    assert api.get("deployments", "conflicted", NAMESPACE) is None
    api.clear_faults()
    _converged(api, "conflicted")
    assert conflict.hits >= 1

    # Dropped watches: the operator watches again and follows later changes.
    api.drop_watches()
    body = api.get("llmi", "throttled", NAMESPACE)
    assert body is not None
    body["spec"]["image"] = "registry.example/brook-engine:v2"
    api.apply(body, manager="kubectl-client-side-apply")

    def rolled() -> bool:
        deployment = api.get("deployments", "throttled", NAMESPACE) or {}
        containers = deployment["spec"]["template"]["spec"]["containers"]
        return bool(containers[0]["image"] == "registry.example/brook-engine:v2")

    _wait(rolled, "the new image after the watches dropped")
    _converged(api, "throttled")
    _converged(api, "conflicted")


def test_a_hung_connection_stalls_no_other_resource(
    api: KubeApi, operator: OperatorProcess
) -> None:
    """Every call about one resource hangs (the server never answers): the others are
    reconciled and refreshed all the while, and the hung one recovers when the server
    answers again."""
    hung = api.inject(verb="get", resource="deployments", name="hung", user_agent=AGENT, hang=60)
    _create(api, "hung")
    _wait(lambda: hung.hits >= 1, "the hung call")
    _create(api, "healthy")
    _converged(api, "healthy")
    # The hung calls time out (1 s here) and are tried again, rather than hang for good.
    _wait(lambda: hung.hits >= 3, "the hung calls to time out and be retried")
    assert _condition(api, "hung", "Ready").get("status") != "True"
    api.clear_faults()
    _converged(api, "hung")


def test_a_foreign_object_is_refused_until_it_is_gone(
    api: KubeApi, operator: OperatorProcess
) -> None:
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "taken", "namespace": NAMESPACE},
            "spec": {"selector": {"app": "billing"}, "ports": [{"port": 80}]},
        }
    )
    _create(api, "taken")
    _wait_condition(api, "taken", "Degraded", "True", "ForeignObject")
    # Several resyncs later it is still refused, and still untouched.
    before = len(requests_matching(api.requests, verb="list", resource="llminferences"))
    _wait(
        lambda: (
            len(requests_matching(api.requests, verb="list", resource="llminferences"))
            >= before + 3
        ),
        "three resyncs",
    )
    service = api.get("services", "taken", NAMESPACE)
    assert service is not None and service["spec"]["selector"] == {"app": "billing"}
    assert not service["metadata"].get("ownerReferences")
    assert api.get("deployments", "taken", NAMESPACE) is None
    assert not [
        r
        for r in requests_matching(api.requests, verb="patch", resource="services")
        if r.name == "taken"
    ], "the foreign Service was written to"
    api.delete("services", "taken", NAMESPACE)
    _converged(api, "taken")


def test_killed_mid_apply_resumes_without_duplicates(api: KubeApi, tmp_path: Path) -> None:
    """The operator dies while its apply of the Deployment hangs (the config, policies and
    Service are written); a new one finishes the job with nothing made twice."""
    api.inject(verb="patch", resource="deployments", user_agent=AGENT, hang=60)
    first = _start(api, tmp_path / "first.log")
    _create(api, "restarted")

    def pending() -> bool:
        patches = requests_matching(api.requests, verb="patch", resource="deployments")
        return any(r.status == 0 for r in patches)

    _wait(pending, "the hung apply of the Deployment")
    assert api.get("configmaps", "restarted-engine", NAMESPACE) is not None
    first.kill()
    record_rbac(api)
    api.clear_faults()
    second = _start(api, tmp_path / "second.log")
    try:
        _converged(api, "restarted")
    finally:
        assert second.stop() == 0
        record_rbac(api)
    assert "Traceback" not in second.log(), second.log()
