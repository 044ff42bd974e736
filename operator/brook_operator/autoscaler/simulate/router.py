"""What sends each request to a replica, as the three ways a cluster can route:

- ``service``: a Kubernetes Service (kube-proxy): a replica picked at random per request,
  whatever its load. A replica's backlog stays where it landed.
- ``least-loaded``: an endpoint picker that reads the engines' metrics, as the Gateway API
  Inference Extension's does (``spec.router``): the serving replica with the fewest requests
  waiting or in prefill, ties to the one holding the least KV. Still a push: once sent, a
  request waits at its replica even when a newer replica is idle.
- ``flow-control``: the picker's flow control: a request is held at the gateway (FIFO) until
  some serving replica has a free batch slot and KV room for its prompt, then goes to the
  least-loaded such replica. Queued work therefore lands on whichever replica frees first,
  new ones included. The autoscaler still reads only the replicas (their slots full, their
  own queues empty); the gateway's queue is not one of its signals.

The gateway is looked at on the simulator's tick boundaries, so flow control adds up to one
tick (0.25 s) before a freed slot is refilled.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from brook_operator.autoscaler.simulate.replica import Job, Replica
from brook_operator.autoscaler.simulate.simulation_error import SimulationError

ROUTERS = ("service", "least-loaded", "flow-control")
DEFAULT_ROUTER = "least-loaded"


class Router:
    """Moves requests from the gateway's queue to serving replicas, in ``mode``'s way."""

    def __init__(self, mode: str = DEFAULT_ROUTER, seed: int = 0) -> None:
        if mode not in ROUTERS:
            raise SimulationError(f"router {mode!r}: choose one of {', '.join(ROUTERS)}")
        self.mode = mode
        self._random = random.Random(seed)  # a run is reproducible

    def route(self, gateway: deque[Job], serving: Sequence[Replica]) -> None:
        """Send what this mode sends now; what stays in ``gateway`` waits there."""
        if not serving:
            return
        if self.mode == "service":
            while gateway:
                self._random.choice(serving).add(gateway.popleft())
        elif self.mode == "least-loaded":
            while gateway:
                min(serving, key=_load).add(gateway.popleft())
        else:
            while gateway:
                open_ = [r for r in serving if has_room(r, gateway[0])]
                if not open_:
                    return
                min(open_, key=_load).add(gateway.popleft())


def _load(replica: Replica) -> tuple[int, float]:
    return len(replica.waiting) + len(replica.prefilling), replica.kv_held


def has_room(replica: Replica, job: Job) -> bool:
    """A free batch slot, counting requests sent but not admitted yet, and KV room for the
    prompt beside what the replica holds and has been sent; none while a preemption blocks
    admission."""
    profile = replica.profile
    if replica.blocked:  # it preempted: it admits nothing until a request finishes
        return False
    if len(replica.waiting) + replica.num_running >= profile.max_num_seqs:
        return False
    sent = sum(j.prompt for j in replica.waiting)
    return replica.kv_held + sent + job.prompt <= profile.kv_cache_tokens
