"""Why an engine pod is not serving, from its status as the kubelet and the scheduler write
it (pure): read by the operator's status conditions and by ``brook deploy --wait``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
