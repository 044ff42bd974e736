"""The autoscaler end to end on one machine: the real operator (a child process) against the
emulated kube-apiserver, and real engine servers (``brook-engine serve``) bound to distinct
loopback addresses that stand in for pod IPs.

The emulator runs no controllers, so the test plays the ReplicaSet controller and the
kubelet: when the operator changes the Deployment's replicas it creates the Pod object (with
the address of an engine server as its podIP, marked Ready) or deletes the pod the
ReplicaSet would delete — the one with the lowest ``controller.kubernetes.io/pod-deletion-cost``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from brook_operator.autoscaler.loop import DELETION_COST
from support.engine_pods import add_ready_pod, replica_owner
from support.engine_server import ServerProcess, start_server
from support.kube_api import KubeApi
from support.operator_process import OperatorProcess
from support.ports import free_port
from support.rbac_usage import record_rbac

NAMESPACE = "ai"
NAME = "tiny-auto"
#: Pod IPs: each one a loopback address with its own engine server.
ADDRESSES = ("127.0.0.2", "127.0.0.3")
TIMEOUT = 90.0
#: The ReplicaSet the pods would belong to (the autoscaler only reads a workload's pods).
REPLICA_SET = replica_owner("ReplicaSet", f"{NAME}-5d8f7", "00000000-0000-4000-8000-000000000001")

AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "targetKvCacheUsage": 0.8,
    "tolerance": 0.1,
    "targetWaitingRequests": 1,
    "intervalSeconds": 5,
    "scaleDownStabilizationSeconds": 15,
    "metricsStaleAfterSeconds": 5,
    "startupGraceSeconds": 60,
}


def _manifest(autoscaling: dict[str, Any] = AUTOSCALING) -> dict[str, Any]:
    return {
        "apiVersion": "brook.dev/v1alpha1",
        "kind": "LLMInference",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "file:///models/tiny-llama", "servedName": "tiny"},
            "accelerator": {"type": "cpu", "devicesPerNode": 1},
            "autoscaling": autoscaling,
        },
    }


class Fleet:
    """The engine servers and the Pod objects that point at them."""

    def __init__(self, api: KubeApi, model: Path, folder: Path) -> None:
        self.api, self.model, self.folder = api, model, folder
        self.port = free_port()
        self.servers: dict[str, ServerProcess] = {}
        self.pods: dict[str, str] = {}  # pod name → address

    def start_server(self, address: str) -> ServerProcess:
        folder = self.folder / f"{address}-{time.monotonic_ns()}"
        folder.mkdir()
        server = start_server(
            self.model,
            folder,
            api_key=None,
            host=address,
            port=self.port,
            drain_timeout=2,
            # 32 blocks of 16 tokens: a few requests fill the KV cache.
            kvCache={"numBlocks": 32, "blockSize": 16},
            scheduler={"maxNumSeqs": 8, "maxNumBatchedTokens": 256},
        )
        self.servers[address] = server
        return server

    def stop_servers(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()

    def add_pod(self, address: str) -> str:
        deployment = self.api.get("deployments", NAME, NAMESPACE)
        assert deployment is not None
        name = f"{NAME}-{address.rsplit('.', 1)[1]}"
        template = deployment["spec"]["template"]
        add_ready_pod(self.api, NAMESPACE, name, template, address, self.port, owner=REPLICA_SET)
        self.pods[name] = address
        self._mark_ready()
        return name

    def deletion_costs(self) -> dict[str, int]:
        return {
            pod["metadata"]["name"]: int(
                (pod["metadata"].get("annotations") or {}).get(DELETION_COST, "0")
            )
            for pod in self.api.list("pods", NAMESPACE)
        }

    def remove_cheapest_pod(self) -> str:
        """What the ReplicaSet controller does on scale-in: lowest deletion cost first."""
        costs = self.deletion_costs()
        victim = min(costs, key=lambda name: costs[name])
        self.api.delete("pods", victim, NAMESPACE)
        address = self.pods.pop(victim)
        self.servers.pop(address).stop()  # the pod drains and exits
        self._mark_ready()
        return victim

    def _mark_ready(self) -> None:
        deployment = self.api.get("deployments", NAME, NAMESPACE)
        assert deployment is not None
        n = len(self.pods)
        self.api.set_status(
            "deployments",
            NAME,
            {
                "observedGeneration": deployment["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "availableReplicas": n,
            },
            NAMESPACE,
        )


class Load:
    """``concurrency`` clients sending completions to one server until stopped. Client i
    asks for ``tokens - 9 i`` tokens: clients that start together would otherwise finish in
    the same step, and a scrape between their requests would read the server idle."""

    def __init__(self, server: ServerProcess, concurrency: int, prompt: int, tokens: int) -> None:
        self.stop_event = threading.Event()

        def client(index: int) -> None:
            body = {
                "model": "tiny",
                "prompt": [7] * prompt,
                "max_tokens": tokens - 9 * index,
                "ignore_eos": True,
            }
            while not self.stop_event.is_set():
                try:
                    server.post("/v1/completions", body)
                except OSError:
                    time.sleep(0.1)  # the server is gone: the test is stopping it

        self.threads = [
            threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)
        ]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=60)


def _wait(condition: Callable[[], Any], message: str, timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out: {message}")


@pytest.fixture
def fleet(
    kube_api: KubeApi, brook_crd: dict[str, Any], tiny_llama: Path, tmp_path: Path
) -> Iterator[Fleet]:
    kube_api.create_namespace(NAMESPACE)
    fleet = Fleet(kube_api, tiny_llama, tmp_path)
    yield fleet
    fleet.stop_servers()


@pytest.fixture
def operator(kube_api: KubeApi, fleet: Fleet, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess.start(
        kube_api.kubeconfig, tmp_path / "operator.log", namespaces=[NAMESPACE]
    )
    yield process
    code = process.stop()
    log = process.log()
    record_rbac(kube_api)
    assert code == 0, log
    assert "Traceback" not in log, log


def _llmi(api: KubeApi) -> dict[str, Any]:
    obj = api.get("llmi", NAME, NAMESPACE)
    assert obj is not None
    return obj


def _replicas(api: KubeApi) -> int:
    deployment = api.get("deployments", NAME, NAMESPACE)
    return int(deployment["spec"]["replicas"]) if deployment else -1


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return dict(condition)
    return {}


def _events(api: KubeApi, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.list("events", NAMESPACE) if e.get("reason") == reason]


def _one_replica_reporting(
    api: KubeApi, fleet: Fleet, address: str, manifest: dict[str, Any]
) -> ServerProcess:
    """``manifest`` created, its Deployment at one replica whose pod is an engine server at
    ``address``, and the autoscaler reading its metrics: the server."""
    server = fleet.start_server(address)
    api.create(manifest)
    _wait(lambda: _replicas(api) == 1, "the Deployment at minReplicas")
    fleet.add_pod(address)
    _wait(
        lambda: _condition(_llmi(api), "MetricsAvailable").get("status") == "True",
        f"metrics read from the pod at {address}",
    )
    return server


def _scaled_under(
    load: Load, api: KubeApi, replicas: int, what: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait, with ``load`` running, for the autoscaler to reach ``replicas``; then stop the
    load and return the resource and its last decision."""
    try:
        _wait(lambda: _replicas(api) == replicas, what)
    finally:
        load.stop()
    llmi = _llmi(api)
    return llmi, llmi["status"]["autoscaling"]["lastDecisions"][-1]


