"""The operator's own background loops, started and stopped by ``handlers``: a periodic
resync of every resource's status (``resync``) and the autoscaler's rounds (``autoscale``).
Loops of the operator's own, not kopf timers: kopf puts a finalizer on every resource that
has a timer, and deletion here is left to the garbage collector.

Both read what they need from the operator's ``kopf.Memo`` (the reconciler, the autoscaler,
the metrics, ``namespaces``, ``resync_seconds``, and ``autoscaled``, which the ``track``
handler keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import kopf

from brook_operator.api import GROUP, VERSION
from brook_operator.autoscaler.loop import Autoscaler
from brook_operator.controller import Reconciler
from brook_operator.controller.conditions import conditions_by_type
from brook_operator.controller.events import post_transitions
from brook_operator.kube import KubeError
from brook_operator.operator_metrics import OperatorMetrics

log = logging.getLogger(__name__)


async def resync(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Every ``resync_seconds``: status for each resource (a child event may have been
    missed), and a full reconcile of those Degraded (the LeaderWorkerSet CRD may have been
    installed since, or the API recovered)."""
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
                memo["metrics"].api_error(exc)
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
        memo["metrics"].api_error(exc)
        log.warning("resync of %s failed: %s", body["metadata"].get("name"), exc)
        return
    post_transitions(reconciler.kube, body, before, status)


async def autoscale(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Each autoscaled resource gets a round every ``intervalSeconds``; rounds of different
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
        metrics.api_error(exc)
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
