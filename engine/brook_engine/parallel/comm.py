"""The replica's process group and every collective the model and the engine use, timed for
the overlap monitor.

A failure of any of them (a peer died, or did not answer within ``parallel.timeoutSeconds``)
is raised as ``ParallelGroupError``: the replica cannot go on without that rank, so the
engine treats it as fatal. So is a host message that is not what the receiver expects: host
messages are JSON read strictly into their types (``parallel.wire``), never pickle.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from brook_engine.parallel import wire
from brook_engine.parallel.overlap import Counters, OverlapMonitor
from brook_engine.parallel.plan import StepPlan, StepResults
from brook_engine.parallel.topology import Topology

log = logging.getLogger(__name__)

T = TypeVar("T")


class ParallelGroupError(RuntimeError):
    """A rank of the replica failed or stopped answering."""


# Tags of the host messages between ranks (activations use the micro-batch index); a
# message's bytes follow its length, with the next tag.
_TAG_PLAN_SIZE, _TAG_RESULT_SIZE, _TAG_COUNTERS, _TAG_START_SIZE = 1, 1001, 1003, 1004


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens, and how long everyone waits for everyone."""

    host: str
    port: int
    timeout_seconds: float


def _guard(what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except ParallelGroupError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:  # gloo/NCCL/HCCL raise RuntimeError
        raise ParallelGroupError(f"{what} failed: {exc}") from exc


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen_socket(host: str, port: int) -> socket.socket:
    """Rank 0's store socket, bound to the rendezvous address only (torch's own store
    binds every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ParallelGroupError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous: {exc.strerror}; "
            "MASTER_ADDR must be this pod's own address and MASTER_PORT free"
        ) from exc
    sock.listen(128)
    return sock


class Communicator:
    """One rank's view of the replica: its topology, the groups, timed communication."""

    def __init__(
        self,
        topology: Topology,
        backend: str,
        rendezvous: Rendezvous,
        wait_work: Callable[[Any], None] | None = None,
    ) -> None:
        self.topology = topology
        self.monitor = OverlapMonitor(topology.stage, topology.pipeline)
        self.blocking_sends = False  # the benchmark's "blocking transfers" baseline
        timeout = timedelta(seconds=rendezvous.timeout_seconds)
        if backend == "gloo" and _is_loopback(rendezvous.host):
            # Every rank is on this host: keep gloo's own listeners off the network too.
            for name in ("lo", "lo0"):
                if os.path.exists(f"/sys/class/net/{name}"):
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
                    break
        listener = _listen_socket(rendezvous.host, rendezvous.port) if topology.is_driver else None
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                rendezvous.host,
                rendezvous.port,
                topology.world_size,
                topology.is_driver,
                timeout=timeout,
                master_listen_fd=listener.fileno() if listener else None,
                use_libuv=False,
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=topology.rank,
                world_size=topology.world_size,
                timeout=timeout,
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise ParallelGroupError(
                f"rank {topology.rank} of {topology.world_size} could not join the replica at "
                f"{rendezvous.host}:{rendezvous.port} within {rendezvous.timeout_seconds:.0f} s "
                f"({exc}); check that every pod of the replica started and MASTER_ADDR/"
                "MASTER_PORT point at rank 0"
            ) from exc
        finally:
            if listener is not None:  # handed to the store, which owns (and closes) it
                listener.detach()
        self._store = store
        # Step plans, sampled tokens and counters are host objects: on accelerators they go
        # over a gloo group of their own (NCCL/HCCL move device tensors only).
        self.control_group: Any = (
            None
            if backend == "gloo"
            else dist.new_group(list(range(topology.world_size)), timeout=timeout, backend="gloo")
        )
        # Every rank creates every stage's group, in the same order (torch requires it).
        self.tp_group: Any = None
        for stage in range(topology.pipeline):
            group = dist.new_group(topology.stage_ranks(stage), timeout=timeout)
            if stage == topology.stage:
                self.tp_group = group
        # Step plans get a group of their own whose wait never times out: a worker waits
        # for the next plan as long as the replica idles (a dead rank 0 still breaks its
        # connection at once, and rank 0's heartbeats find dead workers).
        self.plan_group: Any = dist.new_group(
            list(range(topology.world_size)), timeout=timedelta(days=365), backend="gloo"
        )
        self._watcher = _CompletionWatcher(self.monitor, wait_work or (lambda work: work.wait()))
        self._plan_sends: deque[Sent] = deque()

    # -- tensor parallel -----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place (blocking: the next matmul
        needs it)."""
        start = time.perf_counter()
        _guard("all-reduce", lambda: dist.all_reduce(tensor, group=self.tp_group))
        self.monitor.blocking("all_reduce", start, time.perf_counter())
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate the tensor-parallel ranks' shards along the last dimension."""
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.topology.tensor)]
        _guard("all-gather", lambda: dist.all_gather(parts, tensor, group=self.tp_group))
        self.monitor.blocking("all_gather", start, time.perf_counter())
        return torch.cat(parts, dim=-1)

    # -- pipeline ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        """Send activations to the next stage: asynchronously, unless the blocking baseline
        is on. The tensor must stay alive until ``wait``."""
        start = time.perf_counter()
        if self.blocking_sends:
            _guard("send", lambda: dist.send(tensor, dst, tag=tag))
            self.monitor.blocking("p2p", start, time.perf_counter())
            return Pending(None, tensor, None)
        return self._watcher.submit("p2p", lambda: dist.isend(tensor, dst, tag=tag), tensor)

    def all_reduce_async(self, tensor: torch.Tensor) -> Pending:
        """Start summing ``tensor`` over the stage's tensor-parallel ranks; ``wait()`` gives
        it back reduced. Every asynchronous operation is issued by one communication
        thread, in submission order, so all ranks issue the same collectives in the same
        order."""
        group = self.tp_group
        return self._watcher.submit(
            "all_reduce", lambda: dist.all_reduce(tensor, group=group, async_op=True), tensor
        )

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> Pending:
        """Post a receive; ``wait()`` on it before reading ``buffer``."""
        work = _guard("irecv", lambda: dist.irecv(buffer, src, tag=tag))
        return Pending(work, buffer, None)

    # -- control -------------------------------------------------------------------------

    def broadcast_object(self, obj: Any, kind: Any) -> Any:
        """Rank 0's ``obj``, of type ``kind``, to every rank (the others pass None); a
        collective, for start-up only: step plans go by ``send_plan``."""
        if not self.topology.is_driver:
            return self._recv_encoded(0, _TAG_START_SIZE, self.plan_group, "broadcast", kind)
        for dst in range(1, self.topology.world_size):
            self._send_encoded(obj, dst, _TAG_START_SIZE, self.plan_group, "broadcast").wait()
        return obj

    def send_plan(self, plan: StepPlan, keep: int = 1) -> None:
        """Rank 0: send a step plan to every other rank without waiting for them to take it,
        so rank 0 can run ahead of the later stages by up to ``keep`` plans (sends older
        than that are waited for here, which also surfaces a lost rank)."""
        start = time.perf_counter()
        size, payload = wire.to_tensors(plan)
        works = [
            self._isend(tensor, dst, _TAG_PLAN_SIZE + i, self.plan_group, "step-plan send")
            for dst in range(1, self.topology.world_size)
            for i, tensor in enumerate((size, payload))
        ]
        self._plan_sends.append(Sent(works, [size, payload], "step-plan send"))
        while len(self._plan_sends) > max(1, keep):
            self._plan_sends.popleft().wait()
        self.monitor.control(time.perf_counter() - start)

    def recv_plan(self) -> StepPlan:
        """The next step plan from rank 0 (waits as long as the replica idles)."""
        plan: StepPlan = self._recv_encoded(0, _TAG_PLAN_SIZE, self.plan_group, "plan", StepPlan)
        return plan

    def drain_plans(self, timeout_seconds: float) -> None:
        """Wait until every plan sent so far was taken (before leaving the group)."""
        limit = timedelta(seconds=timeout_seconds)
        while self._plan_sends:
            self._plan_sends.popleft().wait(limit)

    def send_object(self, obj: Any, dst: int) -> Sent:
        """Send the sampled tokens (``StepResults``) without waiting for ``dst`` to take it."""
        start = time.perf_counter()
        sent = self._send_encoded(obj, dst, _TAG_RESULT_SIZE, self.control_group, "result send")
        self.monitor.control(time.perf_counter() - start)
        return sent

    def recv_object(self, src: int) -> Any:
        """``src``'s sampled tokens (untimed: the wait is the pipeline's latency)."""
        return self._recv_encoded(src, _TAG_RESULT_SIZE, self.control_group, "result", StepResults)

    def send_counters(self, counters: Counters) -> Sent:
        """A rank's overlap counters to rank 0, without waiting."""
        tensor = torch.tensor(counters.vector(), dtype=torch.float64)
        work = self._isend(tensor, 0, _TAG_COUNTERS, self.control_group, "counter send")
        return Sent([work], [tensor], "counter send")

    def recv_counters(self, like: Counters) -> Counters:
        """Rank 0: ``like`` (its own counters) plus every other rank's for the same step."""
        total = torch.tensor(like.vector(), dtype=torch.float64)
        for src in range(1, self.topology.world_size):
            part = torch.empty_like(total)
            self._recv(part, src, _TAG_COUNTERS, self.control_group, "counter receive")
            total += part
        return Counters.from_vector(total.tolist())

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int, group: Any, what: str) -> Any:
        return _guard(what, lambda: dist.isend(tensor, dst, group=group, tag=tag))

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, group: Any, what: str) -> None:
        work = _guard(what, lambda: dist.irecv(tensor, src, group=group, tag=tag))
        _wait(work, what)

    def _send_encoded(self, obj: Any, dst: int, size_tag: int, group: Any, what: str) -> Sent:
        """A host message: its length (tag ``size_tag``), then its bytes (``size_tag + 1``)."""
        tensors = wire.to_tensors(obj)
        works = [self._isend(t, dst, size_tag + i, group, what) for i, t in enumerate(tensors)]
        return Sent(works, list(tensors), what)

    def _recv_encoded(self, src: int, size_tag: int, group: Any, what: str, kind: Any) -> Any:
        """The host message from ``src``, read as ``kind`` (a bad one ends the replica)."""
        size, receive, where = wire.size_tensor(), f"{what} receive", f"{what} from rank {src}"
        self._recv(size, src, size_tag, group, receive)
        payload = _guard(receive, lambda: wire.buffer(size, where))
        self._recv(payload, src, size_tag + 1, group, receive)
        return _guard(receive, lambda: wire.decode_tensor(payload, kind, where))

    def gather_object(self, obj: Any, kind: Any) -> list[Any] | None:
        """Every rank's ``obj`` (of type ``kind``) at rank 0, by rank (None on the others)."""
        group = self.control_group
        if not self.topology.is_driver:
            self._send_encoded(obj, 0, _TAG_START_SIZE, group, "gather").wait()
            return None
        return [obj] + [
            self._recv_encoded(src, _TAG_START_SIZE, group, "gather", kind)
            for src in range(1, self.topology.world_size)
        ]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        tensor, group = torch.tensor([value], dtype=torch.long), self.control_group
        _guard("all-reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group))
        return int(tensor.item())

    def close(self) -> None:
        self._watcher.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as exc:  # a peer already gone
                log.debug("process group teardown: %s", exc)


def _wait(work: Any, what: str, timeout: timedelta | None = None) -> None:
    if timeout is None:
        _guard(what, work.wait)
    else:
        _guard(what, lambda: work.wait(timeout))


class Sent:
    """Host messages on their way; the tensors stay alive until ``wait``."""

    def __init__(self, works: list[Any], tensors: list[torch.Tensor], what: str) -> None:
        self.works = works
        self.tensors = tensors
        self.what = what

    def wait(self, timeout: timedelta | None = None) -> None:
        for work in self.works:
            _wait(work, self.what, timeout)
        self.works = []


class Pending:
    """An asynchronous send, receive or all-reduce; ``wait()`` returns its tensor once it
    completed. Time spent waiting is reported to the monitor (not compute)."""

    def __init__(
        self, work: Any, tensor: torch.Tensor, monitor: OverlapMonitor | None = None
    ) -> None:
        self.work = work
        self.tensor = tensor
        self.monitor = monitor
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.watched = False
        if work is None and monitor is None:
            self.done.set()

    def wait(self) -> torch.Tensor:
        if not self.done.is_set():
            start = time.perf_counter()
            if self.watched:
                self.done.wait()
            else:
                _guard("receive", self.work.wait)
                self.done.set()
            if self.monitor is not None:
                self.monitor.waited(start, time.perf_counter())
        if self.error is not None:
            raise ParallelGroupError(f"communication failed: {self.error}") from self.error
        return self.tensor


class _CompletionWatcher:
    """The communication thread: issues every asynchronous operation (so issuing costs the
    compute thread nothing) and waits on it, so each one's completion time is known (gloo's
    work objects have no completion callbacks)."""

    def __init__(self, monitor: OverlapMonitor, wait_work: Callable[[Any], None]) -> None:
        self.monitor = monitor
        self.wait_work = wait_work
        self._queue: queue.SimpleQueue[tuple[Pending, str, float, Callable[[], Any]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="brook-comm", daemon=True)
        self._thread.start()

    def submit(self, kind: str, issue: Callable[[], Any], tensor: torch.Tensor) -> Pending:
        pending = Pending(None, tensor, self.monitor)
        pending.watched = True
        self._queue.put((pending, kind, time.perf_counter(), issue))
        return pending

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            pending, kind, start, issue = item
            try:
                pending.work = issue()
                self.wait_work(pending.work)
            except BaseException as exc:  # reported to whoever waits on it
                pending.error = exc
            self.monitor.finished_async(kind, start, time.perf_counter())
            pending.done.set()
