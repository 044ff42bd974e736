"""kopf glue: thin handlers that call the reconciler and record what happened.

- create / update / resume of an LLMInference → ``Reconciler.reconcile`` (apply children,
  write status); retriable API errors (429, 5xx, transport) retry with exponential backoff;
  the others (403, 404, 409, 422, a foreign object) are reported in status and left to the
  resync, which reconciles every Degraded resource again.
- an event on a child Deployment or LeaderWorkerSet → status of its owner (no apply).
- deletion → nothing: children carry owner references and the garbage collector removes
  them, so no finalizer holds the resource.
- every ``spec.autoscaling.intervalSeconds``, for each autoscaled resource → one autoscaler
  round (``brook_operator.autoscaler.loop``), and every ``resync_seconds`` a status refresh
  of every resource: loops of the operator's own (``brook_operator.loops``), started and
  stopped here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf

from brook_operator import loops
from brook_operator.api import GROUP, PLURAL, VERSION
from brook_operator.autoscaler.loop import Autoscaler, interval_seconds
from brook_operator.controller import Reconciler, ReconcileResult
from brook_operator.controller.conditions import conditions_by_type
from brook_operator.controller.events import post_transitions
from brook_operator.kube import KubeClient, KubeError
from brook_operator.kube.client import DEFAULT_TIMEOUT_SECONDS
from brook_operator.operator_metrics import OperatorMetrics
from brook_operator.render import OperatorSettings
from brook_operator.render.labels import INSTANCE_LABEL
from brook_operator.render.workload import LWS_GROUP, LWS_VERSION

log = logging.getLogger(__name__)

RESOURCE = (GROUP, VERSION, PLURAL)
_CHILD_LABELS = {"app.kubernetes.io/managed-by": "brook-operator"}
#: Seconds between retries of a failed reconciliation: 1, 2, 4, ... up to 5 minutes.
MAX_BACKOFF_SECONDS = 300.0


def backoff(retry: int) -> float:
    return float(min(2**retry, MAX_BACKOFF_SECONDS))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    timeout = float(memo.get("api_timeout_seconds") or DEFAULT_TIMEOUT_SECONDS)
    settings.posting.level = logging.WARNING  # our own Events say what changed
    # kopf's own calls time out like ours; a watch that the server does not end in time
    # (a half-open connection) is cut by the client and opened again.
    settings.networking.request_timeout = timeout
    settings.networking.connect_timeout = timeout
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 300 + timeout
    settings.watching.connect_timeout = timeout
    settings.networking.error_backoffs = [1, 2, 5, 10, 30, 60]
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    if "reconciler" not in memo:
        operator_settings = memo.get("settings") or OperatorSettings(
            engine_image=os.environ.get("BROOK_ENGINE_IMAGE") or None
        )
        memo["reconciler"] = Reconciler(
            KubeClient.from_environment(timeout_seconds=timeout), operator_settings
        )
    if "metrics" not in memo:
        from prometheus_client import CollectorRegistry

        memo["metrics"] = OperatorMetrics(CollectorRegistry())
    if "autoscaler" not in memo:
        memo["autoscaler"] = Autoscaler(memo["reconciler"])


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    reconciler: Reconciler = memo["reconciler"]
    metrics: OperatorMetrics = memo["metrics"]
    started = time.perf_counter()
    before = dict(body.get("status") or {})
    try:
        result: ReconcileResult = reconciler.reconcile(dict(body))
    except KubeError as exc:  # the status write itself failed
        metrics.api_error(exc)
        metrics.reconciles.labels("error").inc()
        if not exc.retriable:
            raise kopf.PermanentError(str(exc)) from None
        raise kopf.TemporaryError(str(exc), delay=backoff(retry)) from None
    finally:
        metrics.duration.observe(time.perf_counter() - started)
    spec_valid = conditions_by_type(result.status).get("SpecValid", {}).get("status") == "True"
    metadata = body.get("metadata") or {}
    metrics.track(
        metadata.get("namespace"),
        str(metadata.get("name")),
        [kind for kind, _ in result.applied] if spec_valid else None,
        spec_valid,
    )
    post_transitions(reconciler.kube, dict(body), before, result.status)
    if result.error is not None:
        metrics.api_error(result.error)
    if result.error is not None and result.error.retriable:
        metrics.reconciles.labels("error").inc()
        raise kopf.TemporaryError(str(result.error), delay=backoff(retry))
    if result.error is not None or (result.problem is not None and not result.applied):
        # Retrying would meet the same answer: status says what to do; the resync tries
        # again every resync_seconds.
        metrics.reconciles.labels("error").inc()
        return
    metrics.reconciles.labels("applied" if spec_valid else "invalid").inc()


@kopf.on.event(*RESOURCE)
def track(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Bookkeeping on every event: which resources the autoscaler sizes, and metrics when a
    resource is gone. An event handler, not a delete handler: those need a finalizer, and
    deletion here is the garbage collector's."""
    metadata = body.get("metadata") or {}
    key = (metadata.get("namespace"), str(metadata.get("name")))
    autoscaled: dict[tuple[str | None, str], float] = memo.setdefault("autoscaled", {})
    interval = None if type == "DELETED" else interval_seconds(dict(body))
    if interval is None:
        if autoscaled.pop(key, None) is not None:
            memo["autoscaler"].forget(key)
    else:
        autoscaled[key] = interval
    if type == "DELETED":
        memo["metrics"].forget(*key)


def _refresh_owner(body: kopf.Body, memo: kopf.Memo) -> None:
    metadata = body.get("metadata") or {}
    owner = (metadata.get("labels") or {}).get(INSTANCE_LABEL)
    if not owner:
        return
    reconciler: Reconciler = memo["reconciler"]
    try:
        llmi = reconciler.kube.get(
            f"{GROUP}/{VERSION}", "LLMInference", metadata.get("namespace"), owner
        )
        if llmi is None:
            return
        before = dict(llmi.get("status") or {})
        status = reconciler.refresh_status(llmi)
        if status is not None:
            post_transitions(reconciler.kube, llmi, before, status)
    except KubeError as exc:
        memo["metrics"].api_error(exc)
        log.warning("%s: status refresh failed: %s", owner, exc)


@kopf.on.event("apps", "v1", "deployments", labels=_CHILD_LABELS)
def deployment_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _refresh_owner(body, memo)


@kopf.on.event(LWS_GROUP, LWS_VERSION, "leaderworkersets", labels=_CHILD_LABELS)
def leader_worker_set_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _refresh_owner(body, memo)


@kopf.on.startup()
async def start_loops(memo: kopf.Memo, **_: Any) -> None:
    stop = asyncio.Event()
    memo["loops_stop"] = stop
    timeout = float(memo.get("api_timeout_seconds") or DEFAULT_TIMEOUT_SECONDS)
    # A round waits for one resource as long as a few of its calls may take.
    memo.setdefault("round_timeout_seconds", 4 * timeout)
    loops.runner(memo)
    memo["loop_tasks"] = [
        asyncio.create_task(loops.resync(memo, stop)),
        asyncio.create_task(loops.autoscale(memo, stop)),
    ]


@kopf.on.cleanup()
async def stop_loops(memo: kopf.Memo, **_: Any) -> None:
    stop: asyncio.Event | None = memo.get("loops_stop")
    if stop is not None:
        stop.set()
        await asyncio.gather(*memo["loop_tasks"])
        await memo["runner"].close()
