"""The operator's Kubernetes client against the emulated API server with injected faults:
every call times out, and only what may pass on a second try is tried again."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from brook_operator.kube import KubeClient, KubeError
from support.kube_api import KubeApi, requests_matching


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
