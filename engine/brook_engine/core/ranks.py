"""Placing a replica's ranks: from the environment the operator sets in each pod, or all on
this host for a local run; and the worker processes of this host's other devices.

The operator sets, in every pod of a replica: ``BROOK_WORLD_SIZE`` (devices of the replica),
``BROOK_DEVICES_PER_POD``, ``BROOK_POD_RANK`` (the LeaderWorkerSet worker index; 0 for the
leader), ``MASTER_ADDR`` (the leader's address) and ``MASTER_PORT``. A pod's ranks are
``POD_RANK × DEVICES_PER_POD + local device``; global rank 0 (the leader's first device) runs
the scheduler and the HTTP server, every other rank a worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from brook_engine.config import ConfigError, EngineConfig, dump_engine_config
from brook_engine.parallel.comm import ParallelGroupError, Rendezvous

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
        from brook_engine.parallel.worker import worker_main

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
