"""The operator's Kubernetes client against the emulated API server with injected faults:
every call times out, and only what may pass on a second try is tried again."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from brook_operator.kube import KubeClient, KubeError
from brook_operator.kube.client import MAX_TEXT_BYTES
from support.kube_api import KubeApi, PodServer, requests_matching

METRICS = "# TYPE brook_requests_total counter\nbrook_requests_total 7\n"


def _client(api: KubeApi, timeout: float = 30.0) -> tuple[KubeClient, list[float]]:
    """A client whose waits between tries are recorded, not slept."""
    client = KubeClient.from_environment(str(api.kubeconfig))
    client.timeout_seconds = timeout
    waits: list[float] = []
    client.sleep = waits.append
    return client, waits


def _configmap(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default"},
        "data": {"k": "v"},
    }


def test_a_hung_call_times_out(kube_api: KubeApi) -> None:
    """A server that reads the request and never answers (a half-open connection) costs
    the timeout of each try, not the caller's thread forever."""
    fault = kube_api.inject(verb="get", resource="configmaps", hang=60)
    client, _ = _client(kube_api, timeout=0.5)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            client.get("v1", "ConfigMap", "default", "anything")
        except BaseException as exc:  # what the thread met, for the test to see
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the call still hangs"
    (error,) = outcome
    assert isinstance(error, KubeError) and error.status == 0 and error.retriable
    assert fault.hits == client.attempts  # each try timed out, then it gave up


def test_throttling_and_server_errors_are_retried_honouring_retry_after(
    kube_api: KubeApi,
) -> None:
    client, waits = _client(kube_api)
    kube_api.inject(verb="patch", resource="configmaps", status=429, retry_after=3, times=1)
    kube_api.inject(verb="patch", resource="configmaps", status=503, times=1)
    applied = client.apply(_configmap("throttled"))
    assert applied["data"] == {"k": "v"}
    patches = requests_matching(kube_api.requests, verb="patch", resource="configmaps")
    assert [r.status for r in patches] == [429, 503, 201]
    assert waits[0] >= 3.0, "Retry-After was not honoured"
    assert 0 < waits[1] < 3.0


def test_a_create_is_not_retried_after_a_server_error(kube_api: KubeApi) -> None:
    """A 500 on a POST may hide a create that happened: retrying could make two objects
    (an Event with a generated name, say). Throttling (429) is safe to retry."""
    client, _ = _client(kube_api)
    kube_api.inject(verb="create", resource="configmaps", status=500, times=1)
    with pytest.raises(KubeError) as caught:
        client.create(_configmap("once"))
    assert caught.value.status == 500
    kube_api.inject(verb="create", resource="configmaps", status=429, times=1)
    client.create(_configmap("once"))
    creates = requests_matching(kube_api.requests, verb="create", resource="configmaps")
    assert [r.status for r in creates] == [500, 429, 201]


@pytest.mark.parametrize("code", [403, 404, 409, 422])
def test_client_errors_are_not_retried(kube_api: KubeApi, code: int) -> None:
    client, waits = _client(kube_api)
    kube_api.inject(verb="patch", resource="configmaps", status=code)
    with pytest.raises(KubeError) as caught:
        client.apply(_configmap("refused"))
    assert caught.value.status == code and not caught.value.retriable
    assert len(requests_matching(kube_api.requests, verb="patch", resource="configmaps")) == 1
    assert waits == []


def test_retries_give_up_after_the_last_try(kube_api: KubeApi) -> None:
    client, waits = _client(kube_api)
    kube_api.inject(verb="get", resource="configmaps", status=500)
    with pytest.raises(KubeError) as caught:
        client.get("v1", "ConfigMap", "default", "x")
    assert caught.value.status == 500
    assert len(requests_matching(kube_api.requests, verb="get")) == client.attempts
    assert len(waits) == client.attempts - 1
    assert waits[1] > waits[0] / 2  # exponential, with jitter


def test_an_apply_conflict_names_the_fields_and_their_managers(kube_api: KubeApi) -> None:
    """The operator applies without force: another manager's field is a 409 whose causes
    say which field and whose it is."""
    client, _ = _client(kube_api)
    kube_api.apply(_configmap("shared") | {"data": {"k": "theirs"}}, manager="someone-else")
    with pytest.raises(KubeError) as caught:
        client.apply(_configmap("shared"))
    assert caught.value.status == 409
    assert caught.value.conflicts == [("someone-else", ".data.k")]
    assert kube_api.get("configmaps", "shared", "default")["data"] == {"k": "theirs"}  # type: ignore[index]


