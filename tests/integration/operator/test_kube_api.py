"""The emulated kube-apiserver behaves like the real one where kopf, the kubernetes client
and kubectl depend on it (``tests/support/kube_api``). Each test says what it does not
cover because the emulator does not emulate it."""

from __future__ import annotations

import json
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import kubernetes
import pytest
import yaml
from kubernetes.client import AppsV1Api, CoreV1Api, CustomObjectsApi
from kubernetes.client.rest import ApiException

from support.kube_api import KubeApi, PodServer, leaderworkerset_crd, requests_matching

REPO = Path(__file__).resolve().parents[3]
CRD = REPO / "crds" / "llminference.yaml"
EXAMPLE = REPO / "crds" / "examples" / "tiny-cpu.yaml"


@pytest.fixture
def k8s(kube_api: KubeApi) -> Iterator[Any]:
    client = kube_api.client()
    yield client
    client.close()


def get_json(api: KubeApi, path: str) -> Any:
    with urllib.request.urlopen(api.url + path, timeout=10) as response:
        return json.loads(response.read())


def reason(error: ApiException) -> str:
    return str(json.loads(error.body)["reason"])


def configmap(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels or {}, **meta},
        "data": {"k": "v"},
    }


def deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "brook:1",
                            "ports": [{"containerPort": 8000}],
                            "env": [{"name": "A", "value": "1"}],
                        },
                        {"name": "sidecar", "image": "proxy:1"},
                    ]
                },
            },
        },
    }


def owner_ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
    }


def test_discovery_and_namespaces(kube_api: KubeApi, k8s: Any) -> None:
    """Discovery documents name their group/version and list verbs, scopes, short names and
    subresources; namespaces list and create. Not emulated: aggregated discovery
    (apidiscovery.k8s.io/v2), protobuf, ``/openapi/v2``."""
    core = get_json(kube_api, "/api/v1")
    assert core["groupVersion"] == "v1"
    resources = {r["name"]: r for r in core["resources"]}
    assert {"namespaces", "configmaps", "services", "pods", "events", "secrets"} <= set(resources)
    assert "serviceaccounts" in resources
    assert resources["namespaces"]["namespaced"] is False
    assert resources["configmaps"]["namespaced"] is True
    assert "ns" in resources["namespaces"]["shortNames"]
    assert {"get", "list", "watch", "create", "patch", "update", "delete"} <= set(
        resources["configmaps"]["verbs"]
    )

    apps = get_json(kube_api, "/apis/apps/v1")
    assert apps["groupVersion"] == "apps/v1"
    by_name = {r["name"]: r for r in apps["resources"]}
    assert "deploy" in by_name["deployments"]["shortNames"]
    assert by_name["deployments/status"]["verbs"] == ["get", "patch", "update"]
    scale = by_name["deployments/scale"]
    assert (scale["group"], scale["version"], scale["kind"]) == ("autoscaling", "v1", "Scale")

    groups = {g["name"]: g for g in get_json(kube_api, "/apis")["groups"]}
    for group, version in [
        ("apps", "v1"),
        ("policy", "v1"),
        ("apiextensions.k8s.io", "v1"),
        ("events.k8s.io", "v1"),
        ("coordination.k8s.io", "v1"),
    ]:
        assert groups[group]["preferredVersion"]["groupVersion"] == f"{group}/{version}"
        listed = get_json(kube_api, f"/apis/{group}/{version}")
        assert listed["groupVersion"] == f"{group}/{version}"
    pdbs = {r["name"] for r in get_json(kube_api, "/apis/policy/v1")["resources"]}
    assert "poddisruptionbudgets" in pdbs

    api = CoreV1Api(k8s)
    names = {ns.metadata.name for ns in api.list_namespace().items}
    assert {"default", "kube-system"} <= names
    created = api.create_namespace({"metadata": {"name": "team-a"}})
    assert created.status.phase == "Active"
    assert "team-a" in {ns.metadata.name for ns in api.list_namespace().items}
    with pytest.raises(urllib.error.HTTPError) as missing:
        get_json(kube_api, "/openapi/v2")
    assert missing.value.code == 404


