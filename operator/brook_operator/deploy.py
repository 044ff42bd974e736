"""``brook deploy -f MANIFEST [--wait] [--timeout S] [--dry-run]``: validate offline, apply
with server-side apply under Brook's own field manager, and with ``--wait`` follow the
rollout as ``kubectl rollout status`` does — from the resource's status (replicas,
conditions) and its engine pods (the reasons they wait or fail: an image that cannot be
pulled, a crash with the engine's last words, a pod no node can take, the model download).

Exit codes a CI or GitOps pipeline can act on: 0 applied (and, with ``--wait``, ready),
1 the manifest is invalid, 2 a usage or API error, 3 the rollout failed (a pod's reason
says it will not recover on its own, or the operator refused the spec), 4 timed out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from brook_operator.api import API_VERSION
from brook_operator.controller.pod_reasons import FATAL_REASONS, PodProblem, pod_problems
from brook_operator.kube import KubeClient
from brook_operator.render.labels import INSTANCE_LABEL

#: The field manager of what ``brook deploy`` applies (the operator's is its own).
DEPLOY_MANAGER = "brook-deploy"
READY, INVALID, USAGE, FAILED, TIMED_OUT = 0, 1, 2, 3, 4
__all__ = ["FATAL_REASONS", "PodProblem", "follow_rollout", "pod_problems", "replica_counts"]


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def replica_counts(obj: Mapping[str, Any]) -> tuple[int, int]:
    """Ready and desired replicas as the status says; before the operator has written it,
    none ready of what the spec asks (``replicas``, or the autoscaler's minimum)."""
    status = obj.get("status") or {}
    spec = obj.get("spec") or {}
    wanted = spec.get("replicas") or (spec.get("autoscaling") or {}).get("minReplicas") or 1
    desired = status.get("desiredReplicas")
    return int(status.get("readyReplicas") or 0), int(wanted if desired is None else desired)


def progress_line(obj: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    """One line of where the rollout is: replicas, the Ready condition, the pods' reasons."""
    count, desired = replica_counts(obj)
    parts = [f"{count}/{desired} replicas ready"]
    ready = _conditions(obj).get("Ready")
    if ready is not None and ready.get("status") != "True":
        parts.append(f"{ready.get('reason')}: {ready.get('message')}")
    elif ready is None:
        parts.append("waiting for the operator")
    parts += [str(p) for pod in pods for p in pod_problems(pod)]
    return "; ".join(parts)


def follow_rollout(
    kube: KubeClient,
    namespace: str,
    name: str,
    timeout: float,
    say: Callable[[str], None],
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Until ``name`` is Ready (``READY``), fails (``FAILED``) or ``timeout`` passes
    (``TIMED_OUT``); each change of the progress line is said once."""
    deadline = clock() + timeout
    said = ""
    while True:
        obj = kube.get(API_VERSION, "LLMInference", namespace, name)
        if obj is None:
            say(f"LLMInference {namespace}/{name} is gone")
            return FAILED
        pods = kube.list("v1", "Pod", namespace, f"{INSTANCE_LABEL}={name}")
        line = progress_line(obj, pods)
        if line != said:
            say(line)
            said = line
        conditions = _conditions(obj)
        generation = (obj.get("metadata") or {}).get("generation")
        observed = (obj.get("status") or {}).get("observedGeneration")
        current = generation is None or observed == generation
        if current and (conditions.get("Ready") or {}).get("status") == "True":
            say(f"ready: {(obj.get('status') or {}).get('endpoint', '')}")
            return READY
        spec_valid = conditions.get("SpecValid") or {}
        if current and spec_valid.get("status") == "False":
            say(f"the operator refused the spec: {spec_valid.get('message')}")
            return FAILED
        fatal = [p for pod in pods for p in pod_problems(pod) if p.fatal]
        if fatal:
            say("failed: " + "; ".join(str(p) for p in fatal))
            return FAILED
        if clock() >= deadline:
            say(f"timed out after {timeout:g} s: {line}")
            return TIMED_OUT
        time.sleep(poll_seconds)