def _pod(api: KubeApi, name: str, ip: str | None = "127.0.0.1") -> None:
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}}, "default")
    if ip is not None:
        api.set_status("pods", name, {"phase": "Running", "podIP": ip}, "default")


def test_pod_proxy_get_reads_a_pods_text(kube_api: KubeApi) -> None:
    """Through the API server's pod proxy, as ``kubectl get --raw`` reads /metrics."""
    _pod(kube_api, "engine-0")
    with PodServer() as pod:
        pod.answer("/metrics", METRICS)
        client = KubeClient.from_environment()
        assert client.pod_proxy_get("default", "engine-0", pod.port, "/metrics") == METRICS
        assert client.pod_proxy_get("default", "engine-0", pod.port, "metrics") == METRICS
        (sent, _) = pod.requests
    assert (sent.method, sent.path, sent.headers["Accept"]) == (
        "GET",
        "/metrics",
        "text/plain, */*",
    )
    (proxied, _) = requests_matching(kube_api.requests, resource="pods/proxy")
    assert proxied.path == f"/api/v1/namespaces/default/pods/engine-0:{pod.port}/proxy/metrics"
    assert proxied.rbac == (("get", "", "pods/proxy", "default"),)


def test_pod_proxy_get_errors(kube_api: KubeApi) -> None:
    """The pod's own error answers and the API server's (no such pod, no IP yet, nothing
    listening) are ``KubeError``s; only the retriable ones are tried again."""
    client, waits = _client(kube_api)
    _pod(kube_api, "engine-0")
    _pod(kube_api, "pending", ip=None)
    with PodServer() as pod:
        pod.answer("/metrics", "engine not ready\n", status=500, content_type="text/plain")
        with pytest.raises(KubeError) as failed:
            client.pod_proxy_get("default", "engine-0", pod.port, "/metrics")
        assert (failed.value.status, failed.value.message) == (500, "engine not ready\n")
        assert len(pod.requests) == client.attempts  # a 5xx is retried, the pod's too
        free_port = pod.port
    waits.clear()
    with pytest.raises(KubeError) as unreachable:  # the server is closed: nothing listens
        client.pod_proxy_get("default", "engine-0", free_port, "/metrics")
    assert (unreachable.value.status, unreachable.value.reason) == (503, "ServiceUnavailable")
    assert unreachable.value.message.startswith("error trying to reach service: dial tcp")
    assert "connection refused" in unreachable.value.message
    assert len(waits) == client.attempts - 1
    waits.clear()
    with pytest.raises(KubeError) as missing:
        client.pod_proxy_get("default", "gone", free_port, "/metrics")
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    assert missing.value.message == 'pods "gone" not found'
    # The real server refuses a pod without an IP (not yet scheduled or started) with a
    # 400 "address not allowed", which is not retried.
    with pytest.raises(KubeError) as no_ip:
        client.pod_proxy_get("default", "pending", free_port, "/metrics")
    assert (no_ip.value.status, no_ip.value.reason) == (400, "BadRequest")
    assert no_ip.value.message.startswith("address not allowed")
    assert "has no IP (status.podIP)" in no_ip.value.message
    assert waits == []


def test_pod_proxy_get_refuses_an_answer_over_the_limit(kube_api: KubeApi) -> None:
    _pod(kube_api, "engine-0")
    with PodServer() as pod:
        pod.answer("/metrics", b"#" * (MAX_TEXT_BYTES + 1))
        pod.answer("/small", b"#" * MAX_TEXT_BYTES)
        client, _ = _client(kube_api)
        with pytest.raises(KubeError) as caught:
            client.pod_proxy_get("default", "engine-0", pod.port, "/metrics")
        assert caught.value.reason == "TooLarge" and "8 MiB" in caught.value.message
        assert not caught.value.retriable
        assert (
            len(client.pod_proxy_get("default", "engine-0", pod.port, "/small")) == MAX_TEXT_BYTES
        )
