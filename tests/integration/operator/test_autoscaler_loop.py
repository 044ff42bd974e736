"""One autoscaler round at a time (``Autoscaler.run_once``) against the emulated API server,
reading a real HTTP /metrics endpoint on a loopback address. The endpoint serves a fixed
exposition in the engine's format (the engine itself is exercised in test_autoscaler.py):
here the loop's own rules are under test — DryRun, Active, and a restarted operator."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import kmock
import pytest

from brook_operator.autoscaler.loop import Autoscaler
from brook_operator.controller import Reconciler
from brook_operator.kube import KubeClient
from support.engine_pods import add_ready_pod, replica_owner
from support.kube_api import KubeApi, leaderworkerset_crd
from support.ports import free_port

NAMESPACE = "ai"
NAME = "canned"
ADDRESS = "127.0.0.4"


class Exposition:
    """A /metrics endpoint whose numbers the test sets."""

    def __init__(self) -> None:
        self.kv, self.waiting = 0.0, 0
        self.prompt_tokens: int | None = None  # the demand counters, when set
        self.generation_tokens = 0
        exposition = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                text = (
                    f"brook_engine_kv_cache_usage_ratio {exposition.kv}\n"
                    f"brook_engine_num_requests_waiting {exposition.waiting}\n"
                    "brook_engine_comm_compute_overlap_ratio 1.0\n"
                )
                if exposition.prompt_tokens is not None:
                    text += (
                        f"brook_engine_prompt_tokens_total {exposition.prompt_tokens}\n"
                        f"brook_engine_generation_tokens_total {exposition.generation_tokens}\n"
                    )
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer((ADDRESS, self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exposition() -> Iterator[Exposition]:
    served = Exposition()
    yield served
    served.close()


def _llmi(mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "brook.dev/v1alpha1",
        "kind": "LLMInference",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "file:///models/tiny"},
            "accelerator": {"type": "cpu", "devicesPerNode": 1},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "mode": mode},
        },
    }


REPLICA_SET = replica_owner("ReplicaSet", f"{NAME}-5d8f7", "00000000-0000-4000-8000-000000000002")


def _add_pod(
    api: KubeApi, name: str, port: int, owned: bool = True, host_network: bool = False
) -> None:
    template = api.get("deployments", NAME, NAMESPACE)["spec"]["template"]
    owner = REPLICA_SET if owned else None
    add_ready_pod(
        api, NAMESPACE, name, template, ADDRESS, port, owner=owner, host_network=host_network
    )


def _body(api: KubeApi) -> dict[str, Any]:
    body = api.get("llmi", NAME, NAMESPACE)
    assert body is not None
    return body


def _replicas(api: KubeApi) -> int:
    return int(api.get("deployments", NAME, NAMESPACE)["spec"]["replicas"])


def test_dry_run_then_active_then_a_restart_keeps_the_window(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    api = kube_api
    api.create_namespace(NAMESPACE)
    api.create(_llmi("DryRun"))
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    assert _replicas(api) == 1
    _add_pod(api, "canned-a", exposition.port)
    # Pods with the labels that the workload did not make, or on the host network, are not
    # replicas: neither scraped nor counted.
    _add_pod(api, "lookalike", exposition.port, owned=False)
    _add_pod(api, "host-net", exposition.port, host_network=True)

    # DryRun: 0.95 KV on one replica → ceil(0.95 / 0.75) = 2, recorded, not applied.
    exposition.kv = 0.95
    decision = Autoscaler(reconciler).run_once(_body(api))
    assert decision is not None and decision.desired == 2
    assert decision.aggregate.replicas_reporting == 1  # not the look-alikes
    status = _body(api)["status"]
    assert status["autoscaling"]["signals"]["sampleTime"].endswith("Z")
    assert _replicas(api) == 1
    assert status["desiredReplicas"] == 1
    assert status["autoscaling"]["lastDecisions"][-1]["reason"].startswith("dry run: 1 → 2")
    scaling = {c["type"]: c for c in status["conditions"]}["ScalingActive"]
    assert (scaling["status"], scaling["reason"]) == ("False", "DryRun")

    # Active: applied to the Deployment through the reconciler; the user's spec untouched.
    body = _body(api)
    body["spec"]["autoscaling"]["mode"] = "Active"
    api.apply(body, manager="test")
    autoscaler = Autoscaler(reconciler)
    decision = autoscaler.run_once(_body(api))
    assert decision is not None and decision.desired == 2
    assert _replicas(api) == 2
    assert _body(api)["status"]["desiredReplicas"] == 2
    assert "replicas" not in _body(api)["spec"]
    assert [e["reason"] for e in api.list("events", NAMESPACE)].count("ScaledOut") == 1

    # Idle now. A restarted operator (a new Autoscaler, no history) must not scale in before
    # a whole scale-down window has passed since it started.
    _add_pod(api, "canned-b", exposition.port)
    exposition.kv = 0.0
    restarted = Autoscaler(reconciler, clock=lambda: 1_000.0)
    decision = restarted.run_once(_body(api))
    assert decision is not None and (decision.desired, decision.limited_by) == (2, "Cooldown")
    assert _replicas(api) == 2
    later = Autoscaler(reconciler, clock=lambda: 1_301.0, memory=restarted.memory)
    decision = later.run_once(_body(api))
    assert decision is not None and decision.desired == 1, decision
    assert _replicas(api) == 1
    # Both replicas idle and equal: each got a deletion cost before the scale-in; the
    # look-alikes none.
    costs = {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(
            "controller.kubernetes.io/pod-deletion-cost"
        )
        for p in api.list("pods", NAMESPACE)
    }
    assert costs == {"canned-a": "0", "canned-b": "0", "lookalike": None, "host-net": None}


def _two_replicas(api: KubeApi, port: int) -> Reconciler:
    """An Active resource at 2 replicas with windows of 0 and two Ready pods."""
    api.create_namespace(NAMESPACE)
    manifest = _llmi("Active")
    manifest["spec"]["autoscaling"].update(
        {"scaleDownStabilizationSeconds": 0, "startupGraceSeconds": 0}
    )
    api.create(manifest)
    reconciler = Reconciler(KubeClient.from_environment())
    api.set_status("llmi", NAME, {"desiredReplicas": 2}, NAMESPACE)
    reconciler.reconcile(_body(api))
    assert _replicas(api) == 2
    _add_pod(api, "canned-a", port)
    _add_pod(api, "canned-b", port)
    return reconciler


def test_a_refused_deletion_cost_does_not_stop_the_scale_in(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    api = kube_api
    reconciler = _two_replicas(api, exposition.port)
    api.handler[kmock.method.PATCH, kmock.resource("", "v1", "pods")] << 403
    decision = Autoscaler(reconciler, clock=lambda: 1_000.0).run_once(_body(api))
    assert decision is not None and decision.desired == 1, decision
    assert _replicas(api) == 1
    assert [e["reason"] for e in api.list("events", NAMESPACE)].count("ScaledIn") == 1


def test_a_failed_resize_posts_no_scaled_event(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    api = kube_api
    reconciler = _two_replicas(api, exposition.port)
    exposition.kv = 1.0
    api.handler[kmock.method.PATCH, kmock.resource("apps", "v1", "deployments")] << 500
    decision = Autoscaler(reconciler).run_once(_body(api))
    assert decision is not None and decision.desired == 3, decision
    assert _replicas(api) == 2
    assert "ScaledOut" not in [e["reason"] for e in api.list("events", NAMESPACE)]
    # The API recovers: the next round resizes (the count is read from the workload).
    api.clear_reactions()
    decision = Autoscaler(reconciler).run_once(_body(api))
    assert decision is not None and decision.desired == 3
    assert _replicas(api) == 3


def test_a_multi_pod_replica_is_read_at_its_leader(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    """PP=2 over one-device nodes: two pods per replica, a LeaderWorkerSet. Only the leader
    runs the scheduler and serves the group's metrics; a worker is neither scraped nor
    counted as a replica."""
    api = kube_api
    api.create_namespace(NAMESPACE)
    api.create(leaderworkerset_crd())
    manifest = _llmi("Active")
    manifest["spec"]["parallel"] = {"pipeline": 2}
    api.create(manifest)
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    lws = api.get("leaderworkersets", NAME, NAMESPACE)
    assert lws is not None and lws["spec"]["replicas"] == 1
    group = lws["spec"]["leaderWorkerTemplate"]
    owner = replica_owner("StatefulSet", NAME, "00000000-0000-4000-8000-000000000003")
    for name, template in (("g0", group["leaderTemplate"]), ("g0-1", group["workerTemplate"])):
        add_ready_pod(api, NAMESPACE, name, template, ADDRESS, exposition.port, owner=owner)

    exposition.kv = 0.95
    decision = Autoscaler(reconciler).run_once(_body(api))
    assert decision is not None
    assert (decision.aggregate.ready, decision.aggregate.replicas_reporting) == (1, 1)
    assert decision.desired == 2  # ceil(0.95 / 0.75): one group, read once
    assert api.get("leaderworkersets", NAME, NAMESPACE)["spec"]["replicas"] == 2


def test_arrival_rates_across_rounds_learn_a_capacity_and_see_a_surge_at_once(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    """The loop keeps each pod's counters between rounds: at the target KV usage it learns
    what a replica serves, a fourfold step in arriving tokens scales out at the first round
    that reads it (KV usage has not moved), and an engine restart (counters back near 0)
    reads as the tokens counted since, not as a negative rate."""
    api = kube_api
    api.create_namespace(NAMESPACE)
    api.create(_llmi("Active"))
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    _add_pod(api, "canned-a", exposition.port)
    exposition.kv = 0.75  # at the default target
    exposition.prompt_tokens, exposition.generation_tokens = 0, 0
    memory: dict[Any, Any] = {}
    now = 1_000.0

    def round_(prompt: int, generated: int) -> Any:
        nonlocal now
        now += 15.0
        exposition.prompt_tokens += prompt
        exposition.generation_tokens += generated
        return Autoscaler(reconciler, clock=lambda: now, memory=memory).run_once(_body(api))

    # 15 s × (200 + 100) tokens/s, steady: a rate from the second round on, a capacity
    # of 300 tok/s once four readings agree.
    decisions = [round_(3_000, 1_500) for _ in range(6)]
    assert decisions[0].aggregate.demand_tokens_per_second is None
    assert decisions[1].aggregate.demand_tokens_per_second == 300.0
    assert decisions[-1].capacity_tokens_per_second == 300.0
    assert all(d.desired == 1 for d in decisions), [d.reason for d in decisions]

    surge = round_(12_000, 1_500)  # prompts arrive four times as fast; KV still 0.75
    assert surge.aggregate.demand_tokens_per_second == 900.0
    assert (surge.desired, surge.signal_recommendations["arrival"]) == (3, 3), surge.reason
    assert "arrivals 900 tok/s" in surge.reason
    assert _replicas(api) == 3
    signals = _body(api)["status"]["autoscaling"]["signals"]
    assert (signals["demandTokensPerSecond"], signals["replicaTokensPerSecond"]) == (900, 300)

    # The engine restarts: its counters begin again, the rate is what they counted since.
    exposition.prompt_tokens, exposition.generation_tokens = 0, 0
    restarted = round_(1_500, 0)
    assert restarted.aggregate.demand_tokens_per_second == 100.0

    # A spec change (here a target; a model or resources change alike) may change what a
    # replica serves: the capacity is learned again.
    body = _body(api)
    body["spec"]["autoscaling"]["targetWaitingRequests"] = 4
    api.apply(body, manager="test")
    assert round_(1_500, 0).capacity_tokens_per_second is None


def test_the_demand_history_is_kept_in_a_configmap_and_forecasts_the_surge(
    kube_api: KubeApi, brook_crd: dict[str, Any], exposition: Exposition
) -> None:
    """With autoscaling.history (a one-hour period here, so an hour stands for a day) the
    loop records the fleet's demand per 5-minute slot, keeps it in a ConfigMap the resource
    owns, and a lead before the time of yesterday's surge sizes for it — the arriving
    tokens are quiet then. A restarted operator reads the ConfigMap and forecasts the same."""
    api = kube_api
    api.create_namespace(NAMESPACE)
    manifest = _llmi("DryRun")  # decisions only: the count stays 1 and the numbers stay simple
    manifest["spec"]["autoscaling"].update(
        {
            "replicaTokensPerSecond": 100,
            "history": {"leadSeconds": 600, "periodSeconds": 3600, "periods": 2},
        }
    )
    api.create(manifest)
    reconciler = Reconciler(KubeClient.from_environment())
    reconciler.reconcile(_body(api))
    _add_pod(api, "canned-a", exposition.port)
    exposition.kv = 0.75
    exposition.prompt_tokens = 0
    memory: dict[Any, Any] = {}
    start = 100 * 3600.0  # an hour boundary
    last = -300.0

    def round_at(t: float, tokens_per_second: float, keep: dict[Any, Any]) -> Any:
        """A round at ``t`` after ``tokens_per_second`` since the previous one."""
        nonlocal last
        assert exposition.prompt_tokens is not None
        exposition.prompt_tokens += int(tokens_per_second * (t - last))
        last = t
        return Autoscaler(reconciler, clock=lambda: start + t, memory=keep).run_once(_body(api))

    # Hour 0: 100 tok/s, and 400 tok/s over the 5 minutes read at minute 35 (the surge).
    first = [round_at(t, 400 if t == 2100 else 100, memory) for t in range(0, 3600, 300)]
    assert first[0].forecast_tokens_per_second is None  # no earlier hour yet
    stored = api.get("configmaps", "canned-demand-history", NAMESPACE)
    assert stored is not None and "demand.json" in stored["data"]
    owner = stored["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("LLMInference", NAME)

    # Hour 1, ten minutes before the time of the surge: quiet now, sized for what comes.
    quiet = round_at(3600 + 2100 - 600, 100, memory)
    assert quiet.aggregate.demand_tokens_per_second == 100.0
    assert quiet.forecast_tokens_per_second == 400.0
    assert (quiet.signal_recommendations["history"], quiet.desired) == (4, 4), quiet.reason
    assert "earlier days: 400 tok/s ahead" in quiet.reason
    assert _body(api)["status"]["autoscaling"]["signals"]["forecastTokensPerSecond"] == 400
    # A restarted operator goes on from the ConfigMap; one that cannot read it yet waits
    # (starting afresh would overwrite the kept days).
    kept = api.get("configmaps", "canned-demand-history", NAMESPACE)["data"]
    api.handler[kmock.method.GET, kmock.resource("", "v1", "configmaps")] << 500
    fresh: dict[Any, Any] = {}
    assert round_at(3600 + 2100 - 450, 100, fresh).forecast_tokens_per_second is None
    api.clear_reactions()
    assert api.get("configmaps", "canned-demand-history", NAMESPACE)["data"] == kept
    restarted = round_at(3600 + 2100 - 300, 100, fresh)
    assert restarted.forecast_tokens_per_second == 400.0
    # Once yesterday's surge is behind the lead, the forecast is the quiet hour's.
    assert round_at(3600 + 2400, 100, memory).forecast_tokens_per_second == 100.0