def test_create_answers_201_with_the_object(kube_api: KubeApi, k8s: Any) -> None:
    """Create answers 201 with the stored object (uid, resourceVersion, timestamp, the
    namespace from the URL); errors are Status objects. Not emulated: admission (quotas,
    limit ranges, webhooks), and validation of the object against its type."""
    api = CoreV1Api(k8s)
    body = configmap("settings")
    del body["metadata"]["labels"]
    created = api.create_namespaced_config_map("default", body)
    assert created is not None
    assert created.metadata.namespace == "default"
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert int(created.metadata.resource_version) > 0
    assert created.data == {"k": "v"}
    (record,) = requests_matching(kube_api.requests, verb="create", resource="configmaps")
    assert record.status == 201
    assert record.rbac == (("create", "", "configmaps", "default"),)

    with pytest.raises(ApiException) as exists:
        api.create_namespaced_config_map("default", body)
    assert (exists.value.status, reason(exists.value)) == (409, "AlreadyExists")
    with pytest.raises(ApiException) as missing:
        api.read_namespaced_config_map("nope", "default")
    assert (missing.value.status, reason(missing.value)) == (404, "NotFound")
    assert json.loads(missing.value.body)["message"] == 'configmaps "nope" not found'
    with pytest.raises(ApiException) as no_namespace:
        api.create_namespaced_config_map("ghost-town", body)
    assert no_namespace.value.status == 404


def test_generation_and_resource_version(kube_api: KubeApi, k8s: Any) -> None:
    """generation is 1 on create and grows only when the spec changes; resourceVersion
    grows on every change; a stale resourceVersion is a 409; PUT replaces; a failed
    JSON-patch ``test`` is a 422. Not emulated: the Deployment controller (no ReplicaSets,
    no observedGeneration): the test writes the status itself."""
    apps = AppsV1Api(k8s)
    created = apps.create_namespaced_deployment("default", deployment("web"))
    assert created.metadata.generation == 1
    rv0 = int(created.metadata.resource_version)

    labelled = apps.patch_namespaced_deployment(
        "web", "default", {"metadata": {"labels": {"t": "x"}}}
    )
    assert labelled.metadata.generation == 1
    rv1 = int(labelled.metadata.resource_version)
    assert rv1 > rv0

    scaled = apps.patch_namespaced_deployment("web", "default", {"spec": {"replicas": 2}})
    assert scaled.metadata.generation == 2
    status = kube_api.set_status("deployments", "web", {"readyReplicas": 2}, "default")
    assert status["metadata"]["generation"] == 2
    assert int(status["metadata"]["resourceVersion"]) > int(scaled.metadata.resource_version)

    with pytest.raises(ApiException) as stale:
        apps.replace_namespaced_deployment("web", "default", labelled)
    assert (stale.value.status, reason(stale.value)) == (409, "Conflict")

    fresh = apps.read_namespaced_deployment("web", "default")
    fresh.metadata.labels = None
    replaced = apps.replace_namespaced_deployment("web", "default", fresh)
    assert replaced.metadata.labels is None
    assert replaced.metadata.generation == 2
    assert replaced.status.ready_replicas == 2

    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": str(rv1)},
        {"op": "add", "path": "/metadata/labels", "value": {"t": "y"}},
    ]
    with pytest.raises(ApiException) as failed_test:
        apps.patch_namespaced_deployment("web", "default", ops)
    assert failed_test.value.status == 422
    ops[0]["value"] = replaced.metadata.resource_version
    assert apps.patch_namespaced_deployment("web", "default", ops).metadata.labels == {"t": "y"}


def test_status_and_spec_are_written_separately(kube_api: KubeApi, k8s: Any) -> None:
    """With a status subresource, writes to the object ignore status and writes to
    ``/status`` change only status; the recorded RBAC resource is ``deployments/status``.
    Not emulated: per-kind status rules of the real registry strategies (e.g. which
    metadata a status write may change)."""
    apps = AppsV1Api(k8s)
    apps.create_namespaced_deployment("default", deployment("web"))
    main = apps.patch_namespaced_deployment(
        "web", "default", {"spec": {"replicas": 3}, "status": {"readyReplicas": 5}}
    )
    assert main.spec.replicas == 3
    assert main.status is None or main.status.ready_replicas is None

    status = apps.patch_namespaced_deployment_status(
        "web", "default", {"spec": {"replicas": 9}, "status": {"readyReplicas": 1}}
    )
    assert status.status.ready_replicas == 1
    assert status.spec.replicas == 3
    assert status.metadata.generation == main.metadata.generation
    checks = kube_api.rbac()
    assert ("patch", "apps", "deployments/status", "default") in checks
    assert ("patch", "apps", "deployments", "default") in checks
    table = kube_api.kubectl("get", "deploy", "web").stdout.split()
    assert table[:6] == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE", "web"]
    assert table[6] == "1/3"


