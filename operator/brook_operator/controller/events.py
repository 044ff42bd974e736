"""Kubernetes Events on an ``LLMInference`` when one of its conditions changes, so that
``kubectl describe`` and event-based alerting show what happened."""

from __future__ import annotations

import logging
from typing import Any

from brook_operator.controller.conditions import conditions_by_type, rfc3339
from brook_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

COMPONENT = "brook-operator"
#: Conditions that are bad when True (the others are bad when False).
_BAD_WHEN_TRUE = {"Degraded"}


def transitions(before: dict[str, Any] | None, after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type Normal|Warning, reason, message) for each condition whose status changed; a
    condition seen for the first time counts as a change unless it is merely Progressing."""
    old = conditions_by_type(before)
    out = []
    for kind, condition in conditions_by_type(after).items():
        previous = old.get(kind)
        if previous is not None and previous.get("status") == condition["status"]:
            continue
        if previous is None and kind == "Progressing":
            continue
        good = (condition["status"] == "True") != (kind in _BAD_WHEN_TRUE)
        out.append(
            (
                "Normal" if good else "Warning",
                condition.get("reason") or kind,
                f"{kind}={condition['status']}: {condition.get('message', '')}",
            )
        )
    return out


def post_event(
    kube: KubeClient, body: dict[str, Any], type_: str, reason: str, message: str
) -> None:
    """Post one Event on ``body``. Best effort: a failure is logged, never raised."""
    metadata = body.get("metadata") or {}
    namespace = metadata.get("namespace") or "default"
    now = rfc3339()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{metadata.get('name')}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "name": metadata.get("name"),
            "namespace": namespace,
            "uid": metadata.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(event)
    except KubeError as exc:
        log.warning("could not post event %s on %s: %s", reason, metadata.get("name"), exc)


def post_transitions(
    kube: KubeClient, body: dict[str, Any], before: dict[str, Any] | None, after: dict[str, Any]
) -> None:
    """Post an Event per changed condition (best effort)."""
    for type_, reason, message in transitions(before, after):
        post_event(kube, body, type_, reason, message)
