"""A rank other than 0: load this rank's part of the model, then run every step plan rank 0
sends until it says stop. Any failure ends the process with a non-zero status and a
message saying which rank and why."""

from __future__ import annotations

import logging
import sys

import torch

from brook_engine.config import ConfigError, EngineConfig, parse_engine_config
from brook_engine.device import resolve_backend
from brook_engine.parallel.comm import Communicator, ParallelGroupError
from brook_engine.parallel.launch import GroupSpec, LocalWorkers
from brook_engine.parallel.topology import Topology

log = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, local_rank: int, spec: GroupSpec) -> None:
    """Join the group as ``rank`` and serve step plans until rank 0 stops."""
    from brook_engine.llm_engine import resolve_model_folder
    from brook_engine.model_runner import ModelRunner
    from brook_engine.models.arch import ModelArch

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
    import json

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
    import os

    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))
