"""Serving overhead: the same workload through ``brook-engine serve`` over HTTP (streaming,
N concurrent clients on loopback) as through the offline API with the same concurrency.

The client is a small stdlib asyncio one (HTTP/1.0, so the server closes each stream and no
chunked decoding is needed): its own cost stays out of the figure as far as it can on a
machine that also runs the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from brook_engine.bench.run import BenchReport
from brook_engine.bench.workload import Workload
from brook_engine.config import EngineConfig, dump_engine_config
from brook_engine.llm import engine_config_from_options


class ServingBenchError(RuntimeError):
    """The server under test failed to start or to answer."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text("utf-8", errors="replace")[-2000:]
            raise ServingBenchError(f"the server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise ServingBenchError(f"the server was not ready within {timeout:.0f} s")


async def _stream_one(
    port: int, model: str, prompt: list[int], max_tokens: int
) -> tuple[float | None, int]:
    """(seconds to the first text event, completion tokens) of one streamed completion."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise ServingBenchError(f"the server answered {status!r}: {await reader.read(2000)!r}")
    ttft: float | None = None
    tokens = 0
    async for line in reader:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if ttft is None and event["choices"] and event["choices"][0]["text"]:
            ttft = time.monotonic() - started
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
    writer.close()
    return ttft, tokens


async def _drive(
    port: int, model: str, workload: Workload, concurrency: int, progress: bool
) -> tuple[float, list[float], int]:
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(workload.prompts), desc="brook (http)", disable=not progress)

    async def one(i: int) -> tuple[float | None, int]:
        async with gate:
            result = await _stream_one(port, model, workload.prompts[i], workload.max_tokens[i])
            bar.update(1)
            return result

    await _stream_one(port, model, workload.prompts[0][:16], 4)  # warm-up
    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    elapsed = time.perf_counter() - started
    bar.close()
    ttfts = [t for t, _ in results if t is not None]
    return elapsed, ttfts, sum(n for _, n in results)


def run_http(
    config: EngineConfig, workload: Workload, concurrency: int, progress: bool = True
) -> BenchReport:
    """Start a server for ``config`` on a free loopback port, stream ``workload`` through it
    with ``concurrency`` clients, stop the server."""
    port = _free_port()
    config = engine_config_from_options(
        None, {"server": {"host": "127.0.0.1", "port": port, "api_key": None}}, config
    )
    with tempfile.TemporaryDirectory(prefix="brook-bench-") as folder:
        config_path = Path(folder) / "engine.yaml"
        config_path.write_text(dump_engine_config(config), "utf-8")
        log = Path(folder) / "server.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "brook_engine.cli", "serve", "--config", str(config_path)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc, log, timeout=600)
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
                model = json.loads(response.read())["data"][0]["id"]
            elapsed, ttfts, generated = asyncio.run(
                _drive(port, model, workload, concurrency, progress)
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return BenchReport.measured(
        "brook (http)",
        f"serve×{concurrency}",
        requests=len(workload.prompts),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=generated,
        elapsed_s=elapsed,
        ttft=ttfts,
    )