def test_label_and_field_selectors(kube_api: KubeApi, k8s: Any) -> None:
    """Label selectors (=, !=, in, notin, exists, !exists) and field selectors
    (metadata.name, metadata.namespace) filter namespaced and cluster-wide lists. Not
    emulated: the set-based selectors' exotic forms beyond ``>``/``<``; field selectors
    other than metadata and a few per-kind ones (a 400, as on the real server)."""
    api = CoreV1Api(k8s)
    kube_api.create_namespace("other")
    for namespace, name, labels in [
        ("default", "a", {"app": "brook", "tier": "engine"}),
        ("default", "b", {"app": "brook", "tier": "router"}),
        ("default", "c", {"app": "other"}),
        ("other", "d", {"app": "brook", "tier": "engine"}),
    ]:
        api.create_namespaced_config_map(namespace, configmap(name, labels))

    def names(selector: str = "", fields: str = "", everywhere: bool = False) -> list[str]:
        if everywhere:
            listed = api.list_config_map_for_all_namespaces(
                label_selector=selector, field_selector=fields
            )
        else:
            listed = api.list_namespaced_config_map(
                "default", label_selector=selector, field_selector=fields
            )
        assert int(listed.metadata.resource_version) > 0
        return [item.metadata.name for item in listed.items]

    assert names("app=brook") == ["a", "b"]
    assert names("app==brook,tier!=router") == ["a"]
    assert names("tier in (engine, router)") == ["a", "b"]
    assert names("tier notin (engine)") == ["b", "c"]
    assert names("tier") == ["a", "b"]
    assert names("!tier") == ["c"]
    assert names(fields="metadata.name=b") == ["b"]
    assert names("app=brook", everywhere=True) == ["a", "b", "d"]
    assert names(fields="metadata.namespace=other", everywhere=True) == ["d"]
    assert names("tier=engine", fields="metadata.namespace!=other", everywhere=True) == ["a"]
    with pytest.raises(ApiException) as bad:
        names(fields="data.k=v")
    assert bad.value.status == 400

    first = api.list_namespaced_config_map("default", limit=2)
    assert [i.metadata.name for i in first.items] == ["a", "b"]
    assert first.metadata.remaining_item_count == 1
    rest = api.list_namespaced_config_map("default", limit=2, _continue=first.metadata._continue)
    assert [i.metadata.name for i in rest.items] == ["c"]
    assert not rest.metadata._continue


def test_watch_from_a_resource_version(kube_api: KubeApi, k8s: Any) -> None:
    """Watches stream only the events after the given resourceVersion, start with synthetic
    ADDED events without one, end after timeoutSeconds, report objects entering and leaving
    a label selector as ADDED/DELETED, and answer 410 Gone once the history is compacted.
    Not emulated: watch-cache quirks (e.g. a too-new resourceVersion waits on the real
    server), periodic bookmarks (only when ``bookmark_interval`` is set)."""
    api = CoreV1Api(k8s)
    api.create_namespaced_config_map("default", configmap("a"))
    since = api.list_namespaced_config_map("default").metadata.resource_version
    api.create_namespaced_config_map("default", configmap("b"))
    api.patch_namespaced_config_map("a", "default", {"data": {"k": "changed"}})
    api.delete_namespaced_config_map("b", "default")

    def events(**kwargs: Any) -> list[tuple[str, str]]:
        stream = kubernetes.watch.Watch().stream(
            api.list_namespaced_config_map, "default", timeout_seconds=1, **kwargs
        )
        return [(e["type"], e["object"].metadata.name) for e in stream]

    started = time.monotonic()
    assert events(resource_version=since) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert events() == [("ADDED", "a")]
    assert time.monotonic() - started < 5  # both streams ended by timeoutSeconds=1

    marker = kube_api.resource_version
    api.patch_namespaced_config_map("a", "default", {"metadata": {"labels": {"watched": "yes"}}})
    api.patch_namespaced_config_map("a", "default", {"data": {"k": "again"}})
    api.patch_namespaced_config_map("a", "default", {"metadata": {"labels": {"watched": None}}})
    selected = events(resource_version=marker, label_selector="watched=yes")
    assert selected == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]

    kube_api.compact()
    url = f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={since}"
    with urllib.request.urlopen(kube_api.url + url, timeout=10) as response:
        first = json.loads(response.readline())
    assert first["type"] == "ERROR"
    assert first["object"]["code"] == 410


