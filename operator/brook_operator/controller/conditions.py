"""``status`` of an ``LLMInference`` from what its workload and its pods report (pure): the
conditions (SpecValid, Degraded, Ready, Progressing, and kstatus's Reconciling and Stalled,
which Argo CD, Flux and ``kubectl wait`` read) and the replica counts, and the helpers that
keep a condition's ``lastTransitionTime`` across rounds. A replica that is not ready says why
in ``Ready``: its pods' reasons (a crash loop with the engine's last error line, an image
that cannot be pulled, a pod no node can take), or the model download it waits for, whose
progress is ``modelDownload``.

These are the fields of one writer (field manager ``STATUS_MANAGER``), written by
server-side apply: a status computed here holds ALL of them and NOTHING else — the
autoscaler's fields and conditions are its own, and a field left out here would be removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from brook_operator.api import LLMInference, topology
from brook_operator.controller.downloads import PodDownload, download_status, parse_time
from brook_operator.controller.pod_reasons import PodProblem, workload_problems
from brook_operator.render import ROLE_LABEL, endpoint, selector_labels
from brook_operator.render.workload import LWS_GROUP


def spec_error(exc: ValidationError) -> str:
    """One line naming each bad field, as ``kubectl describe`` shows it."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Observed:
    """What the operator saw this round."""

    workload: dict[str, Any] | None
    """The Deployment or LeaderWorkerSet, as read back (None when absent)."""

    desired_replicas: int
    lws_missing: bool = False
    """A multi-pod replica needs LeaderWorkerSet and its CRD is not installed."""

    error: str | None = None
    """Why the last apply failed, if it did."""

    problem: tuple[str, str] | None = None
    """(reason, message) of what a person must resolve: ``ForeignObject`` (a child's name
    is taken by an object Brook does not own) or ``FieldConflict`` (another field manager
    owns a field Brook applies)."""

    pod_problems: tuple[PodProblem, ...] = ()
    """Why engine pods are not serving, as their status says."""

    missing_apis: tuple[str, ...] = ()
    """The CRDs ``spec.router`` needs and the cluster lacks (its children are not applied)."""

    downloads: tuple[PodDownload, ...] = ()
    """Engine pods fetching their model, with the progress they served."""


