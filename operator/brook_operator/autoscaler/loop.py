"""One autoscaling round for one ``LLMInference``: read its leader pods, scrape the ready
ones, ``decide``, write status, and — in Active mode — resize the child workload through the
reconciler (server-side apply of the whole child, so the operator owns its replica count and
never touches the user's spec).

Its status is its own: server-side apply as field manager ``AUTOSCALER_MANAGER`` of the
signals, the decisions, ``desiredReplicas`` and its three conditions, so that neither the
reconciler nor a later round working from an older snapshot can undo the other's writes.

A replica group is read at its leader pod: it runs the scheduler and serves /metrics for the
whole group (for single-pod replicas every pod is a leader). Before a Deployment scales in,
each leader gets a ``controller.kubernetes.io/pod-deletion-cost`` proportional to the KV
state it holds, so the ReplicaSet removes the one holding the least; the removed pod drains
(SIGTERM: no new requests, in-flight ones finish). A LeaderWorkerSet always removes its
highest-index group (it has no deletion-cost rule); that group drains the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from brook_operator.api import API_VERSION, KIND, LLMInference
from brook_operator.api.autoscaling import AutoscalingSpec
from brook_operator.autoscaler.capacity import CapacityEstimate
from brook_operator.autoscaler.history import (
    SLOT_SECONDS,
    DemandHistory,
    HistoryError,
    observed_demand,
)
from brook_operator.autoscaler.policy import (
    SIGNALS,
    Decision,
    Policy,
    Recommendation,
    ReplicaSignals,
    decide,
)
from brook_operator.autoscaler.rates import demand_rate
from brook_operator.autoscaler.scrape import EngineSample, Scraper, scrape, scrape_all
from brook_operator.autoscaler.status_patch import autoscaling_status
from brook_operator.controller.conditions import now_rfc3339, rfc3339
from brook_operator.controller.events import post_event, post_transitions
from brook_operator.controller.reconcile import Reconciler, parse
from brook_operator.kube import AUTOSCALER_MANAGER, KubeClient, KubeError
from brook_operator.render import ROLE_LABEL, selector_labels
from brook_operator.render.children import with_owner
from brook_operator.render.pod import http_port

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

Key = tuple[str | None, str]


def _timestamp(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


#: Controllers whose pods are replicas: a Deployment's ReplicaSet, a LeaderWorkerSet's
#: StatefulSet.
_REPLICA_OWNERS = {"ReplicaSet", "StatefulSet"}


def _replica_pod(pod: dict[str, Any]) -> bool:
    """A pod the workload made, not terminating (a draining pod is neither capacity nor
    load), and not on the host network (its address would be the node's). A pod someone
    else made with the same labels is not a replica and is not scraped."""
    metadata = pod.get("metadata") or {}
    if metadata.get("deletionTimestamp") or (pod.get("spec") or {}).get("hostNetwork"):
        return False
    return any(
        ref.get("controller") and ref.get("kind") in _REPLICA_OWNERS
        for ref in metadata.get("ownerReferences") or []
    )


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def metrics_url(pod: dict[str, Any]) -> str | None:
    """http://POD_IP:PORT/metrics, PORT being the engine container's port named ``http``."""
    ip = (pod.get("status") or {}).get("podIP")
    port = http_port(pod)
    if not ip or port is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


@dataclass
class _Memory:
    """What the autoscaler remembers of one resource between rounds."""

    history: list[Recommendation]
    samples: dict[str, tuple[EngineSample, float]] = field(default_factory=dict)
    """Last good sample of each pod, with its time (used until it goes stale)."""

    rates: dict[str, float | None] = field(default_factory=dict)
    """Each pod's demand (tokens/s) between its last two good samples."""

    capacity: CapacityEstimate = field(default_factory=CapacityEstimate)
    """Tokens/s one replica serves at the target, learned from the readings."""

    capacity_generation: int | None = None
    """The spec generation the capacity was learned under: any spec change (model,
    resources, parallelism, targets) may change it, so it is learned again."""

    demand: DemandHistory | None = None
    """The fleet's demand over earlier days (``spec.autoscaling.history``), as kept in its
    ConfigMap; None until read, or without the predictive term."""

    saved_slot: int | None = None
    """The history slot last written to the ConfigMap (it is written once a slot)."""


@dataclass
class Autoscaler:
    reconciler: Reconciler
    scraper: Scraper = scrape
    clock: Callable[[], float] = time.time
    memory: dict[Key, _Memory] = field(default_factory=dict)

    @property
    def kube(self) -> KubeClient:
        return self.reconciler.kube

    def forget(self, key: Key) -> None:
        self.memory.pop(key, None)

    def run_once(self, body: dict[str, Any]) -> Decision | None:
        """One round; None when the resource is not autoscaled (or cannot run)."""
        metadata = body.get("metadata") or {}
        key: Key = (metadata.get("namespace"), str(metadata.get("name")))
        try:
            llmi = parse(body)
        except ValidationError:
            self.forget(key)
            return None
        spec = llmi.spec.autoscaling
        if spec is None or llmi.spec.suspend or self.reconciler.plan_refusal(llmi) is not None:
            self.forget(key)  # a plan that cannot run is SpecValid=False: nothing to size
            return None
        workload = self.reconciler.read_workload(llmi)
        if workload is None:  # the reconciler has not created it yet
            return None
        current = int((workload.get("spec") or {}).get("replicas") or 0)
        now = self.clock()
        # After a restart the windows start now: no scale-in until a full window has passed.
        memory = self.memory.setdefault(key, _Memory([Recommendation(now, current)]))
        pods = self._leader_pods(llmi)
        signals = self._signals(pods, memory, now)
        policy = policy_for(llmi, spec)
        if memory.capacity_generation != llmi.metadata.generation:
            memory.capacity = CapacityEstimate()
            memory.capacity_generation = llmi.metadata.generation
        forecast = self._forecast(llmi, memory, now)
        decision = decide(
            signals, current, policy, memory.history, now, memory.capacity.value, forecast
        )
        memory.capacity.observe(signals, policy)
        self._remember_demand(llmi, memory, observed_demand(signals, policy), now)
        memory.history.append(decision.recommendation_at(now))
        memory.history = [h for h in memory.history if now - h.time <= policy.longest_window]

        dry_run = spec.mode == "DryRun"
        before = dict(body.get("status") or {})
        used = [t for _, t in memory.samples.values()]
        sample_time = rfc3339(min(used)) if used and decision.metrics_available else None
        status = autoscaling_status(
            before,
            decision,
            current,
            now_rfc3339(),
            llmi.metadata.generation,
            dry_run,
            sample_time=sample_time,
        )
        apply = not dry_run and decision.desired != current
        if apply and decision.desired < current and workload.get("kind") == "Deployment":
            self._mark_deletion_costs(llmi, pods, memory)
        self.kube.apply_status(API_VERSION, KIND, key[0], key[1], status, AUTOSCALER_MANAGER)
        after = {**before, **status}
        if apply:
            # Resize from the resource as it is now: a spec edited while this round scraped
            # must not be rolled back by applying the children of the old one.
            fresh = self.kube.get(API_VERSION, KIND, key[0], key[1])
            generation = (fresh or {}).get("metadata", {}).get("generation")
            if fresh is None or generation != llmi.metadata.generation:
                log.info("%s/%s changed during the round; resizing next round", *key)
                return decision
            result = self.reconciler.reconcile(fresh, autoscaled=decision.desired)
            if result.error is not None or result.problem is not None:
                why = result.error or result.problem
                log.warning("%s/%s: resize failed: %s", key[0], key[1], why)
            else:
                verb = "ScaledOut" if decision.desired > current else "ScaledIn"
                log.info("%s/%s: %s", key[0], key[1], decision.reason)
                post_event(self.kube, body, "Normal", verb, decision.reason)
        post_transitions(self.kube, body, before, after)
        return decision

    # -- steps ---------------------------------------------------------------------------

    def _leader_pods(self, llmi: LLMInference) -> list[dict[str, Any]]:
        labels = {**selector_labels(llmi), ROLE_LABEL: "leader"}
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = self.kube.list("v1", "Pod", llmi.metadata.namespace, selector)
        return [p for p in pods if _replica_pod(p)]

    def _signals(
        self, pods: list[dict[str, Any]], memory: _Memory, now: float
    ) -> list[ReplicaSignals]:
        urls: dict[str, str] = {}
        for pod in pods:
            url = metrics_url(pod)
            if _ready(pod) and url:
                urls[pod["metadata"]["name"]] = url
        results = scrape_all(list(urls.values()), self.scraper)
        alive = {p["metadata"]["name"] for p in pods}
        memory.samples = {k: v for k, v in memory.samples.items() if k in alive}
        memory.rates = {k: v for k, v in memory.rates.items() if k in alive}
        signals = []
        for pod in pods:
            name = pod["metadata"]["name"]
            result = results.get(urls[name]) if name in urls else None
            if isinstance(result, EngineSample):
                before = memory.samples.get(name)
                memory.rates[name] = (
                    demand_rate((before[0].demand, before[1]), (result.demand, now))
                    if before and before[0].demand and result.demand
                    else None
                )
                memory.samples[name] = (result, now)
            elif result is not None:
                log.debug("scrape of %s failed: %s", name, result)
            kept = memory.samples.get(name)
            created = _timestamp((pod.get("metadata") or {}).get("creationTimestamp"))
            signals.append(
                ReplicaSignals(
                    name=name,
                    ready=_ready(pod),
                    age_seconds=now - created if created is not None else 0.0,
                    kv_cache_usage=kept[0].kv_cache_usage if kept else None,
                    waiting_requests=kept[0].waiting_requests if kept else None,
                    running_requests=kept[0].running_requests if kept else None,
                    overlap_ratio=kept[0].overlap_ratio if kept else None,
                    sample_age_seconds=now - kept[1] if kept else None,
                    demand_tokens_per_second=memory.rates.get(name) if kept else None,
                )
            )
        return signals

    def _forecast(self, llmi: LLMInference, memory: _Memory, now: float) -> float | None:
        """The demand earlier days saw within the lead ahead, with the history read from its
        ConfigMap the first time (after an operator restart it goes on from there)."""
        spec = llmi.spec.autoscaling
        ahead = spec.history if spec else None
        if ahead is None:
            memory.demand = None
            return None
        if memory.demand is None or (
            memory.demand.period_seconds,
            memory.demand.periods,
        ) != (ahead.period_seconds, ahead.periods):
            memory.demand = self._read_history(llmi, ahead.period_seconds, ahead.periods)
        return memory.demand.forecast(now, ahead.lead_seconds) if memory.demand else None

    def _read_history(
        self, llmi: LLMInference, period: float, periods: int
    ) -> DemandHistory | None:
        """The kept history; a fresh one when none is kept or it cannot be used; None when
        the API did not answer (read again next round: starting afresh would overwrite
        the kept days)."""
        name = history_config_map(llmi.metadata.name)
        try:
            found = self.kube.get("v1", "ConfigMap", llmi.metadata.namespace, name)
        except KubeError as exc:
            log.warning("could not read %s: %s", name, exc)
            return None
        try:
            return DemandHistory.from_data((found or {}).get("data"), period, periods)
        except HistoryError as exc:
            log.warning("%s: starting the demand history afresh: %s", name, exc)
            return DemandHistory(period, periods)

    def _remember_demand(
        self, llmi: LLMInference, memory: _Memory, demand: float | None, now: float
    ) -> None:
        """Record the fleet's demand; once a slot, write the history to its ConfigMap,
        owned by the resource (deleted with it)."""
        if memory.demand is None:
            return
        if demand is not None:
            memory.demand.record(now, demand)
        slot = int(now // SLOT_SECONDS)
        if memory.saved_slot == slot:
            return
        config_map = with_owner(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": history_config_map(llmi.metadata.name),
                    "namespace": llmi.metadata.namespace,
                    "labels": selector_labels(llmi),
                },
                "data": memory.demand.to_data(),
            },
            llmi,
        )
        memory.saved_slot = slot  # one try a slot: a refused write is not resent every round
        try:
            self.kube.apply(config_map, manager=AUTOSCALER_MANAGER)
        except KubeError as exc:  # kept in memory; written again next slot
            log.warning("could not write %s: %s", config_map["metadata"]["name"], exc)

    def _mark_deletion_costs(
        self, llmi: LLMInference, pods: list[dict[str, Any]], memory: _Memory
    ) -> None:
        """Lower cost = removed first: the pod holding the least KV state (then the fewest
        running and waiting requests)."""
        for pod in pods:
            name = pod["metadata"]["name"]
            kept = memory.samples.get(name)
            if kept is None:
                continue  # unready pods are removed before ready ones anyway
            sample = kept[0]
            cost = (
                round(sample.kv_cache_usage * 1_000_000)
                + round((sample.running_requests or 0.0) * 1_000)
                + round(sample.waiting_requests)
            )
            annotations = (pod.get("metadata") or {}).get("annotations") or {}
            if annotations.get(DELETION_COST) == str(cost):
                continue
            try:
                self.kube.annotate(
                    "v1", "Pod", llmi.metadata.namespace, name, {DELETION_COST: str(cost)}
                )
            except KubeError as exc:  # best effort: the scale-in goes ahead regardless
                log.warning("could not set the deletion cost of pod %s: %s", name, exc)


