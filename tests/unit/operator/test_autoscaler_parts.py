"""The autoscaler's parts around the policy: reading an engine's exposition, the pod's
metrics address, and the status it writes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.metrics.stats import EngineStats
from brook_operator.autoscaler.loop import interval_seconds, metrics_url
from brook_operator.autoscaler.policy import decide
from brook_operator.autoscaler.scrape import parse_metrics
from brook_operator.autoscaler.status_patch import KEPT_DECISIONS, autoscaling_status
from brook_operator.pod_http import PodReadError

from .test_autoscaler_policy import BASE, NOW, fleet, past


def _exposition(kv: float, waiting: int, overlap: float) -> str:
    """The text a real engine serves, from the engine's own metrics code."""
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, {"model": "tiny"})
    metrics.record(
        EngineStats(
            num_running=3,
            num_waiting=waiting,
            kv_cache_usage=kv,
            num_kv_blocks=64,
            num_prompt_tokens_total=10,
            num_generation_tokens_total=20,
            num_preemptions_total=0,
            comm_compute_overlap=overlap,
        )
    )
    return generate_latest(registry).decode()


def test_parse_reads_the_engines_own_exposition() -> None:
    sample = parse_metrics(_exposition(0.625, 7, 0.83))
    assert sample.running_requests == 3.0
    assert (sample.kv_cache_usage, sample.waiting_requests, sample.overlap_ratio) == (
        0.625,
        7.0,
        0.83,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lack brook_engine_kv_cache_usage_ratio"),
        ("# a node exporter\nnode_load1 0.5\n", "is this a Brook engine"),
        ("brook_engine_kv_cache_usage_ratio 0.5\n", "brook_engine_num_requests_waiting"),
        (
            "brook_engine_kv_cache_usage_ratio 1.5\nbrook_engine_num_requests_waiting 0\n",
            "out of range",
        ),
        ("brook_engine_kv_cache_usage_ratio {{{\n", "unparsable"),
    ],
)
def test_parse_refuses_what_is_not_an_engine(text: str, message: str) -> None:
    with pytest.raises(PodReadError, match=message):
        parse_metrics(text)


def test_overlap_is_optional() -> None:
    text = "brook_engine_kv_cache_usage_ratio 0.5\nbrook_engine_num_requests_waiting 2\n"
    assert parse_metrics(text).overlap_ratio is None


def _pod(ip: str | None, ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {"status": {"podIP": ip}, "spec": {"containers": [{"name": "e", "ports": ports}]}}


def test_metrics_url_uses_the_http_port() -> None:
    http = [{"name": "rendezvous", "containerPort": 29500}, {"name": "http", "containerPort": 8080}]
    assert metrics_url(_pod("10.1.2.3", http)) == "http://10.1.2.3:8080/metrics"
    assert metrics_url(_pod("fd00::5", http)) == "http://[fd00::5]:8080/metrics"
    assert metrics_url(_pod(None, http)) is None
    assert metrics_url(_pod("10.1.2.3", [{"name": "grpc", "containerPort": 9000}])) is None


def test_interval_only_for_autoscaled_running_resources() -> None:
    assert interval_seconds({"spec": {"autoscaling": {"intervalSeconds": 7}}}) == 7.0
    assert interval_seconds({"spec": {"autoscaling": {"maxReplicas": 3}}}) == 15.0
    assert interval_seconds({"spec": {"replicas": 2}}) is None
    assert interval_seconds({"spec": {"autoscaling": {}, "suspend": True}}) is None


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_records_changes_keeps_ten_and_sets_conditions() -> None:
    policy = replace(BASE, max_replicas=3)
    previous: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True", "reason": "ReplicasReady"}]
    }
    for i in range(12):  # alternate so that every decision is a new one
        current = 2 + i % 2
        decision = decide(fleet(current, kv=0.95), current, policy, [], 0.0)
        status = autoscaling_status(previous, decision, current, f"t{i}", 1, dry_run=False)
        # Its own three conditions only: a condition of another writer, carried over from
        # this snapshot, would undo that writer's newer changes when applied.
        assert [c["type"] for c in status["conditions"]] == [
            "MetricsAvailable",
            "ScalingActive",
            "ScalingLimited",
        ]
        previous = {**previous, **status}
    decisions = previous["autoscaling"]["lastDecisions"]
    assert len(decisions) == KEPT_DECISIONS
    assert decisions[-1]["time"] == "t11"
    conditions = _conditions(previous)
    assert conditions["MetricsAvailable"]["status"] == "True"
    assert conditions["ScalingActive"]["status"] == "True"
    # At 3 (= max) under load: limited AtMax; desiredReplicas follows the decision.
    assert conditions["ScalingLimited"]["reason"] == "AtMax"
    assert previous["desiredReplicas"] == 3

    # The same hold again is not a new entry.
    decision = decide(fleet(3, kv=0.95), 3, policy, [], 0.0)
    again = autoscaling_status(previous, decision, 3, "t12", 1, dry_run=False)
    assert again["autoscaling"]["lastDecisions"] == decisions