def test_server_side_apply(kube_api: KubeApi, k8s: Any) -> None:
    """Apply creates (201), is idempotent for one manager (same resourceVersion), removes
    the fields its manager applied before but omits now while keeping other managers'
    fields, conflicts on another manager's field (409) unless forced, and records
    managedFields. Not emulated exactly: lists are atomic (the real server merges
    ``listType=map`` lists item by item); see ``support.kube_api.apply``."""
    api = CoreV1Api(k8s)

    def apply(body: dict[str, Any], manager: str = "brook", force: bool = False) -> Any:
        return api.patch_namespaced_config_map(
            body["metadata"]["name"],
            "default",
            body,
            field_manager=manager,
            force=force,
            _content_type="application/apply-patch+yaml",
        )

    desired = configmap("child", {"app": "brook", "tier": "engine"})
    desired["data"] = {"model": "tiny", "port": "8000"}
    created = apply(desired)
    (record,) = requests_matching(kube_api.requests, verb="patch", resource="configmaps")
    assert record.status == 201
    assert ("create", "", "configmaps", "default") in record.rbac
    again = apply(desired)
    assert again.metadata.resource_version == created.metadata.resource_version

    api.patch_namespaced_config_map("child", "default", {"metadata": {"labels": {"extra": "x"}}})
    del desired["metadata"]["labels"]["tier"]
    del desired["data"]["port"]
    pruned = apply(desired)
    assert pruned.metadata.labels == {"app": "brook", "extra": "x"}
    assert pruned.data == {"model": "tiny"}

    rival = {**configmap("child"), "data": {"model": "huge"}}
    del rival["metadata"]["labels"]
    with pytest.raises(ApiException) as conflict:
        apply(rival, manager="rival")
    assert conflict.value.status == 409
    assert 'conflict with "brook"' in json.loads(conflict.value.body)["message"]
    forced = apply(rival, manager="rival", force=True)
    assert forced.data == {"model": "huge"}
    managers = {(m.manager, m.operation) for m in forced.metadata.managed_fields}
    assert {("brook", "Apply"), ("rival", "Apply")} <= managers
    owned_by_rival = next(m for m in forced.metadata.managed_fields if m.manager == "rival")
    assert owned_by_rival.fields_v1 == {"f:data": {"f:model": {}}}


def test_server_side_apply_merges_list_maps_item_by_item(
    kube_api: KubeApi, brook_crd: dict[str, Any]
) -> None:
    """``status.conditions`` is ``x-kubernetes-list-type: map`` keyed by ``type`` in the
    CRD: two managers applying different conditions through /status keep each other's,
    a manager dropping an item removes only its own, and a manager changing another's
    item conflicts unless forced."""
    kube_api.create_namespace("demo")
    kube_api.load(EXAMPLE, "demo")
    api = CustomObjectsApi(kube_api.client())

    def apply(conditions: list[dict[str, Any]], manager: str, force: bool = True) -> Any:
        body = {
            "apiVersion": "brook.dev/v1alpha1",
            "kind": "LLMInference",
            "metadata": {"name": "tiny-cpu", "namespace": "demo"},
            "status": {"conditions": conditions},
        }
        return api.patch_namespaced_custom_object_status(
            "brook.dev", "v1alpha1", "demo", "llminferences", "tiny-cpu", body,
            field_manager=manager, force=force,
            _content_type="application/apply-patch+yaml",
        )  # fmt: skip

    def types(obj: Any) -> dict[str, str]:
        return {c["type"]: c["status"] for c in obj["status"]["conditions"]}

    ready = {"type": "Ready", "status": "True"}
    apply([ready, {"type": "Degraded", "status": "False"}], "reconciler")
    both = apply([{"type": "ScalingActive", "status": "True"}], "autoscaler")
    assert types(both) == {"Ready": "True", "Degraded": "False", "ScalingActive": "True"}
    fields = {m["manager"]: m["fieldsV1"] for m in both["metadata"]["managedFields"]}
    assert set(fields["autoscaler"]["f:status"]["f:conditions"]) == {'k:{"type":"ScalingActive"}'}
    dropped = apply([ready], "reconciler")
    assert types(dropped) == {"Ready": "True", "ScalingActive": "True"}
    with pytest.raises(ApiException) as conflict:
        apply([{"type": "ScalingActive", "status": "False"}], "reconciler", force=False)
    assert conflict.value.status == 409
    message = json.loads(conflict.value.body)["message"]
    assert '.status.conditions[type="ScalingActive"].status' in message


