"""The operator's own background loops, started and stopped by ``handlers``: a periodic
resync of every resource's status (``resync``) and the autoscaler's rounds (``autoscale``).
Loops of the operator's own, not kopf timers: kopf puts a finalizer on every resource that
has a timer, and deletion here is left to the garbage collector.

Every resource gets its own task in both loops, run on the loops' own thread pool
(``Runner``): one resource whose API calls hang delays no other, and a round waits for it
at most ``round_timeout_seconds``. Every API call times out (``KubeClient.timeout_seconds``),
so a hung call ends; until it has, its resource counts as busy and gets no second call on
top.

Both read what they need from the operator's ``kopf.Memo`` (the reconciler, the autoscaler,
the metrics, ``namespaces``, ``resync_seconds``, ``round_timeout_seconds``, and
``autoscaled``, which the ``track`` handler keeps); they share one ``runner``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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

Key = tuple[str | None, str]
#: How long a round waits for one resource (a call still running after that goes on in
#: the background; its resource is skipped until it ends).
DEFAULT_ROUND_TIMEOUT_SECONDS = 120.0
#: Threads of the loops' pool: resources worked on at once.
MAX_WORKERS = 16


@dataclass
class Runner:
    """Runs one blocking call per resource on a thread pool of its own: at most one at a
    time per resource and per loop, each waited for at most ``timeout`` seconds."""

    timeout: float = DEFAULT_ROUND_TIMEOUT_SECONDS
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="brook-loop")
    )
    running: dict[tuple[str, Key], Future[None]] = field(default_factory=dict)

    def busy(self, loop: str, key: Key) -> bool:
        future = self.running.get((loop, key))
        return future is not None and not future.done()

    def start(self, loop: str, key: Key, call: Callable[[], None]) -> Future[None] | None:
        """Start ``call`` for ``key`` unless one is still running (then None)."""
        if self.busy(loop, key):
            log.warning("%s of %s/%s: the last one is still running; skipped", loop, *key)
            return None
        self.running = {k: f for k, f in self.running.items() if not f.done()}
        future = self.executor.submit(call)
        self.running[(loop, key)] = future
        return future

    async def wait(self, loop: str, started: dict[Key, Future[None]]) -> None:
        """Wait for these calls, each at most ``timeout`` seconds (all at once)."""
        if not started:
            return
        waiting = {asyncio.wrap_future(f): key for key, f in started.items()}
        _, late = await asyncio.wait(waiting, timeout=self.timeout)
        for future in late:
            log.warning(
                "%s of %s/%s: no answer within %.0f s; the others went on",
                loop, *waiting[future], self.timeout,
            )  # fmt: skip

    async def close(self, timeout: float = 10.0) -> None:
        """Let running calls end (at most ``timeout`` seconds), then stop the pool."""
        running = [asyncio.wrap_future(f) for f in self.running.values() if not f.done()]
        if running:
            await asyncio.wait(running, timeout=timeout)
        self.executor.shutdown(wait=False, cancel_futures=True)


def runner(memo: kopf.Memo) -> Runner:
    """The loops' ``Runner`` (made on first use, waiting ``round_timeout_seconds``)."""
    if "runner" not in memo:
        timeout = float(memo.get("round_timeout_seconds") or DEFAULT_ROUND_TIMEOUT_SECONDS)
        memo["runner"] = Runner(timeout=timeout)
    found: Runner = memo["runner"]
    return found


async def resync(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Every ``resync_seconds``: status for each resource (a child event may have been
    missed), and a full reconcile of those Degraded (the LeaderWorkerSet CRD may have been
    installed since, a foreign object removed, or the API recovered)."""
    reconciler: Reconciler = memo["reconciler"]
    pool = runner(memo)
    namespaces: list[str | None] = list(memo.get("namespaces") or [None])
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=float(memo.get("resync_seconds", 60)))
        if stop.is_set():
            return
        started: dict[Key, Future[None]] = {}
        for namespace in namespaces:
            try:
                bodies = await asyncio.wait_for(
                    asyncio.to_thread(
                        reconciler.kube.list, f"{GROUP}/{VERSION}", "LLMInference", namespace, ""
                    ),
                    timeout=pool.timeout,
                )
            except KubeError as exc:
                memo["metrics"].api_error(exc)
                log.warning("resync: listing failed: %s", exc)
                continue
            except Exception:  # the loop must outlive any one failure
                log.exception("resync: listing failed")
                continue
            for body in bodies:
                key: Key = (body["metadata"].get("namespace"), str(body["metadata"]["name"]))

                def one(body: dict[str, Any] = body) -> None:
                    _resync_one(reconciler, memo, body)

                future = pool.start("resync", key, one)
                if future is not None:
                    started[key] = future
        await pool.wait("resync", started)


def _resync_one(reconciler: Reconciler, memo: kopf.Memo, body: dict[str, Any]) -> None:
    metadata = body["metadata"]
    try:
        degraded = conditions_by_type(body.get("status")).get("Degraded", {})
        before = dict(body.get("status") or {})
        if degraded.get("status") == "True":
            # Reconcile the resource as it is now, not as listed: a newer spec may have
            # been applied by its update handler since.
            fresh = reconciler.kube.get(
                f"{GROUP}/{VERSION}", "LLMInference", metadata.get("namespace"), metadata["name"]
            )
            if fresh is None:
                return
            before = dict(fresh.get("status") or {})
            status = reconciler.reconcile(fresh).status
        else:
            status = reconciler.refresh_status(body) or before
    except KubeError as exc:
        memo["metrics"].api_error(exc)
        log.warning("resync of %s failed: %s", metadata.get("name"), exc)
        return
    except Exception:  # one resource's trouble must not end the loop
        log.exception("resync of %s failed", metadata.get("name"))
        return
    post_transitions(reconciler.kube, body, before, status)


async def autoscale(memo: kopf.Memo, stop: asyncio.Event) -> None:
    """Each autoscaled resource gets a round every ``intervalSeconds``; rounds of different
    resources run concurrently, so one slow scrape or hung call delays no one else."""
    pool = runner(memo)
    next_round: dict[Key, float] = {}
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        now = time.monotonic()
        autoscaled: dict[Key, float] = memo.setdefault("autoscaled", {})
        for key in list(next_round):
            if key not in autoscaled:
                del next_round[key]
        for key, interval in list(autoscaled.items()):
            if pool.busy("autoscale", key) or next_round.get(key, 0.0) > now:
                continue
            next_round[key] = now + interval

            def one(key: Key = key) -> None:
                _autoscale_one(memo, key)

            pool.start("autoscale", key, one)


def _autoscale_one(memo: kopf.Memo, key: Key) -> None:
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
