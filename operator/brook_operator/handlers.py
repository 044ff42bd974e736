"""kopf glue: thin handlers that call the reconciler and record what happened.

- create / update / resume of an LLMInference → ``Reconciler.reconcile`` (apply children,
  write status); API errors retry with exponential backoff.
- an event on a child Deployment or LeaderWorkerSet → status of its owner (no apply).
- deletion → nothing: children carry owner references and the garbage collector removes
  them, so no finalizer holds the resource.
- every ``spec.autoscaling.intervalSeconds``, for each autoscaled resource → one autoscaler
  round (``brook_operator.autoscaler.loop``), in a loop of the operator's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import kopf

from brook_operator.api import GROUP, PLURAL, VERSION
from brook_operator.autoscaler.loop import Autoscaler, interval_seconds
from brook_operator.controller import Reconciler, ReconcileResult
from brook_operator.controller.events import post_transitions
from brook_operator.controller.reconcile import LWS_API_VERSION
from brook_operator.controller.status import conditions_by_type
from brook_operator.kube import KubeClient, KubeError
from brook_operator.operator_metrics import OperatorMetrics
from brook_operator.rbac import LWS_GROUP
from brook_operator.render import OperatorSettings
from brook_operator.render.labels import INSTANCE_LABEL

log = logging.getLogger(__name__)

RESOURCE = (GROUP, VERSION, PLURAL)
_CHILD_LABELS = {"app.kubernetes.io/managed-by": "brook-operator"}
#: Seconds between retries of a failed reconciliation: 1, 2, 4, ... up to 5 minutes.
MAX_BACKOFF_SECONDS = 300.0


def backoff(retry: int) -> float:
    return float(min(2**retry, MAX_BACKOFF_SECONDS))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # our own Events say what changed
    settings.watching.server_timeout = 300
    settings.networking.error_backoffs = [1, 2, 5, 10, 30, 60]
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    if "reconciler" not in memo:
        operator_settings = memo.get("settings") or OperatorSettings(
            engine_image=os.environ.get("BROOK_ENGINE_IMAGE") or OperatorSettings.engine_image
        )
        memo["reconciler"] = Reconciler(KubeClient.from_environment(), operator_settings)
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
        metrics.errors.labels(str(exc.status)).inc()
        metrics.reconciles.labels("error").inc()
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
        metrics.errors.labels(str(result.error.status)).inc()
        metrics.reconciles.labels("error").inc()
        raise kopf.TemporaryError(str(result.error), delay=backoff(retry))
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
        memo["metrics"].errors.labels(str(exc.status)).inc()
        log.warning("%s: status refresh failed: %s", owner, exc)


@kopf.on.event("apps", "v1", "deployments", labels=_CHILD_LABELS)
def deployment_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _refresh_owner(body, memo)


@kopf.on.event(LWS_GROUP, LWS_API_VERSION.split("/")[1], "leaderworkersets", labels=_CHILD_LABELS)
def leader_worker_set_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _refresh_owner(body, memo)


async def _resync(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Every ``RESYNC_SECONDS``: status for each resource (a child event may have been
    missed), and a full reconcile of those Degraded (the LeaderWorkerSet CRD may have been
    installed since, or the API recovered). A loop of the operator's own, not a kopf timer:
    kopf puts a finalizer on every resource that has a timer, and deletion here is left to
    the garbage collector."""
    reconciler: Reconciler = memo["reconciler"]
    namespaces: list[str | None] = list(memo.get("namespaces") or [None])
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=float(memo.get("resync_seconds", 60)))
        if stop.is_set():
            return
        for namespace in namespaces:
            try:
                bodies = await asyncio.to_thread(
                    reconciler.kube.list, f"{GROUP}/{VERSION}", "LLMInference", namespace, ""
                )
            except KubeError as exc:
                memo["metrics"].errors.labels(str(exc.status)).inc()
                log.warning("resync: listing failed: %s", exc)
                continue
            except Exception:  # the loop must outlive any one failure
                log.exception("resync: listing failed")
                continue
            for body in bodies:
                try:
                    await asyncio.to_thread(_resync_one, reconciler, memo, body)
                except Exception:  # one resource's trouble must not end the loop
                    log.exception("resync of %s failed", body["metadata"].get("name"))


def _resync_one(reconciler: Reconciler, memo: kopf.Memo, body: dict[str, Any]) -> None:
    degraded = conditions_by_type(body.get("status")).get("Degraded", {}).get("status") == "True"
    before = dict(body.get("status") or {})
    try:
        if degraded:
            status = reconciler.reconcile(body).status
        else:
            status = reconciler.refresh_status(body) or before
    except KubeError as exc:
        memo["metrics"].errors.labels(str(exc.status)).inc()
        log.warning("resync of %s failed: %s", body["metadata"].get("name"), exc)
        return
    post_transitions(reconciler.kube, body, before, status)


async def _autoscale(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Each autoscaled resource gets a round every ``intervalSeconds``. The operator's own
    loop rather than a kopf timer, for the reason given at ``_resync``; rounds of different
    resources run concurrently, so one slow scrape delays no one else."""
    next_round: dict[tuple[str | None, str], float] = {}
    running: dict[tuple[str | None, str], asyncio.Task[None]] = {}
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        now = time.monotonic()
        autoscaled: dict[tuple[str | None, str], float] = memo.setdefault("autoscaled", {})
        for key in list(next_round):
            if key not in autoscaled:
                del next_round[key]
        for key, interval in list(autoscaled.items()):
            busy = key in running and not running[key].done()
            if busy or next_round.get(key, 0.0) > now:
                continue
            next_round[key] = now + interval
            running[key] = asyncio.create_task(asyncio.to_thread(_autoscale_one, memo, key))
    await asyncio.gather(*running.values(), return_exceptions=True)


def _autoscale_one(memo: kopf.Memo, key: tuple[str | None, str]) -> None:
    autoscaler: Autoscaler = memo["autoscaler"]
    metrics: OperatorMetrics = memo["metrics"]
    try:
        body = autoscaler.kube.get(f"{GROUP}/{VERSION}", "LLMInference", key[0], key[1])
        decision = autoscaler.run_once(body) if body is not None else None
    except KubeError as exc:
        metrics.errors.labels(str(exc.status)).inc()
        metrics.decisions.labels("error").inc()
        log.warning("autoscaling %s/%s failed: %s", key[0], key[1], exc)
        return
    except Exception:  # one resource's trouble must not end the loop
        metrics.decisions.labels("error").inc()
        log.exception("autoscaling %s/%s failed", key[0], key[1])
        return
    if decision is None:
        return
    if not decision.metrics_available:
        outcome = "stale"
    elif decision.desired == decision.current:
        outcome = "hold"
    else:
        outcome = "scale_out" if decision.desired > decision.current else "scale_in"
    metrics.decisions.labels(outcome).inc()


@kopf.on.startup()
async def start_loops(memo: kopf.Memo, **_: Any) -> None:
    stop = asyncio.Event()
    memo["loops_stop"] = stop
    memo["loop_tasks"] = [
        asyncio.create_task(_resync(memo, stop)),
        asyncio.create_task(_autoscale(memo, stop)),
    ]


@kopf.on.cleanup()
async def stop_loops(memo: kopf.Memo, **_: Any) -> None:
    stop: asyncio.Event | None = memo.get("loops_stop")
    if stop is not None:
        stop.set()
        await asyncio.gather(*memo["loop_tasks"])