def test_injected_faults_and_dropped_watches(kube_api: KubeApi) -> None:
    """Faults answer before the emulation (and change nothing); a dropped watch ends."""
    fault = kube_api.inject(verb="create", resource="configmaps", status=429, retry_after=2)
    request = urllib.request.Request(
        kube_api.url + "/api/v1/namespaces/default/configmaps",
        data=json.dumps(configmap("x")).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert (refused.value.code, refused.value.headers["Retry-After"]) == (429, "2")
    assert json.loads(refused.value.read())["reason"] == "TooManyRequests"
    assert fault.hits == 1 and kube_api.get("configmaps", "x", "default") is None
    kube_api.clear_faults()
    kube_api.inject(verb="get", resource="configmaps", hang=30)
    with pytest.raises(OSError):  # a timeout: nothing ever answers
        urllib.request.urlopen(kube_api.url + "/api/v1/namespaces/default/configmaps/x", timeout=1)
    kube_api.clear_faults()
    url = kube_api.url + "/api/v1/namespaces/default/configmaps?watch=true"
    with urllib.request.urlopen(url, timeout=10) as stream:
        kube_api.wait_for(lambda: kube_api.handler.cluster.store.watchers, message="a watch")
        kube_api.drop_watches("configmaps")
        assert stream.read() == b""  # the server ended the stream


def test_pod_proxy_forwards_to_the_pod_ip(kube_api: KubeApi) -> None:
    """``pods/{name[:port]}/proxy/{path}`` goes on to ``status.podIP`` (a test's server on
    127.0.0.1 here: the real server refuses loopback IPs) with the method, query, body and
    Content-Type, and answers with the pod's status, body and Content-Type. Not covered:
    https to the pod, services/proxy and nodes/proxy (not emulated)."""
    pod_spec = {"containers": [{"name": "engine", "ports": [{"containerPort": 0}]}]}
    with PodServer() as pod:
        pod_spec["containers"][0]["ports"][0]["containerPort"] = pod.port
        kube_api.create(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine-0"}, "spec": pod_spec},
            "default",
        )
        kube_api.set_status("pods", "engine-0", {"podIP": "127.0.0.1"}, "default")
        pod.answer("/metrics", "brook_up 1\n")
        pod.answer("/admin/", "ok", content_type="application/json")
        pod.answer("/broken", "boom\n", status=500, content_type="text/plain")
        base = "/api/v1/namespaces/default/pods"

        raw = kube_api.kubectl("get", "--raw", f"{base}/engine-0:{pod.port}/proxy/metrics?a=1&b=2")
        assert raw.stdout == "brook_up 1\n"
        assert (pod.requests[-1].path, pod.requests[-1].query) == ("/metrics", "a=1&b=2")
        # SCHEME:NAME:PORT, and NAME alone (the first container port).
        for name in (f"http:engine-0:{pod.port}", "engine-0"):
            assert kube_api.kubectl("get", "--raw", f"{base}/{name}/proxy/metrics").stdout == (
                "brook_up 1\n"
            )
        with urllib.request.urlopen(
            f"{kube_api.url}{base}/engine-0/proxy/admin/?x=a%20b", timeout=10
        ) as answer:
            assert (answer.status, answer.headers["Content-Type"]) == (200, "application/json")
            assert answer.read() == b"ok"
        # The query goes on as it came (kubectl itself re-encodes ``%20`` as ``+``).
        assert (pod.requests[-1].path, pod.requests[-1].query) == ("/admin/", "x=a%20b")
        # The query is the pod's: ``watch=true`` makes no watch of pods (RBAC ``get``).
        urllib.request.urlopen(f"{kube_api.url}{base}/engine-0/proxy/metrics?watch=true").close()
        assert kube_api.requests[-1].rbac == (("get", "", "pods/proxy", "default"),)

        post = urllib.request.Request(
            f"{kube_api.url}{base}/engine-0/proxy/admin/",
            data=b"not json",
            headers={"Content-Type": "text/plain"},
            method="POST",
        )
        urllib.request.urlopen(post, timeout=10).close()
        sent = pod.requests[-1]
        assert (sent.method, sent.body, sent.headers["Content-Type"]) == (
            "POST",
            b"not json",
            "text/plain",
        )

        with pytest.raises(urllib.error.HTTPError) as broken:  # the pod's error, as it is
            urllib.request.urlopen(f"{kube_api.url}{base}/engine-0/proxy/broken", timeout=10)
        assert (broken.value.code, broken.value.headers["Content-Type"]) == (500, "text/plain")
        assert broken.value.read() == b"boom\n"

        for name, code, words in [
            ("https:engine-0:1", 400, "over http only"),
            ("a:b:c:d", 400, 'invalid pod request "a:b:c:d"'),
            ("engine-0:http", 400, "invalid pod request"),
            ("gone:1", 404, 'pods "gone" not found'),
        ]:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{kube_api.url}{base}/{name}/proxy/", timeout=10)
            status = json.loads(refused.value.read())
            assert (refused.value.code, status["code"]) == (code, code)
            assert words in status["message"]
        free_port = pod.port
    unreachable = kube_api.kubectl(
        "get", "--raw", f"{base}/engine-0:{free_port}/proxy/metrics", check=False
    )
    assert unreachable.returncode != 0
    assert "error trying to reach service: dial tcp" in unreachable.stderr
    assert "ServiceUnavailable" in unreachable.stderr

    proxied = requests_matching(kube_api.requests, resource="pods/proxy")
    assert {r.rbac for r in proxied} == {
        (("get", "", "pods/proxy", "default"),),
        (("create", "", "pods/proxy", "default"),),
    }
    assert [r.verb for r in proxied].count("create") == 1
    assert requests_matching(kube_api.requests, resource="pods/proxy/metrics") == []


def test_strategic_merge_patch_merges_lists_by_key(kube_api: KubeApi, k8s: Any) -> None:
    """Strategic merge patches merge containers (and env) by name. Not emulated exactly:
    merge keys come from a table of field names, not from the Go types' patch tags."""
    apps = AppsV1Api(k8s)
    apps.create_namespaced_deployment("default", deployment("web"))
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "engine", "image": "brook:2", "env": [{"name": "B", "value": "2"}]}
                    ]
                }
            }
        }
    }
    patched = apps.patch_namespaced_deployment("web", "default", patch)
    containers = {c.name: c for c in patched.spec.template.spec.containers}
    assert set(containers) == {"engine", "sidecar"}
    assert containers["engine"].image == "brook:2"
    assert [e.name for e in containers["engine"].env] == ["A", "B"]
    assert containers["engine"].ports[0].container_port == 8000