def make_condition(
    previous: dict[str, dict[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    value = "True" if status else "False"
    before = previous.get(kind) or {}
    changed = before.get("status") != value
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def conditions_by_type(status: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A status's conditions keyed by type (entries without one are skipped)."""
    return {c["type"]: c for c in (status or {}).get("conditions") or [] if "type" in c}


def rfc3339(timestamp: float | None = None) -> str:
    """``timestamp`` (seconds since the epoch; now when None) as Kubernetes writes times."""
    moment = datetime.now(UTC) if timestamp is None else datetime.fromtimestamp(timestamp, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def now_rfc3339() -> str:
    return rfc3339()


#: The conditions ``compute_status`` owns.
OWN_CONDITIONS = ("SpecValid", "Degraded", "Ready", "Progressing", "Reconciling", "Stalled")
#: Pod problems named in the Ready condition's message (the rest are counted).
PROBLEMS_NAMED = 3
#: The other status fields it owns (desiredReplicas only without spec.autoscaling;
#: modelDownload only while a pod fetches its model).
OWN_FIELDS = (
    "replicas",
    "readyReplicas",
    "desiredReplicas",
    "selector",
    "topology",
    "endpoint",
    "modelDownload",
)


#: Why SpecValid is False: a spec the operator's models refuse, or a valid one whose memory
#: plan cannot run (an hf:// model's config.json read from the Hub).
INVALID_SPEC = "InvalidSpec"
PLAN_DOES_NOT_FIT = "PlanDoesNotFit"


def invalid_status(
    body: dict[str, Any], message: str, now: str | None = None, reason: str = INVALID_SPEC
) -> dict[str, Any]:
    """Status of a resource whose spec the operator cannot run: SpecValid and Ready False,
    the rest of this writer's fields as they were (the children are left as they were)."""
    now = now or now_rfc3339()
    status = body.get("status") or {}
    previous = conditions_by_type(status)
    generation = (body.get("metadata") or {}).get("generation")
    conditions = [
        make_condition(previous, "SpecValid", False, reason, message, generation, now),
        make_condition(previous, "Ready", False, reason, "the spec cannot run", generation, now),
        make_condition(previous, "Stalled", True, reason, message, generation, now),
        make_condition(
            previous, "Reconciling", False, reason, "the spec cannot run", generation, now
        ),
    ]
    keep = [previous[t] for t in ("Degraded", "Progressing") if t in previous]
    autoscaled = isinstance((body.get("spec") or {}).get("autoscaling"), dict)
    # a download's progress is not kept: it would go stale while nothing reads it
    fields = {
        k: status[k]
        for k in OWN_FIELDS
        if k in status and k != "modelDownload" and not (k == "desiredReplicas" and autoscaled)
    }
    return {**fields, "observedGeneration": generation, "conditions": conditions + keep}


def compute_status(
    llmi: LLMInference,
    observed: Observed,
    previous_status: dict[str, Any] | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The status fields the reconciler owns, all of them (the autoscaler's are its own)."""
    now = now or now_rfc3339()
    generation = llmi.metadata.generation
    previous = conditions_by_type(previous_status)
    downloading = download_status(observed.downloads, parse_time(now) or datetime.now(UTC))
    workload = observed.workload or {}
    wstatus = workload.get("status") or {}
    desired = observed.desired_replicas
    replicas = int(wstatus.get("replicas") or 0)
    ready = int(wstatus.get("readyReplicas") or 0)
    updated = int(wstatus.get("updatedReplicas") or 0)
    synced = observed.workload is not None and (workload.get("metadata") or {}).get(
        "generation"
    ) == wstatus.get("observedGeneration", (workload.get("metadata") or {}).get("generation"))

    def condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return make_condition(previous, kind, status, reason, message, generation, now)

    conditions = [condition("SpecValid", True, "Valid", "the spec is valid")]
    if observed.lws_missing:
        conditions.append(
            condition(
                "Degraded",
                True,
                "LeaderWorkerSetMissing",
                f"a replica spans {topology(llmi.spec).pods_per_replica} pods and needs the "
                f"LeaderWorkerSet API ({LWS_GROUP}); install it: "
                "https://lws.sigs.k8s.io/docs/installation/",
            )
        )
    elif observed.problem:
        conditions.append(condition("Degraded", True, *observed.problem))
    elif observed.missing_apis:
        conditions.append(
            condition(
                "Degraded",
                True,
                "RouterAPIMissing",
                "spec.router needs " + " and ".join(observed.missing_apis) + "; install them "
                "(https://gateway-api-inference-extension.sigs.k8s.io/) or remove spec.router",
            )
        )
    elif observed.error:
        conditions.append(condition("Degraded", True, "ApplyFailed", observed.error))
    else:
        conditions.append(condition("Degraded", False, "AsExpected", "children applied"))
    problems = (*workload_problems(observed.workload), *observed.pod_problems)
    fatal = [p for p in problems if p.fatal]
    if llmi.spec.suspend:
        conditions.append(condition("Ready", False, "Suspended", "spec.suspend is true"))
    elif desired > 0 and ready >= desired:
        conditions.append(
            condition("Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready")
        )
    else:
        reason, message = _not_ready(problems, downloading, ready, desired)
        conditions.append(condition("Ready", False, reason, message))
    rolling = observed.workload is not None and (
        not synced or updated < desired or ready < desired or replicas > desired
    )
    if rolling:
        message = f"{updated}/{desired} replicas updated, {ready} ready"
        conditions.append(condition("Progressing", True, "RollingOut", message))
    else:
        conditions.append(condition("Progressing", False, "Complete", "no rollout in progress"))
    # a rollout is not done while old pods still answer for the new generation
    settled = llmi.spec.suspend or (ready >= desired and not rolling)
    conditions += _kstatus(conditions, fatal, settled, condition)
    selector = {**selector_labels(llmi), ROLE_LABEL: "leader"}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": ",".join(f"{k}={v}" for k, v in selector.items()),
        "topology": topology(llmi.spec).model_dump(by_alias=True),
        "endpoint": endpoint(llmi),
        "conditions": conditions,
    }
    if downloading is not None:
        status["modelDownload"] = downloading
    # With autoscaling the count is the autoscaler's to write: a status computed from an
    # older snapshot must not undo its latest decision.
    if llmi.spec.autoscaling is None:
        status["desiredReplicas"] = desired
    return status


def _not_ready(
    problems: tuple[PodProblem, ...],
    downloading: dict[str, Any] | None,
    ready: int,
    desired: int,
) -> tuple[str, str]:
    """Ready=False's reason and message: the pods' own reason where they give one (the
    first that will not clear by itself, else the first), named with their messages; else
    the model download they wait for (``ModelDownloading``), with its progress."""
    counted = f"{ready}/{desired} replicas ready"
    fetch = [str(downloading["message"])] if downloading else []
    if not problems:
        if fetch:
            return "ModelDownloading", f"{counted}: {fetch[0]}"
        return "ReplicasNotReady", counted
    first = next((p for p in problems if p.fatal), problems[0])
    named = "; ".join(str(p) for p in problems[:PROBLEMS_NAMED])
    more = len(problems) - PROBLEMS_NAMED
    if more > 0:
        named += f"; and {more} more"
    return first.reason, "; ".join([f"{counted}: {named}", *fetch])


def _kstatus(
    conditions: list[dict[str, Any]],
    fatal: list[PodProblem],
    settled: bool,
    condition: Callable[[str, bool, str, str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """kstatus's two conditions from the others: Stalled while something needs a person
    (Degraded, or a pod that will not recover by itself), else Reconciling until Ready."""
    by_type = {c["type"]: c for c in conditions}
    degraded, ready = by_type["Degraded"], by_type["Ready"]
    if degraded["status"] == "True":
        stalled = condition("Stalled", True, str(degraded["reason"]), str(degraded["message"]))
    elif fatal:
        stalled = condition("Stalled", True, fatal[0].reason, str(ready["message"]))
    else:
        stalled = condition("Stalled", False, "AsExpected", "nothing needs a person")
    if settled:
        reconciling = condition("Reconciling", False, "Complete", str(ready["message"]))
    elif stalled["status"] == "True":
        reconciling = condition("Reconciling", False, "Stalled", "see Stalled")
    else:
        # why not yet: the replicas not ready, or else the rollout replacing them
        cause = ready if ready["status"] != "True" else by_type["Progressing"]
        reconciling = condition("Reconciling", True, str(cause["reason"]), str(cause["message"]))
    return [stalled, reconciling]
