"""One reconciliation of one ``LLMInference``: validate, apply the children, remove those
the spec no longer wants, read the workload back, write status. Idempotent: running it again
(after a restart mid-way, say) applies the same objects and creates nothing twice.

Brook only ever writes objects it owns. Before applying, each child is read: one that exists
without this resource's owner reference (its uid) is someone else's — a Service of the same
name, a ConfigMap another tool made, the children of a deleted namesake that the garbage
collector has not removed yet — and the round applies nothing (as Helm refuses to install
over an object it does not own); the resource reports ``Degraded=True``, reason
``ForeignObject``, naming the object and what to do. Children are applied without
``force``: a field another manager owns is never taken over. When that field is a
workload's ``spec.replicas`` (an HPA, a ``kubectl scale``), the rest of the workload is
still applied and the count left to that manager; any other conflict stops the round. Both
report ``Degraded=True``, reason ``FieldConflict``, with the fields and their managers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from brook_engine.config import ConfigError
from brook_engine.offload.plan import ModelShape
from brook_operator.api import API_VERSION, KIND, LLMInference, topology
from brook_operator.controller.conditions import (
    OWN_CONDITIONS,
    OWN_FIELDS,
    PLAN_DOES_NOT_FIT,
    Observed,
    compute_status,
    conditions_by_type,
    invalid_status,
    spec_error,
)
from brook_operator.controller.downloads import PodDownload, read_downloads
from brook_operator.controller.pod_reasons import PodProblem, pod_problems
from brook_operator.kube import STATUS_MANAGER, KubeClient, KubeError
from brook_operator.memory_plan import fitting_plan, memory_request, with_memory_request
from brook_operator.model_configs import ModelConfigs
from brook_operator.render import (
    OPTIONAL_KINDS,
    PRUNABLE_KINDS,
    OperatorSettings,
    desired_replicas,
    render_children,
    with_owner,
)
from brook_operator.render.labels import INSTANCE_LABEL, selector_labels
from brook_operator.render.pod import ENGINE_CONTAINER
from brook_operator.render.router import router_children
from brook_operator.render.workload import LWS_API_VERSION, pod_templates

log = logging.getLogger(__name__)

#: Kinds whose ``spec.replicas`` another manager may own (an HPA scales them).
_WORKLOADS = ("Deployment", "LeaderWorkerSet")
#: Degraded reasons a status refresh keeps (only a reconciliation finds them resolved).
_KEPT_PROBLEMS = ("ForeignObject", "FieldConflict", "ApplyFailed")
#: Reads and writes a refresh tries while other writers keep changing the resource.
_REFRESH_TRIES = 3


@dataclass
class ReconcileResult:
    status: dict[str, Any]
    """The status this writer applied (its own fields only)."""

    applied: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of each child applied."""

    deleted: list[tuple[str, str]] = field(default_factory=list)
    error: KubeError | None = None
    """The first API error met (the rest of the round was skipped); the caller retries it
    when it is retriable."""

    problem: tuple[str, str] | None = None
    """(reason, message) of what needs a person (``ForeignObject``, ``FieldConflict``);
    retrying does not help, the resync tries again."""