def test_crd_registration_and_kubectl(kube_api: KubeApi) -> None:
    """kubectl applies the project's CRD (with validation on) and an example; discovery
    serves the new resource with its status and scale subresources; ``kubectl get llmi``
    prints the printer columns; scale, get -o yaml, server-side apply (with a conflict),
    delete; deleting the CRD unregisters it. Not emulated: schema validation (including
    CEL rules) -- a server-side ``fieldValidation=Strict`` is accepted and ignored."""
    applied = kube_api.kubectl("apply", "-f", str(CRD))
    assert "customresourcedefinition.apiextensions.k8s.io/llminferences.brook.dev created" in (
        applied.stdout
    )
    crd = kube_api.get("crd", "llminferences.brook.dev")
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    listed = get_json(kube_api, "/apis/brook.dev/v1alpha1")
    by_name = {r["name"]: r for r in listed["resources"]}
    assert by_name["llminferences"]["shortNames"] == ["llmi"]
    assert by_name["llminferences"]["namespaced"] is True
    assert by_name["llminferences"]["kind"] == "LLMInference"
    assert "llminferences/status" in by_name
    assert by_name["llminferences/scale"]["kind"] == "Scale"

    kube_api.kubectl("create", "namespace", "demo")
    kube_api.kubectl("apply", "-n", "demo", "-f", str(EXAMPLE))
    table = kube_api.kubectl("get", "llmi", "-n", "demo").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "TP", "PP", "REPLICAS", "READY", "AGE"]
    assert table[1].split()[:4] == ["tiny-cpu", "file:///models/tiny-llama", "1", "1"]
    kube_api.set_status("llmi", "tiny-cpu", {"replicas": 1, "readyReplicas": 1}, "demo")
    row = kube_api.kubectl("get", "llmi", "tiny-cpu", "-n", "demo").stdout.splitlines()[1]
    assert row.split()[:6] == ["tiny-cpu", "file:///models/tiny-llama", "1", "1", "1", "1"]
    assert row.split()[6].endswith("s")  # the age, e.g. "0s"

    scaled = kube_api.kubectl("scale", "llmi/tiny-cpu", "--replicas=3", "-n", "demo")
    assert "scaled" in scaled.stdout
    shown = yaml.safe_load(
        kube_api.kubectl("get", "llmi", "tiny-cpu", "-n", "demo", "-o", "yaml").stdout
    )
    assert shown["spec"]["replicas"] == 3
    assert shown["metadata"]["generation"] == 2
    assert shown["spec"]["parallel"] == {
        "tensor": 1,
        "pipeline": 1,
        "timeoutSeconds": 120,
    }  # CRD defaults
    assert shown["status"]["readyReplicas"] == 1

    rival = kube_api.kubectl(
        "apply",
        "--server-side",
        "--field-manager=rival",
        "-n",
        "demo",
        "-f",
        str(EXAMPLE),
        check=False,
    )
    assert rival.returncode != 0
    assert "conflict" in rival.stderr and ".spec.replicas" in rival.stderr
    forced = kube_api.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=rival",
        "-n",
        "demo",
        "-f",
        str(EXAMPLE),
    )
    assert "serverside-applied" in forced.stdout
    assert kube_api.get("llmi", "tiny-cpu", "demo")["spec"]["replicas"] == 1  # type: ignore[index]

    kube_api.kubectl("delete", "llmi", "tiny-cpu", "-n", "demo")
    assert kube_api.get("llmi", "tiny-cpu", "demo") is None
    kube_api.kubectl("delete", "-f", str(CRD))
    with pytest.raises(urllib.error.HTTPError) as gone:
        get_json(kube_api, "/apis/brook.dev/v1alpha1")
    assert gone.value.code == 404