def test_load_scales_out_stale_metrics_hold_idleness_scales_in(
    kube_api: KubeApi, fleet: Fleet, operator: OperatorProcess
) -> None:
    api = kube_api
    first, second = ADDRESSES
    server = _one_replica_reporting(api, fleet, first, _manifest())

    # Load: 6 clients × (100 prompt + 200 output tokens) on 32 × 16 KV slots → KV full and a
    # queue. The autoscaler scales out (to maxReplicas, 2).
    load = Load(server, concurrency=6, prompt=100, tokens=200)
    llmi, decision = _scaled_under(load, api, 2, "a scale-out under load")
    assert (decision["fromReplicas"], decision["toReplicas"]) == (1, 2), decision
    assert "KV" in decision["reason"] or "queue" in decision["reason"], decision
    assert llmi["status"]["desiredReplicas"] == 2
    assert "replicas" not in llmi["spec"], "the autoscaler wrote the user's spec"
    assert _events(api, "ScaledOut"), "no ScaledOut event"
    assert _condition(llmi, "ScalingActive")["status"] == "True"

    fleet.start_server(second)
    fleet.add_pod(second)
    _wait(
        lambda: (
            (_llmi(api)["status"]["autoscaling"]["signals"] or {}).get("replicasReporting") == 2
        ),
        "both pods reporting",
    )

    # Kill every metrics endpoint: the size holds (idle replicas would otherwise scale in
    # after the 15 s window) and MetricsAvailable turns False.
    fleet.stop_servers()
    stale = _wait(
        lambda: (c := _condition(_llmi(api), "MetricsAvailable")).get("status") == "False" and c,
        "MetricsAvailable=False",
    )
    assert stale["reason"] == "MetricsStale", stale
    held_until = time.monotonic() + AUTOSCALING["scaleDownStabilizationSeconds"] + 10
    while time.monotonic() < held_until:
        assert _replicas(api) == 2, "missing metrics scaled the fleet in"
        time.sleep(0.5)
    llmi = _llmi(api)
    assert _condition(llmi, "ScalingLimited")["reason"] == "Stale"
    assert _condition(llmi, "ScalingActive")["status"] == "False"

    # Endpoints back, the first pod lightly loaded, the second idle: after the window the
    # fleet scales in, and the idle pod is the one marked cheapest to delete.
    busy = fleet.start_server(first)
    fleet.start_server(second)
    # Two overlapping clients × 6 blocks: the busy pod always holds some KV (≤ 0.375),
    # little enough that ceil(2 × √u) = 1.
    light = Load(busy, concurrency=2, prompt=20, tokens=70)
    try:
        _wait(lambda: _replicas(api) == 1, "a scale-in once idle", timeout=120)
        costs = fleet.deletion_costs()
        assert costs[f"{NAME}-3"] < costs[f"{NAME}-2"], costs
        victim = fleet.remove_cheapest_pod()
    finally:
        light.stop()
    assert fleet.pods == {f"{NAME}-2": first}, f"{victim} went, not the idle pod"
    assert _events(api, "ScaledIn"), "no ScaledIn event"
    decisions = _llmi(api)["status"]["autoscaling"]["lastDecisions"]
    assert (decisions[-1]["fromReplicas"], decisions[-1]["toReplicas"]) == (2, 1), decisions
    assert 'brook_operator_autoscaler_decisions_total{outcome="scale_in"}' in operator.metrics()


