"""The operator's own loops (``brook_operator.loops``) with a stand-in reconciler: one
resource whose calls hang must not stall the others, in the resync as in the autoscaler."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import CollectorRegistry

from brook_operator import loops
from brook_operator.operator_metrics import OperatorMetrics

HUNG = "hung"


def _body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ai"}, "status": {}}


@dataclass
class FakeKube:
    bodies: list[dict[str, Any]]

    def list(self, *_: Any) -> list[dict[str, Any]]:
        return self.bodies

    def get(self, _api: str, _kind: str, _ns: str | None, name: str) -> dict[str, Any]:
        return _body(name)


@dataclass
class FakeReconciler:
    """``refresh_status`` of the resource named ``hung`` blocks until released; every call
    is recorded with its time."""

    kube: FakeKube
    release: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[str, float]] = field(default_factory=list)

    def refresh_status(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        self.calls.append((name, time.monotonic()))
        if name == HUNG:
            self.release.wait(30)
        return dict(body["status"])


def _memo(reconciler: Any, **extra: Any) -> kopf.Memo:
    return kopf.Memo(
        reconciler=reconciler,
        metrics=OperatorMetrics(CollectorRegistry()),
        resync_seconds=0.05,
        round_timeout_seconds=0.3,
        **extra,
    )


def _names(calls: list[tuple[str, float]], name: str) -> int:
    return sum(1 for n, _ in calls if n == name)


async def test_one_hung_resource_does_not_stall_the_resync_of_the_others() -> None:
    reconciler = FakeReconciler(FakeKube([_body(HUNG), _body("a"), _body("b")]))
    memo = _memo(reconciler)
    stop = asyncio.Event()
    task = asyncio.create_task(loops.resync(memo, stop))
    try:
        deadline = time.monotonic() + 5
        while (
            time.monotonic() < deadline
            and min(_names(reconciler.calls, "a"), _names(reconciler.calls, "b")) < 3
        ):
            await asyncio.sleep(0.05)
        # The others were refreshed round after round while the hung one never returned,
        # and the hung one was not called again on top of itself.
        assert _names(reconciler.calls, "a") >= 3, reconciler.calls
        assert _names(reconciler.calls, "b") >= 3, reconciler.calls
        assert _names(reconciler.calls, HUNG) == 1, reconciler.calls
        # Once its call ends (a timed-out API call does), it gets rounds again.
        reconciler.release.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _names(reconciler.calls, HUNG) < 2:
            await asyncio.sleep(0.05)
        assert _names(reconciler.calls, HUNG) >= 2
    finally:
        reconciler.release.set()
        stop.set()
        await asyncio.wait_for(task, 5)
        await loops.runner(memo).close()


@dataclass
class FakeAutoscaler:
    kube: FakeKube
    release: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[str, float]] = field(default_factory=list)

    def run_once(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self.calls.append((name, time.monotonic()))
        if name == HUNG:
            self.release.wait(30)


async def test_one_hung_autoscaler_round_does_not_stall_the_others() -> None:
    autoscaler = FakeAutoscaler(FakeKube([]))
    memo = _memo(None, autoscaler=autoscaler, autoscaled={("ai", HUNG): 0.1, ("ai", "a"): 0.1})
    stop = asyncio.Event()
    task = asyncio.create_task(loops.autoscale(memo, stop))
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and _names(autoscaler.calls, "a") < 2:
            await asyncio.sleep(0.05)
        assert _names(autoscaler.calls, "a") >= 2, autoscaler.calls
        assert _names(autoscaler.calls, HUNG) == 1, autoscaler.calls
    finally:
        autoscaler.release.set()
        stop.set()
        await asyncio.wait_for(task, 5)
        await loops.runner(memo).close()