def test_other_crds_register_the_same_way(kube_api: KubeApi, k8s: Any) -> None:
    """A stand-in LeaderWorkerSet CRD registers like any CRD; its scale subresource reads
    and patches the CRD's replica paths. Not emulated: the LeaderWorkerSet controller (no
    StatefulSets, no pods, no status)."""
    with pytest.raises(urllib.error.HTTPError):
        get_json(kube_api, "/apis/leaderworkerset.x-k8s.io/v1")
    kube_api.create(leaderworkerset_crd())
    objects = CustomObjectsApi(k8s)
    group, version, plural = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
    body = {
        "apiVersion": f"{group}/{version}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "tiny"},
        "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 4}},
    }
    created = objects.create_namespaced_custom_object(group, version, "default", plural, body)
    assert created["metadata"]["generation"] == 1
    scale = objects.get_namespaced_custom_object_scale(group, version, "default", plural, "tiny")
    assert scale["spec"]["replicas"] == 2
    objects.patch_namespaced_custom_object_scale(
        group, version, "default", plural, "tiny", {"spec": {"replicas": 4}}
    )
    stored = kube_api.get("lws", "tiny", "default")
    assert stored is not None
    assert stored["spec"] == {"replicas": 4, "leaderWorkerTemplate": {"size": 4}}
    assert stored["metadata"]["generation"] == 2


def test_garbage_collection(kube_api: KubeApi, k8s: Any) -> None:
    """Deleting an owner deletes its dependents (cascading, background), leaves orphans
    with propagationPolicy=Orphan, waits for dependents with Foreground, and keeps a
    dependent that still has another owner. Not emulated: the collector's delay (it acts
    within the deleting request) and ``blockOwnerDeletion`` checks."""
    api = CoreV1Api(k8s)

    def make(name: str, *owners: dict[str, Any], **meta: Any) -> dict[str, Any]:
        refs = [owner_ref(o) for o in owners]
        body = configmap(name, **({"ownerReferences": refs} if refs else {}), **meta)
        return kube_api.create(body, "default")

    def exists(name: str) -> bool:
        return kube_api.get("configmaps", name, "default") is not None

    owner = make("owner")
    child = make("child", owner)
    make("grandchild", child)
    deployment_body = {
        **deployment("engine"),
        "metadata": {"name": "engine", "ownerReferences": [owner_ref(owner)]},
    }
    AppsV1Api(k8s).create_namespaced_deployment("default", deployment_body)
    api.delete_namespaced_config_map("owner", "default")
    assert not exists("owner") and not exists("child") and not exists("grandchild")
    assert kube_api.get("deployments", "engine", "default") is None

    keeper = make("keeper")
    orphan = make("orphan", keeper)
    assert orphan["metadata"]["ownerReferences"]
    api.delete_namespaced_config_map("keeper", "default", propagation_policy="Orphan")
    survivor = kube_api.get("configmaps", "orphan", "default")
    assert survivor is not None and "ownerReferences" not in survivor["metadata"]

    first, second = make("first"), make("second")
    make("shared", first, second)
    api.delete_namespaced_config_map("first", "default")
    shared = kube_api.get("configmaps", "shared", "default")
    assert shared is not None
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["second"]

    parent = make("parent")
    make("held", parent, finalizers=["example.com/hold"])
    api.delete_namespaced_config_map("parent", "default", propagation_policy="Foreground")
    waiting = kube_api.get("configmaps", "parent", "default")
    assert waiting is not None and waiting["metadata"]["finalizers"] == ["foregroundDeletion"]
    held = kube_api.get("configmaps", "held", "default")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    api.patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": None}})
    assert not exists("held") and not exists("parent")


def test_finalizers_and_namespace_termination(kube_api: KubeApi, k8s: Any) -> None:
    """An object with finalizers gets a deletionTimestamp (202) and goes when they are
    removed (MODIFIED, then DELETED); no finalizer can be added meanwhile; deleting a namespace
    deletes its objects. Not emulated: graceful pod termination (pods go at once)."""
    api = CoreV1Api(k8s)
    api.create_namespaced_config_map(
        "default", configmap("guarded", finalizers=["example.com/cleanup"])
    )
    since = kube_api.resource_version
    api.delete_namespaced_config_map("guarded", "default")
    (record,) = requests_matching(kube_api.requests, verb="delete")
    assert record.status == 202
    marked = api.read_namespaced_config_map("guarded", "default")
    assert marked.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as refused:
        api.patch_namespaced_config_map(
            "guarded", "default", {"metadata": {"finalizers": ["example.com/cleanup", "more"]}}
        )
    assert refused.value.status == 422
    api.patch_namespaced_config_map("guarded", "default", {"metadata": {"finalizers": None}})
    stream = kubernetes.watch.Watch().stream(
        api.list_namespaced_config_map, "default", resource_version=since, timeout_seconds=1
    )
    # Marked for deletion, finalizers removed, gone: as the real server reports it.
    assert [e["type"] for e in stream] == ["MODIFIED", "MODIFIED", "DELETED"]

    kube_api.create_namespace("doomed")
    api.create_namespaced_config_map("doomed", configmap("inside"))
    api.delete_namespace("doomed")
    assert kube_api.get("configmaps", "inside", "doomed") is None
    assert kube_api.get("namespaces", "doomed") is None