def test_a_surge_of_arrivals_scales_out_from_the_engines_counters(
    kube_api: KubeApi, fleet: Fleet, operator: OperatorProcess
) -> None:
    """The arrival signal end to end: the engine counts the prompt tokens it receives and
    the tokens it generates, the operator reads them twice an interval apart, and a demand
    above 1.5 times the fleet's capacity (here configured, replicaTokensPerSecond) scales
    out at once. KV usage (target 1.0) and the queue (target 100) cannot: only the
    arrivals can take the fleet past one replica."""
    api = kube_api
    address = ADDRESSES[0]
    surge_policy = {
        **AUTOSCALING,
        "maxReplicas": 3,
        "targetKvCacheUsage": 1.0,
        "targetWaitingRequests": 100,
        "replicaTokensPerSecond": 20,
    }
    server = _one_replica_reporting(api, fleet, address, _manifest(surge_policy))
    assert _replicas(api) == 1  # idle: nothing arrives
    load = Load(server, concurrency=2, prompt=20, tokens=40)
    llmi, decision = _scaled_under(load, api, 3, "a scale-out on the arrivals")
    assert (decision["fromReplicas"], decision["toReplicas"]) == (1, 3), decision
    assert "arrivals" in decision["reason"], decision
    signals = llmi["status"]["autoscaling"]["signals"]
    assert signals["replicaTokensPerSecond"] == 20
    assert signals["demandTokensPerSecond"] > 1.5 * 20, signals