def parse(body: dict[str, Any]) -> LLMInference:
    """The resource as the operator's models read it (status is not needed here)."""
    return LLMInference.model_validate(
        {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    )


class _Refused(Exception):
    """The round stops: a child may not be written (reason, message)."""

    def __init__(self, reason: str, message: str, error: KubeError | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.error = error


@dataclass
class Reconciler:
    kube: KubeClient
    settings: OperatorSettings = field(default_factory=OperatorSettings)
    model_configs: ModelConfigs | None = None
    """Where hf:// models' config.json come from, to plan their memory (None: no plan)."""

    def reconcile(self, body: dict[str, Any], *, autoscaled: int | None = None) -> ReconcileResult:
        """Apply the children and write status. ``autoscaled``: the replica count the
        autoscaler decided this round (otherwise an autoscaled workload keeps its size)."""
        metadata = body.get("metadata") or {}
        name: str = metadata["name"]
        namespace: str | None = metadata.get("namespace")
        try:
            llmi = parse(body)
        except ValidationError as exc:
            message = spec_error(exc)
            log.warning("%s/%s: invalid spec, nothing applied: %s", namespace, name, message)
            status = invalid_status(body, message)
            self._write_status(namespace, name, status)
            return ReconcileResult(status=status)
        llmi, refusal = self.planned(llmi)
        if refusal is not None:
            log.warning(
                "%s/%s: the memory plan does not fit, nothing applied: %s", namespace, name, refusal
            )
            status = invalid_status(body, refusal, reason=PLAN_DOES_NOT_FIT)
            self._write_status(namespace, name, status)
            return ReconcileResult(status=status)
        result = ReconcileResult(status={})
        lws_missing = False
        missing: dict[str, str] = {}
        count = autoscaled
        try:
            lws_missing = topology(
                llmi.spec
            ).workload == "LeaderWorkerSet" and not self.kube.has_api(
                LWS_API_VERSION, "LeaderWorkerSet"
            )
            missing = self.missing_apis(llmi)
            count = self._apply(llmi, body, lws_missing, autoscaled, result, missing)
        except _Refused as refused:
            log.warning("%s/%s: %s", namespace, name, refused.message)
            result.problem = (refused.reason, refused.message)
            result.error = refused.error
        except KubeError as exc:
            log.warning("%s/%s: %s", namespace, name, exc)
            result.error = exc
        workload = self.read_workload(llmi)
        problems, downloads = self.read_pods(llmi)
        observed = Observed(
            workload=workload,
            desired_replicas=desired_replicas(llmi, self._count(llmi, body, workload, count)),
            lws_missing=lws_missing,
            error=str(result.error) if result.error else None,
            problem=result.problem,
            pod_problems=problems,
            downloads=downloads,
            missing_apis=tuple(missing.values()),
        )
        result.status = compute_status(llmi, observed, body.get("status"))
        self._write_status(namespace, name, result.status)
        return result

    def refresh_status(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Status only (a child changed): no apply. None for an invalid spec (or a resource
        gone). Degraded stays as the last reconciliation left it. Written only over the
        version of the resource it was computed from: a reconciliation that wrote status in
        the meantime is newer, and the refresh starts again from a fresh read."""
        for _ in range(_REFRESH_TRIES):
            try:
                return self._refresh(body)
            except KubeError as exc:
                if exc.status != 409:
                    raise
            metadata = body["metadata"]
            fresh = self.kube.get(API_VERSION, KIND, metadata.get("namespace"), metadata["name"])
            if fresh is None:
                return None
            body = fresh
        return None  # busy: the writers in between leave it fresh enough; the next event

    def _refresh(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            llmi = parse(body)
        except ValidationError:
            return None
        if self.plan_refusal(llmi) is not None:
            return None
        lws_missing = topology(llmi.spec).workload == "LeaderWorkerSet" and not (
            self.kube.has_api(LWS_API_VERSION, "LeaderWorkerSet")
        )
        previous = body.get("status") or {}
        degraded = conditions_by_type(previous).get("Degraded") or {}
        problem = None
        if degraded.get("status") == "True" and degraded.get("reason") in _KEPT_PROBLEMS:
            problem = (str(degraded["reason"]), str(degraded.get("message", "")))
        workload = self.read_workload(llmi)
        problems, downloads = self.read_pods(llmi)
        observed = Observed(
            workload=workload,
            desired_replicas=desired_replicas(llmi, self._count(llmi, body, workload, None)),
            lws_missing=lws_missing,
            problem=problem,
            pod_problems=problems,
            downloads=downloads,
            missing_apis=tuple(self.missing_apis(llmi).values()),
        )
        status = compute_status(llmi, observed, previous)
        if _same(status, previous):
            return status
        metadata = body["metadata"]
        self.kube.apply_status(
            API_VERSION,
            KIND,
            metadata.get("namespace"),
            metadata["name"],
            status,
            STATUS_MANAGER,
            resource_version=metadata.get("resourceVersion"),
        )
        return status

    # -- steps ---------------------------------------------------------------------------

    def planned(self, llmi: LLMInference) -> tuple[LLMInference, str | None]:
        """``llmi`` with the memory request its plan implies (where the spec sets no memory
        request or limit), and why the plan cannot run (None: it fits, or there is no
        config.json to plan from). Without a plan this round, the request the engine
        container already has is kept: a Hub that cannot be reached must not roll the pods."""
        request, refusal = self._plan(llmi)
        if refusal is not None:
            return llmi, refusal
        resources = llmi.spec.resources
        if "memory" in resources.requests or "memory" in resources.limits:
            return llmi, None
        if (
            request is None
            and self.model_configs is not None
            and llmi.spec.model.uri.startswith("hf://")
        ):  # a plan that could not be had this round: the request it gave before stays
            request = self._engine_memory_request(llmi)
        return with_memory_request(llmi, request), None

    def plan_refusal(self, llmi: LLMInference) -> str | None:
        """Why ``llmi``'s memory plan cannot run (None: it fits, or nothing to plan from)."""
        return self._plan(llmi)[1]

    def _plan(self, llmi: LLMInference) -> tuple[str | None, str | None]:
        """(the plan's memory request of a pod, why the plan cannot run); both None where
        no config.json can be had."""
        if self.model_configs is None:
            return None, None
        uri = llmi.spec.model.uri
        try:
            data = self.model_configs.get(uri, llmi.spec.model.revision)
            if data is None:
                return None, None
            ModelShape.from_config(data)
        except Exception as exc:  # a config.json the plan cannot read: the engine will say why
            log.warning(
                "%s: no memory plan from %s's config.json: %s", llmi.metadata.name, uri, exc
            )
            return None, None
        try:
            plan = fitting_plan(llmi, data)
        except ConfigError as exc:
            return None, f"memory plan of {uri}: spec.{exc}"
        except Exception:
            log.exception("%s: no memory plan for %s", llmi.metadata.name, uri)
            return None, None
        return memory_request(llmi, plan), None

    def _engine_memory_request(self, llmi: LLMInference) -> str | None:
        """The memory request of the running workload's engine container (None: none)."""
        try:
            workload = self.read_workload(llmi)
        except KubeError:
            return None
        for template in pod_templates(workload):
            for container in (template.get("spec") or {}).get("containers") or []:
                if container.get("name") == ENGINE_CONTAINER:
                    memory = ((container.get("resources") or {}).get("requests") or {}).get(
                        "memory"
                    )
                    return str(memory) if memory is not None else None
        return None

    def read_pods(
        self, llmi: LLMInference
    ) -> tuple[tuple[PodProblem, ...], tuple[PodDownload, ...]]:
        """Why the resource's engine pods are not serving, and the model downloads they
        wait for (terminating pods aside); neither when the pods cannot be read (the
        status then counts replicas only)."""
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(llmi).items())
        try:
            pods = self.kube.list("v1", "Pod", llmi.metadata.namespace, selector)
        except KubeError as exc:
            log.info("%s: pods not read: %s", llmi.metadata.name, exc)
            return (), ()
        live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        problems = tuple(problem for pod in live for problem in pod_problems(pod))
        return problems, read_downloads(live, llmi.spec.server.port)

    def _write_status(self, namespace: str | None, name: str, status: dict[str, Any]) -> None:
        self.kube.apply_status(API_VERSION, KIND, namespace, name, status, STATUS_MANAGER)

    @staticmethod
    def _count(
        llmi: LLMInference,
        body: dict[str, Any],
        workload: dict[str, Any] | None,
        decided: int | None,
    ) -> int | None:
        """The autoscaled replica count: this round's decision, else what the workload runs
        (the autoscaler's last applied size: a snapshot of status may be older), else the
        autoscaler's recorded wish (before the workload exists). None when not autoscaled."""
        if llmi.spec.autoscaling is None:
            return None
        if decided is not None:
            return decided
        if workload is not None and (workload.get("spec") or {}).get("replicas") is not None:
            return int(workload["spec"]["replicas"])
        wanted = (body.get("status") or {}).get("desiredReplicas")
        return int(wanted) if isinstance(wanted, int) else None

    def missing_apis(self, llmi: LLMInference) -> dict[str, str]:
        """The optional APIs this spec's children need and the cluster lacks: kind → what to
        install (the InferencePool and HTTPRoute CRDs of ``spec.router``)."""
        kinds = {c["kind"]: c["apiVersion"] for c in router_children(llmi)}
        return {
            kind: OPTIONAL_KINDS[(api_version, kind)]
            for kind, api_version in kinds.items()
            if not self.kube.has_api(api_version, kind)
        }

    def _apply(
        self,
        llmi: LLMInference,
        body: dict[str, Any],
        lws_missing: bool,
        autoscaled: int | None,
        result: ReconcileResult,
        missing: dict[str, str],
    ) -> int | None:
        """Apply the children (all or none, when one is foreign) and prune; returns the
        autoscaled count used."""
        namespace = llmi.metadata.namespace
        current = self._current_workload(llmi, lws_missing)
        count = self._count(llmi, body, current, autoscaled)
        children = [
            with_owner(child, llmi)
            for child in render_children(llmi, self.settings, count)
            if not (child["kind"] == "LeaderWorkerSet" and lws_missing)
            and child["kind"] not in missing
        ]
        for child in children:  # first every check, then every write
            if child["kind"] in _WORKLOADS:
                existing = current  # the workload of this topology, read just above
            else:
                existing = self.kube.get(
                    child["apiVersion"], child["kind"], namespace, child["metadata"]["name"]
                )
            if existing is not None and not _owned_by(existing, llmi):
                raise _Refused("ForeignObject", _foreign_message(child, existing, llmi))
        wanted: set[tuple[str, str]] = set()
        for child in children:
            key = (child["kind"], child["metadata"]["name"])
            wanted.add(key)
            self._apply_child(child, result)
            result.applied.append(key)
        for api_version, kind in PRUNABLE_KINDS:
            if kind == "LeaderWorkerSet" and (
                lws_missing or not self.kube.has_api(LWS_API_VERSION, kind)
            ):
                continue
            for obj in self.kube.list(
                api_version, kind, namespace, f"{INSTANCE_LABEL}={llmi.metadata.name}"
            ):
                child_name = obj["metadata"]["name"]
                if (kind, child_name) in wanted or not _owned_by(obj, llmi):
                    continue
                if self.kube.delete(api_version, kind, namespace, child_name):
                    log.info("%s: deleted %s %s", llmi.metadata.name, kind, child_name)
                    result.deleted.append((kind, child_name))
        return count

    def _current_workload(self, llmi: LLMInference, lws_missing: bool) -> dict[str, Any] | None:
        if topology(llmi.spec).workload == "LeaderWorkerSet" and lws_missing:
            return None
        return self.read_workload(llmi)

    def _apply_child(self, child: dict[str, Any], result: ReconcileResult) -> None:
        """Apply without force. A workload whose replica count another manager owns is
        applied without it (that manager keeps it); any other conflict stops the round."""
        try:
            self.kube.apply(child)
            return
        except KubeError as exc:
            if exc.status != 409:
                raise
            error = exc
        conflicts = error.conflicts
        message = _conflict_message(child, conflicts, error)
        fields = {f for _, f in conflicts}
        if child["kind"] not in _WORKLOADS or fields != {".spec.replicas"}:
            raise _Refused("FieldConflict", message, error)
        spec = {k: v for k, v in child["spec"].items() if k != "replicas"}
        self.kube.apply({**child, "spec": spec})
        result.problem = ("FieldConflict", message)

    def read_workload(self, llmi: LLMInference) -> dict[str, Any] | None:
        namespace, name = llmi.metadata.namespace, llmi.metadata.name
        if topology(llmi.spec).workload == "Deployment":
            return self.kube.get("apps/v1", "Deployment", namespace, name)
        try:
            return self.kube.get(LWS_API_VERSION, "LeaderWorkerSet", namespace, name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise


def _owned_by(obj: dict[str, Any], llmi: LLMInference) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == llmi.metadata.uid for ref in refs)


def _where(child: dict[str, Any]) -> str:
    metadata = child["metadata"]
    namespace = metadata.get("namespace")
    return f"{child['kind']} {namespace}/{metadata['name']}" if namespace else child["kind"]


def _foreign_message(child: dict[str, Any], existing: dict[str, Any], llmi: LLMInference) -> str:
    refs = (existing.get("metadata") or {}).get("ownerReferences") or []
    owners = ", ".join(f"{r.get('kind')} {r.get('name')} (uid {r.get('uid')})" for r in refs)
    whose = f"owned by {owners}" if owners else "not owned by any object"
    return (
        f"{_where(child)} already exists, {whose}, not by this LLMInference (uid "
        f"{llmi.metadata.uid}); Brook never adopts an object it did not create and applied "
        "nothing. Delete or rename that object, or give this LLMInference another name "
        "(if it belonged to a deleted namesake, the garbage collector removes it shortly)."
    )


def _conflict_message(
    child: dict[str, Any], conflicts: list[tuple[str, str]], error: KubeError
) -> str:
    if not conflicts:
        return f"{_where(child)}: {error.message or error}"
    owned = "; ".join(f'{f} is managed by "{m}"' for m, f in sorted(set(conflicts)))
    fields = {f for _, f in conflicts}
    if child["kind"] in _WORKLOADS and fields == {".spec.replicas"}:
        consequence = (
            "Brook leaves the replica count to that manager (an HPA or kubectl scale?) and "
            "applies the rest; spec.replicas and spec.autoscaling have no effect until it "
            "lets go. Scale through the LLMInference instead (remove the other autoscaler)"
        )
    else:
        consequence = (
            "Brook does not override other managers and applied nothing more. Undo that "
            "change or stop its writer"
        )
    return (
        f"{_where(child)}: {owned}. {consequence}, then hand the field back: kubectl apply "
        "--server-side --force-conflicts --field-manager=brook-operator, or delete the "
        f"{child['kind']} (Brook recreates it)."
    )


def _same(status: dict[str, Any], previous: dict[str, Any]) -> bool:
    """Whether applying ``status`` would change nothing this writer owns. A field it owns and
    no longer writes (a download's progress once it ends) is removed by writing; the
    replica count of an autoscaled resource is the autoscaler's, not this writer's."""
    dropped = set(OWN_FIELDS) - {"desiredReplicas"} - status.keys()
    if dropped & previous.keys():
        return False
    before = conditions_by_type(previous)
    for key, value in status.items():
        if key == "conditions":
            if any(before.get(c["type"]) != c for c in value if c["type"] in OWN_CONDITIONS):
                return False
        elif previous.get(key) != value:
            return False
    return True
