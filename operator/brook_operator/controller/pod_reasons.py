"""Why an engine pod is not serving, from its status as the kubelet and the scheduler write
it (pure): read by the operator's status conditions and by ``brook deploy --wait``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Waiting reasons that do not clear without a change (kubelet's names). A first
#: ErrImagePull may be a registry's hiccup: the kubelet's back-off after it is the verdict.
FATAL_REASONS = frozenset(
    {
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RestartingOnErrors",
        "FailedCreate",
    }
)
#: Restarts after errors that make a running container's history a crash loop: a model that
#: loads for longer than the kubelet's back-off spends most of a crash loop running.
CRASH_LOOP_RESTARTS = 3


@dataclass(frozen=True)
class PodProblem:
    pod: str
    container: str | None
    reason: str
    message: str

    kind: str = "pod"
    """What ``pod`` names: a pod, or the workload that could not create its pods."""

    def __str__(self) -> str:
        where = f"{self.kind} {self.pod}"
        where += f" container {self.container}" if self.container else ""
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
            elif last and last.get("exitCode", 0) != 0 and container.get("restartCount", 0):
                restarts = int(container["restartCount"])
                reason = "RestartingOnErrors" if restarts >= CRASH_LOOP_RESTARTS else "Restarted"
                message = f"{restarts} restart(s); last {_termination(last)}"
                problems.append(PodProblem(name, cname, reason, message))
    return problems


def workload_problems(workload: dict[str, Any] | None) -> list[PodProblem]:
    """Pods the workload could not create (admission refused them: Pod Security, a quota),
    from the ReplicaFailure condition a Deployment reports."""
    if not workload:
        return []
    name = str((workload.get("metadata") or {}).get("name", "?"))
    kind = str(workload.get("kind") or "workload").lower()
    return [
        PodProblem(
            name, None, str(c.get("reason") or "FailedCreate"), str(c.get("message") or ""), kind
        )
        for c in (workload.get("status") or {}).get("conditions") or []
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True"
    ]


def _termination(terminated: dict[str, Any]) -> str:
    code = terminated.get("exitCode")
    message = str(terminated.get("message") or "").strip().splitlines()
    text = f"exit code {code}" if code is not None else ""
    if message:
        text += f": {message[-1]}"  # the engine's last error line
    return text