def history_config_map(name: str) -> str:
    """The ConfigMap that keeps a resource's demand history."""
    return f"{name}-demand-history"


def policy_for(llmi: LLMInference, spec: AutoscalingSpec) -> Policy:
    """The policy for ``llmi``. The overlap rule consolidates under-fed *pipelines*; a
    replica without a pipeline has no micro-batches to feed, and its ratio measures
    tensor-parallel all-reduces, exposed by construction unless interleaved — it says
    nothing about how full the replica is. Such replicas scale on KV usage and the queue."""
    signals = SIGNALS if llmi.spec.parallel.pipeline > 1 else SIGNALS - {"overlap"}
    return Policy.from_spec(spec, signals, max_num_seqs=llmi.spec.scheduler.max_num_seqs)


def interval_seconds(body: dict[str, Any]) -> float | None:
    """The resource's decision interval, or None when it is not autoscaled."""
    spec = body.get("spec") or {}
    autoscaling = spec.get("autoscaling")
    if not isinstance(autoscaling, dict) or spec.get("suspend"):
        return None
    default = AutoscalingSpec.model_fields["interval_seconds"].default
    try:
        return float(autoscaling.get("intervalSeconds", default))
    except (TypeError, ValueError):
        return None


__all__ = ["Autoscaler", "interval_seconds", "metrics_url"]
