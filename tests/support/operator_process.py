"""``brook operator`` as a real child process against a kubeconfig, for the integration and
end-to-end tests: started, waited for (liveness), killed or stopped, its log kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .ports import free_port


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_url: str
    health_url: str

    @classmethod
    def start(
        cls,
        kubeconfig: Path,
        log_path: Path,
        *,
        namespaces: list[str] | None = None,
        engine_image: str = "registry.example/brook-engine:test",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        hub_endpoint: str = "off",
        timeout: float = 60.0,
    ) -> OperatorProcess:
        """``hub_endpoint``: where hf:// models' config.json is read (off: tests reach no
        Hub but a stand-in they start)."""
        metrics_port, health_port = free_port(), free_port()
        scope = [f"--namespace={n}" for n in namespaces] if namespaces else ["--all-namespaces"]
        command = [
            sys.executable,
            "-m",
            "brook_operator.cli",
            "operator",
            *scope,
            f"--kubeconfig={kubeconfig}",
            f"--engine-image={engine_image}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={metrics_port}",
            "--health-address=127.0.0.1",
            f"--health-port={health_port}",
            f"--hub-endpoint={hub_endpoint}",
            *extra_args,
        ]
        environment = {
            **os.environ,
            **(env or {}),
            "KUBECONFIG": str(kubeconfig),
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            command, stdout=log_path.open("ab"), stderr=subprocess.STDOUT, env=environment
        )
        operator = cls(
            proc,
            log_path,
            f"http://127.0.0.1:{metrics_port}/metrics",
            f"http://127.0.0.1:{health_port}/healthz",
        )
        deadline = time.monotonic() + timeout
        while not operator.healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                operator.kill()
                raise AssertionError(f"the operator did not come up:\n{operator.log()}")
            time.sleep(0.1)
        return operator

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return str(response.read().decode())

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return int(self.proc.returncode)