def test_dry_run_records_without_changing_desired_replicas() -> None:
    decision = decide(fleet(2, kv=0.95), 2, BASE, [], 0.0)
    assert decision.desired == 3
    status = autoscaling_status({}, decision, 2, "t0", 1, dry_run=True)
    assert status["desiredReplicas"] == 2
    assert status["autoscaling"]["lastDecisions"][0]["reason"].startswith("dry run: ")
    assert _conditions(status)["ScalingActive"]["reason"] == "DryRun"


def test_stale_status() -> None:
    decision = decide(fleet(2, kv=0.1, sample_age=300.0), 2, BASE, [], 0.0)
    status = autoscaling_status({}, decision, 2, "t0", 1, dry_run=False)
    conditions = _conditions(status)
    assert conditions["MetricsAvailable"]["status"] == "False"
    assert conditions["ScalingLimited"]["reason"] == "Stale"
    assert status["desiredReplicas"] == 2
    assert status["autoscaling"]["signals"]["replicasReporting"] == 0


def test_overlap_rule_applies_to_pipelined_replicas_only() -> None:
    """A replica without a pipeline reports the overlap of its tensor-parallel all-reduces,
    which says nothing about how full it is: its policy leaves the overlap signal out."""
    from pathlib import Path

    import yaml

    from brook_operator.api import LLMInference
    from brook_operator.autoscaler.loop import policy_for

    root = Path(__file__).resolve().parents[3]
    manifest = yaml.safe_load((root / "crds/examples/qwen-7b-autoscaled.yaml").read_text())
    manifest["spec"]["parallel"] = {"tensor": 2, "pipeline": 1}
    tensor_only = LLMInference.model_validate(manifest)
    manifest["spec"]["parallel"] = {"tensor": 2, "pipeline": 2}
    pipelined = LLMInference.model_validate(manifest)
    assert tensor_only.spec.autoscaling is not None and pipelined.spec.autoscaling is not None
    assert "overlap" not in policy_for(tensor_only, tensor_only.spec.autoscaling).signals
    assert "overlap" in policy_for(pipelined, pipelined.spec.autoscaling).signals
    # Low overlap at KV 0.55 (the policy table's "under-fed replicas consolidate" case):
    # only the pipelined replicas are packed.
    quiet = fleet(4, kv=0.55, overlap=0.5)
    history = past((400, 4))
    kept = decide(quiet, 4, policy_for(tensor_only, tensor_only.spec.autoscaling), history, NOW)
    packed = decide(quiet, 4, policy_for(pipelined, pipelined.spec.autoscaling), history, NOW)
    assert kept.desired == 4
    assert packed.desired == 3 and "under-fed" in packed.reason


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
@pytest.mark.parametrize(
    "metric",
    [
        "brook_engine_kv_cache_usage_ratio",
        "brook_engine_num_requests_waiting",
        "brook_engine_num_requests_running",
        "brook_engine_comm_compute_overlap_ratio",
    ],
)
def test_parse_refuses_non_finite_values(metric: str, value: str) -> None:
    """NaN and ±Inf are valid exposition values and slip past range checks (NaN < 0 is
    False): a pod reporting one has no usable sample, as when its scrape fails."""
    lines = {
        "brook_engine_kv_cache_usage_ratio": "0.5",
        "brook_engine_num_requests_waiting": "1",
        "brook_engine_num_requests_running": "2",
        "brook_engine_comm_compute_overlap_ratio": "0.9",
    }
    lines[metric] = value
    text = "".join(f"{name} {number}\n" for name, number in lines.items())
    with pytest.raises(PodReadError, match="not finite"):
        parse_metrics(text)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_signal_is_stale_not_an_error(bad: float) -> None:
    """Signals that reach ``decide`` with a non-finite value (another scraper, a replay)
    make that replica's sample stale: the round holds instead of raising every time."""
    for signals in (
        fleet(2, kv=bad),
        fleet(2, waiting=bad),
        fleet(2, overlap=bad),
        fleet(2, running=bad),
    ):
        decision = decide(signals, 2, BASE, [], NOW)
        assert decision.desired == 2
        assert not decision.metrics_available
        assert decision.limited_by == "Stale"
    # One bad replica among good ones: the good ones decide.
    mixed = fleet(1, kv=bad, prefix="bad") + fleet(2, kv=0.5)
    decision = decide(mixed, 3, BASE, [], NOW)
    assert decision.metrics_available
    assert decision.aggregate.replicas_reporting == 2
