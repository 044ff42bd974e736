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
from dataclasses import dataclass
from typing import Any

from brook_operator.api import API_VERSION
from brook_operator.kube import KubeClient
from brook_operator.render.labels import INSTANCE_LABEL

#: The field manager of what ``brook deploy`` applies (the operator's is its own).
DEPLOY_MANAGER = "brook-deploy"
READY, INVALID, USAGE, FAILED, TIMED_OUT = 0, 1, 2, 3, 4
#: Waiting reasons that do not clear without a change (kubelet's names).
FATAL_REASONS = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


@dataclass(frozen=True)
class PodProblem:
    pod: str
    container: str | None
    reason: str
    message: str

    def __str__(self) -> str:
        where = f"pod {self.pod}" + (f" container {self.container}" if self.container else "")
        return f"{where}: {self.reason}" + (f" ({self.message})" if self.message else "")

    @property
    def fatal(self) -> bool:
        return self.reason in FATAL_REASONS


def pod_problems(pod: dict[str, Any]) -> list[PodProblem]:
    """Why ``pod`` is not serving, as its status says: unschedulable, a container (or the
    model-fetching init container) waiting with a reason, or one that terminated with an
    error — with the last termination's message (the engine's last error line)."""
    name = str((pod.get("metadata") or {}).get("name", "?"))
    status = pod.get("status") or {}
    problems: list[PodProblem] = []
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = str(condition.get("reason") or "Unschedulable")
            problems.append(PodProblem(name, None, reason, str(condition.get("message") or "")))
    for kind in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(kind) or []:
            state = container.get("state") or {}
            last = (container.get("lastState") or {}).get("terminated") or {}
            waiting = state.get("waiting") or {}
            terminated = state.get("terminated") or {}
            cname = str(container.get("name", "?"))
            if waiting.get("reason") and waiting["reason"] != "PodInitializing":
                message = str(waiting.get("message") or "")
                if waiting["reason"] == "CrashLoopBackOff" and last:
                    message = _termination(last) or message
                problems.append(PodProblem(name, cname, str(waiting["reason"]), message))
            elif terminated and terminated.get("exitCode", 0) != 0:
                problems.append(
                    PodProblem(
                        name,
                        cname,
                        str(terminated.get("reason") or "Error"),
                        _termination(terminated),
                    )
                )
    return problems


def _termination(terminated: dict[str, Any]) -> str:
    code = terminated.get("exitCode")
    message = str(terminated.get("message") or "").strip().splitlines()
    text = f"exit code {code}" if code is not None else ""
    if message:
        text += f": {message[-1]}"  # the engine's last error line
    return text


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
