"""Placing a replica's ranks: from the environment the operator sets in each pod, or all on
this host for a local run; and the worker processes of this host's other devices.

The operator sets, in every pod of a replica: ``BROOK_WORLD_SIZE`` (devices of the replica),
``BROOK_DEVICES_PER_POD``, ``BROOK_POD_RANK`` (the LeaderWorkerSet worker index; 0 for the
leader), ``MASTER_ADDR`` (the leader's address) and ``MASTER_PORT``. A pod's ranks are
``POD_RANK × DEVICES_PER_POD + local device``; global rank 0 (the leader's first device) runs
the scheduler and the HTTP server, every other rank a worker.

Rank 0 starts this host's other ranks as processes (``LocalWorkers``) and joins the group
(``join_group``); a worker loads its part of the model and runs the step plans rank 0 sends
until it says stop (``run_worker``); a pod of a multi-pod replica other than the leader's
runs only workers (``run_worker_pod``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch

from brook_engine.config import ConfigError, EngineConfig, dump_engine_config, parse_engine_config
from brook_engine.core.model_runner import ModelRunner
from brook_engine.device import Backend, resolve_backend
from brook_engine.models.arch import ModelArch, resolve_model_folder
from brook_engine.parallel.comm import Communicator, ParallelGroupError, Rendezvous
from brook_engine.parallel.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class GroupSpec:
    """Where this process's ranks sit in the replica."""

    world_size: int
    devices_per_pod: int
    pod_rank: int
    rendezvous: Rendezvous

    @property
    def first_rank(self) -> int:
        return self.pod_rank * self.devices_per_pod

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.devices_per_pod)

    @classmethod
    def local(cls, config: EngineConfig) -> GroupSpec:
        """Every rank on this host, the store on loopback at a free port."""
        world = config.parallel.world_size
        return cls(world, world, 0, Rendezvous("127.0.0.1", _free_port(), _timeout(config)))

    @classmethod
    def from_environment(
        cls, config: EngineConfig, env: Mapping[str, str] | None = None
    ) -> GroupSpec:
        """The group the operator's variables describe; without them, a local group."""
        env = os.environ if env is None else env
        world = config.parallel.world_size
        if "BROOK_WORLD_SIZE" not in env:
            return cls.local(config)
        values = {
            name: _int(env, name)
            for name in ("BROOK_WORLD_SIZE", "BROOK_DEVICES_PER_POD", "BROOK_POD_RANK")
        }
        if values["BROOK_WORLD_SIZE"] != world:
            raise ConfigError(
                f"BROOK_WORLD_SIZE is {values['BROOK_WORLD_SIZE']} but parallel.tensor × "
                f"parallel.pipeline is {world}; the pod and the engine configuration disagree "
                "(re-render the pod from the same LLMInference)"
            )
        per_pod = values["BROOK_DEVICES_PER_POD"]
        pod_rank = values["BROOK_POD_RANK"]
        if per_pod < 1 or world % per_pod:
            raise ConfigError(
                f"BROOK_DEVICES_PER_POD ({per_pod}) must be at least 1 and divide the world "
                f"size ({world})"
            )
        if not 0 <= pod_rank < world // per_pod:
            raise ConfigError(
                f"BROOK_POD_RANK ({pod_rank}) must be in [0, {world // per_pod}) for "
                f"{world // per_pod} pods"
            )
        host = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
        return cls(world, per_pod, pod_rank, Rendezvous(host, port, _timeout(config)))


