"""The operator's own Prometheus metrics (``brook_operator_*``), on an injected registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from brook_operator.kube import KubeError

RECONCILES = "brook_operator_reconciles"
RECONCILE_ERRORS = "brook_operator_reconcile_errors"
RECONCILE_DURATION = "brook_operator_reconcile_duration_seconds"
MANAGED_OBJECTS = "brook_operator_managed_objects"
RESOURCES = "brook_operator_llminferences"
AUTOSCALER_DECISIONS = "brook_operator_autoscaler_decisions"


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.reconciles = Counter(
            RECONCILES,
            "Reconciliations of LLMInference resources, by result (applied, invalid, error).",
            ["result"],
            registry=registry,
        )
        self.errors = Counter(
            RECONCILE_ERRORS,
            "Kubernetes API errors met while reconciling, by HTTP status code.",
            ["code"],
            registry=registry,
        )
        self.duration = Histogram(
            RECONCILE_DURATION,
            "Time one reconciliation takes, API calls included.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.objects = Gauge(
            MANAGED_OBJECTS,
            "Child objects the operator manages, by kind.",
            ["kind"],
            registry=registry,
        )
        self.resources = Gauge(
            RESOURCES,
            "LLMInference resources the operator has reconciled, by SpecValid.",
            ["spec_valid"],
            registry=registry,
        )
        self.decisions = Counter(
            AUTOSCALER_DECISIONS,
            "Autoscaler rounds, by outcome (scale_out, scale_in, hold, stale, error).",
            ["outcome"],
            registry=registry,
        )
        self._children: dict[tuple[str | None, str], list[str]] = {}
        self._valid: dict[tuple[str | None, str], bool] = {}

    def api_error(self, exc: KubeError) -> None:
        """Count one Kubernetes API error, by its HTTP status code."""
        self.errors.labels(str(exc.status)).inc()

    def track(self, namespace: str | None, name: str, kinds: list[str] | None, valid: bool) -> None:
        """Remember what one resource holds now (``kinds`` None: unchanged)."""
        key = (namespace, name)
        if kinds is not None:
            self._children[key] = kinds
        self._valid[key] = valid
        self._publish()

    def forget(self, namespace: str | None, name: str) -> None:
        self._children.pop((namespace, name), None)
        self._valid.pop((namespace, name), None)
        self._publish()

    def _publish(self) -> None:
        counts: dict[str, int] = {}
        for kinds in self._children.values():
            for kind in kinds:
                counts[kind] = counts.get(kind, 0) + 1
        for kind in {*counts, *(labels[0] for labels in self._known_kinds())}:
            self.objects.labels(kind).set(counts.get(kind, 0))
        valid = sum(self._valid.values())
        self.resources.labels("true").set(valid)
        self.resources.labels("false").set(len(self._valid) - valid)

    def _known_kinds(self) -> list[tuple[str, ...]]:
        return [
            tuple(sample.labels.values())
            for metric in self.objects.collect()
            for sample in metric.samples
        ]