def test_faults_can_be_injected_with_kmock(kube_api: KubeApi, k8s: Any) -> None:
    """kmock reactions answer before the emulation: one 503 on creating a ConfigMap (the
    state does not change), then 500s on deleting until the reactions are cleared. Not
    emulated: transport faults (resets, timeouts) -- a reaction answers with HTTP."""
    kube_api.handler[kmock.method.POST, kmock.resource("", "v1", "configmaps")][:1] << 503
    api = CoreV1Api(k8s)
    with pytest.raises(ApiException) as unavailable:
        api.create_namespaced_config_map("default", configmap("flaky"))
    assert unavailable.value.status == 503
    assert kube_api.get("configmaps", "flaky", "default") is None
    assert api.create_namespaced_config_map("default", configmap("flaky")).metadata.uid

    kube_api.handler[kmock.method.DELETE, kmock.resource("", "v1", "configmaps")] << 500
    for _ in range(2):
        with pytest.raises(ApiException):
            api.delete_namespaced_config_map("flaky", "default")
    kube_api.clear_reactions()
    api.delete_namespaced_config_map("flaky", "default")
    assert kube_api.get("configmaps", "flaky", "default") is None


OPERATOR = textwrap.dedent(
    """
    import kopf

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_):
        settings.watching.server_timeout = 30
        settings.posting.level = 20  # INFO: post kopf.info() as Kubernetes Events

    @kopf.on.create("brook.dev", "v1alpha1", "llminferences")
    def created(body, spec, name, namespace, patch, **_):
        patch.status["endpoint"] = f"http://{name}.{namespace}.svc:{spec['server']['port']}"
        patch.status["observedGeneration"] = body["metadata"]["generation"]
        kopf.info(body, reason="Accepted", message=f"serving {spec['model']['uri']}")

    @kopf.on.delete("brook.dev", "v1alpha1", "llminferences")
    def deleted(**_):
        pass
    """
)


def test_kopf_operator_end_to_end(
    kube_api: KubeApi, brook_crd: dict[str, Any], tmp_path: Path
) -> None:
    """A kopf operator (run by KopfRunner) discovers the CRD, watches, adds its finalizer
    with a JSON patch that tests the resourceVersion, patches the status subresource, posts
    an Event, and releases the object on deletion. Run ``--standalone`` here; peering runs in
    test_peering.py. Not emulated: anything a real cluster would do to the children."""
    from kopf.testing import KopfRunner

    operator = tmp_path / "operator.py"
    operator.write_text(OPERATOR)
    kube_api.create_namespace("demo")
    with KopfRunner(["run", "--standalone", "-A", "--verbose", str(operator)]) as runner:
        kube_api.kubectl("apply", "-n", "demo", "-f", str(EXAMPLE))

        def handled() -> dict[str, Any] | None:
            obj = kube_api.get("llmi", "tiny-cpu", "demo")
            return obj if obj and obj.get("status", {}).get("endpoint") else None

        obj = kube_api.wait_for(handled, timeout=20, message="the create handler's status")
        assert obj["status"]["endpoint"] == "http://tiny-cpu.demo.svc:8000"
        assert obj["status"]["observedGeneration"] == 1
        assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        events = kube_api.wait_for(
            lambda: [e for e in kube_api.list("events", "demo") if e["reason"] == "Accepted"],
            message="kopf's Event",
        )
        assert events[0]["involvedObject"]["name"] == "tiny-cpu"
        kube_api.kubectl("delete", "llmi", "tiny-cpu", "-n", "demo", "--timeout=20s")
        assert kube_api.get("llmi", "tiny-cpu", "demo") is None
    assert runner.exception is None
    assert runner.exit_code == 0

    kopf_requests = requests_matching(kube_api.requests, user_agent="kopf")
    json_patches = [r for r in kopf_requests if r.content_type.startswith("application/json-patch")]
    assert json_patches and all(r.status == 200 for r in json_patches)
    assert all(r.body[0]["op"] == "test" for r in json_patches)
    assert all(r.body[0]["path"] == "/metadata/resourceVersion" for r in json_patches)
    checks = kube_api.rbac(user_agent="kopf")
    assert {
        ("list", "apiextensions.k8s.io", "customresourcedefinitions", None),
        ("watch", "brook.dev", "llminferences", None),
        ("patch", "brook.dev", "llminferences", "demo"),
        ("patch", "brook.dev", "llminferences/status", "demo"),
        ("create", "", "events", "demo"),
    } <= checks