def _timeout(config: EngineConfig) -> float:
    return config.parallel.timeout_seconds


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {env.get(name)!r}") from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalWorkers:
    """This host's worker processes (one per device after the first), watched: a worker
    that exits while the replica runs is a failure of the replica."""

    def __init__(self, config: EngineConfig, spec: GroupSpec, ranks: list[int]) -> None:
        context = multiprocessing.get_context("spawn")
        text = dump_engine_config(config, "json")
        threads = max(1, (os.cpu_count() or 1) // spec.devices_per_pod)
        self.processes: dict[int, BaseProcess] = {}
        for rank in ranks:
            process = context.Process(
                target=worker_main,
                args=(text, rank, rank - spec.first_rank, spec, threads),
                name=f"brook-rank-{rank}",
                daemon=True,
            )
            process.start()
            self.processes[rank] = process
        self.stopping = False

    def check(self) -> None:
        """Raise if a worker has exited (unless the replica is shutting down)."""
        if self.stopping:
            return
        for rank, process in self.processes.items():
            if process.exitcode is not None:
                raise ParallelGroupError(
                    f"the worker of rank {rank} exited with status {process.exitcode}; the "
                    "replica cannot run without it"
                )

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for process in self.processes.values():
            process.join(timeout)
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(5)


def run_worker(config: EngineConfig, rank: int, local_rank: int, spec: GroupSpec) -> None:
    """Join the group as ``rank`` and serve step plans until rank 0 stops."""
    backend = resolve_backend(config.device, local_rank)
    topology = Topology(config.parallel.tensor, config.parallel.pipeline, rank)
    comm = Communicator(topology, backend.dist_backend, spec.rendezvous, backend.wait_work)
    try:
        folder = resolve_model_folder(config.model)
        arch = ModelArch.from_folder(folder)
        runner = ModelRunner(config, folder, arch, backend, progress=False, comm=comm)
        log.info(
            "rank %d ready: layers [%d, %d), tensor rank %d of %d",
            rank,
            runner.layer_start,
            runner.layer_end,
            topology.tp_rank,
            topology.tensor,
        )
        while True:
            plan = comm.recv_plan()
            if plan.kind == "stop":
                break
            runner.run_plan(plan)
        runner.shutdown()
    finally:
        comm.close()


def worker_main(
    config_text: str, rank: int, local_rank: int, spec: GroupSpec, threads: int
) -> None:
    """Entry of a spawned worker process."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s"
    )
    torch.set_num_threads(threads)
    try:
        config = parse_engine_config(json.loads(config_text))
        run_worker(config, rank, local_rank, spec)
    except (ParallelGroupError, ConfigError) as exc:
        log.error("rank %d stops: %s", rank, exc)
        sys.exit(1)
    except Exception:
        log.exception("rank %d failed", rank)
        sys.exit(1)


def run_worker_pod(config: EngineConfig, spec: GroupSpec) -> int:
    """A pod of a multi-pod replica other than the leader's: its first rank in this
    process, the others in child processes. Returns the exit status."""
    threads = max(1, len(_affinity()) // spec.devices_per_pod)
    torch.set_num_threads(threads)
    ranks = list(spec.local_ranks)
    workers = LocalWorkers(config, spec, ranks[1:])
    status = 0
    try:
        run_worker(config, ranks[0], 0, spec)
        workers.stopping = True  # rank 0 said stop: the others stop too
    except (ParallelGroupError, ConfigError) as exc:
        log.error("rank %d stops: %s", ranks[0], exc)
        status = 1
    finally:
        workers.stop()
    if any(p.exitcode not in (0, None) for p in workers.processes.values()):
        status = 1
    return status


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def join_group(
    config: EngineConfig, spec: GroupSpec, backend: Backend
) -> tuple[Communicator, LocalWorkers]:
    """Rank 0: start this host's other ranks and join the replica's group with them."""
    if spec.pod_rank != 0:
        raise ConfigError("only the replica's first pod (BROOK_POD_RANK 0) runs the engine")
    if backend.kind == "cpu":  # share this host's cores among its ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.devices_per_pod))
    workers = LocalWorkers(config, spec, list(spec.local_ranks)[1:])
    par = config.parallel
    log.info(
        "replica of %d ranks (tensor %d × pipeline %d), %d on this host; rendezvous at %s:%d",
        par.world_size,
        par.tensor,
        par.pipeline,
        spec.devices_per_pod,
        spec.rendezvous.host,
        spec.rendezvous.port,
    )
    topology = Topology(par.tensor, par.pipeline, 0)
    try:
        comm = _join_watching(
            lambda: Communicator(
                topology, backend.dist_backend, spec.rendezvous, backend.wait_work
            ),
            workers,
        )
    except BaseException:
        workers.stop()
        raise
    return comm, workers


def _join_watching(join: Callable[[], Communicator], workers: LocalWorkers) -> Communicator:
    """Run the rendezvous while watching this host's workers: one that dies before it
    joins fails the start at once instead of after the rendezvous timeout."""
    box: list[Communicator | BaseException] = []
    thread = threading.Thread(
        target=lambda: box.append(_capture(join)), name="brook-rendezvous", daemon=True
    )
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive():
            workers.check()
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _capture(call: Callable[[], Communicator]) -> Communicator | BaseException:
    try:
        return call()
    except BaseException as exc:  # handed to the waiting thread
        return exc
