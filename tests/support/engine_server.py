"""Real engine servers, started as child processes the way a pod starts them
(``brook-engine serve --config FILE``), on any loopback address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from .ports import free_port

API_KEY = "sk-test-0123456789"  # a test key; the server must never log it


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    api_key: str | None

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def get(self, path: str, auth: bool = True) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path)
        if auth and self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, body: bytes | dict[str, Any], auth: bool = True) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        if auth and self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics(self) -> dict[str, float]:
        """Samples by name with labels folded in: ``name{key="value"}``."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.get("/metrics", auth=False)
        assert status == 200
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_server(
    model: Path,
    folder: Path,
    *,
    api_key: str | None = API_KEY,
    drain_timeout: float = 30,
    host: str = "127.0.0.1",
    port: int | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    server: dict[str, Any] | None = None,
    **sections: Any,
) -> ServerProcess:
    """A ready ``brook-engine serve`` on ``host`` (any loopback address) and ``port`` (a
    free one by default); ``env`` adds to its environment; ``server`` to its server section;
    ``wait=False`` returns at once."""
    port = port or free_port()
    server_section: dict[str, Any] = {
        "host": host,
        "port": port,
        "drainTimeoutSeconds": drain_timeout,
        **(server or {}),
    }
    if api_key is not None:
        key_file = folder / "api-key"
        key_file.write_text(api_key + "\n")
        server_section["apiKey"] = {"file": str(key_file)}
    config = {
        "model": {"uri": str(model), "servedName": "tiny", "dtype": "float32"},
        "device": "cpu",
        "server": server_section,
        "kvCache": {"numBlocks": 256, "blockSize": 16},
        **sections,
    }
    config_path = folder / "engine.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = folder / "server.log"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "brook_engine.cli", "serve", "--config", str(config_path)],
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    handle = ServerProcess(proc, f"http://{host}:{port}", log_path, api_key)
    if not wait:
        return handle
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{handle.log()[-3000:]}")
        try:
            if handle.get("/ready", auth=False)[0] == 200:
                return handle
        except OSError:
            pass
        time.sleep(0.2)
    handle.stop()
    pytest.fail(f"the server did not become ready:\n{handle.log()[-3000:]}")
