"""``brook monitor`` against the emulated kube-apiserver and a real engine server on
loopback: the resource's status from the API server, the engine's ``/metrics`` through the
API server's pod proxy (the emulator forwards to the pod's ``status.podIP``, which the test
sets to 127.0.0.1 where the engine listens). The table prints live figures; the dashboard,
drawn with Rich's console capture on frames recorded from that engine, shows every panel;
``--prometheus`` reads the same figures from a Prometheus query API."""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from brook_operator.cli import main
from brook_operator.kube import KubeClient
from brook_operator.monitor import dashboard
from brook_operator.monitor.figures import History
from brook_operator.monitor.sources import ClusterSource
from brook_operator.render.labels import INSTANCE_LABEL, ROLE_LABEL
from support.engine_server import ServerProcess, start_server
from support.kube_api import KubeApi, PodServer

REPO = Path(__file__).resolve().parents[3]
NAME, NAMESPACE, POD = "tiny-cpu", "default", "tiny-cpu-7d9f-abc12"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The engine of the resource's one replica: FP8 KV for the first half of the layers."""
    handle = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("monitor-engine"),
        api_key=None,
        kvCache={
            "numBlocks": 128,
            "layerPolicies": [
                {"start": 0.0, "end": 0.5, "dtype": "fp8_e4m3"},
                {"start": 0.5, "end": 1.0, "dtype": "auto"},
            ],
            "dynamicPrecision": {"enabled": False},
        },
    )
    for _ in range(3):
        _complete(handle)
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


def _complete(engine: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    status, reply = engine.post("/v1/completions", body)
    assert status == 200, reply


def _resource(kube_api: KubeApi) -> None:
    """tiny-cpu, autoscaled, with the status the operator and its autoscaler would write."""
    obj = yaml.safe_load((REPO / "crds" / "examples" / "tiny-cpu.yaml").read_text())
    obj["metadata"]["namespace"] = NAMESPACE
    del obj["spec"]["replicas"]
    obj["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    kube_api.apply(obj, manager="test")
    decision = {
        "time": "2026-12-06T10:00:00Z",
        "fromReplicas": 2,
        "toReplicas": 1,
        "reason": "KV-cache usage 0.12 below target 0.7 for 300 s",
        "limitedBy": "AtMin",
    }
    status = {
        "observedGeneration": 1,
        "replicas": 1,
        "readyReplicas": 1,
        "desiredReplicas": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Serving",
                "message": "1/1 replicas ready",
                "lastTransitionTime": "2026-12-06T09:00:00Z",
            }
        ],
        "autoscaling": {
            "signals": {"kvCacheUsage": 0.12, "waitingRequests": 0, "replicasReporting": 1},
            "lastDecisions": [decision],
        },
    }
    kube_api.set_status("llmi", NAME, status, NAMESPACE)


def _pod(kube_api: KubeApi, name: str, port: int, ip: str | None = "127.0.0.1") -> None:
    """An engine leader pod as the kubelet reports it, its IP where the engine listens."""
    kube_api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {INSTANCE_LABEL: NAME, ROLE_LABEL: "leader"},
            },
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": "brook-engine:test",
                        "ports": [{"name": "http", "containerPort": port}],
                    }
                ]
            },
        }
    )
    status: dict[str, Any] = {"phase": "Running"}
    if ip is not None:
        status["podIP"] = ip
    kube_api.set_status("pods", name, status, NAMESPACE)


def _port(engine: ServerProcess) -> int:
    return int(engine.url.rsplit(":", 1)[1])


def _table_row(out: str, name: str) -> list[str]:
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "READY", "KV"], out
    [row] = [line.split() for line in lines[1:] if line.split()[:1] == [name]]
    return row


def test_table_reads_the_status_and_the_metrics_through_the_pod_proxy(
    brook_crd: dict[str, Any],
    kube_api: KubeApi,
    engine: ServerProcess,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _resource(kube_api)
    _pod(kube_api, POD, _port(engine))
    assert main(["monitor", "--interval", "0.2"]) == 0
    row = _table_row(capsys.readouterr().out, NAME)
    # NAME READY KV WAITING RUNNING TOKENS/S TTFT TPOT PREFIX OVERLAP
    assert row[1] == "1/1"
    assert row[2].endswith("%") and row[3] == "0" and row[4] == "0"
    ttft_p50, ttft_p99 = row[6].split("/")
    assert ttft_p50 != "-" and ttft_p99 != "-"  # since the engine started: three requests
    assert row[9] == "100%"  # one device: no communication to hide
    proxied = [r for r in kube_api.requests if r.resource == "pods/proxy"]
    assert proxied and all(r.verb == "get" for r in proxied)


def test_dashboard_shows_every_panel_on_recorded_frames(
    brook_crd: dict[str, Any], kube_api: KubeApi, engine: ServerProcess, tmp_path: Path
) -> None:
    _resource(kube_api)
    _pod(kube_api, POD, _port(engine))
    _pod(kube_api, "tiny-cpu-7d9f-nopip", 8000, ip=None)  # scheduled, no IP yet
    source = ClusterSource(KubeClient.from_environment(), NAMESPACE, NAME)
    history = History(window_seconds=60)
    frames = []
    for _ in range(3):  # recorded: three reads with requests served between them
        frames.append(source.read())
        history.add(frames[-1])
        _complete(engine)
    console = Console(record=True, width=150, height=48, file=io.StringIO())
    console.print(dashboard.render(f"{NAMESPACE}/{NAME}", frames[-1], history, "pod proxy"))
    screen = console.export_text()
    for title in dashboard.PANELS:
        assert title in screen, f"panel {title!r} missing:\n{screen}"
    assert "default/tiny-cpu" in screen and "replicas 1/1 ready" in screen
    assert "2→1" in screen and "KV-cache usage 0.12 below target" in screen  # the decision
    assert "AtMin" in screen
    precision = next(line for line in screen.splitlines() if "precision" in line)
    assert "2 fp8_e4m3" in precision, precision  # the first half of 4 layers: FP8
    assert POD in screen and "metrics read" in screen
    assert "tiny-cpu-7d9f-nopip" in screen and "no IP" in screen  # the replica's problem
    assert "tok/s" in screen and "TTFT P99" in screen
    latency = next(line for line in screen.splitlines() if "TTFT P50" in line)
    assert latency.rstrip("│ ").endswith("ms"), latency  # a figure, not a dash
    offload = next(line for line in screen.splitlines() if "cold start" in line)
    assert "ready" in offload and "s" in offload.split("ready", 1)[1]


def test_dashboard_command_writes_a_screenshot(
    brook_crd: dict[str, Any], kube_api: KubeApi, engine: ServerProcess, tmp_path: Path
) -> None:
    _resource(kube_api)
    _pod(kube_api, POD, _port(engine))
    svg = tmp_path / "monitor.svg"
    args = ["monitor", NAME, "--dashboard", "--frames", "2", "--interval", "0.2"]
    assert main([*args, "--screenshot", str(svg)]) == 0
    text = svg.read_text()
    assert text.startswith("<svg") and "Throughput" in text and "Autoscaler" in text


def test_what_cannot_be_watched_is_said(
    brook_crd: dict[str, Any], kube_api: KubeApi, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["monitor", "missing"]) == 1
    assert "LLMInference default/missing not found" in capsys.readouterr().err
    assert main(["monitor", "-n", "empty"]) == 1
    assert "no LLMInference in namespace empty" in capsys.readouterr().err
    assert main(["monitor", "--screenshot", "x.svg"]) == 2
    assert "--frames" in capsys.readouterr().err
    assert main(["monitor", "-A", NAME]) == 2
    assert "-n" in capsys.readouterr().err
    _resource(kube_api)
    _pod(kube_api, POD, 9, ip=None)
    assert main(["monitor", "--interval", "0.1"]) == 0  # a replica without figures: dashes
    row = _table_row(capsys.readouterr().out, NAME)
    assert row[1] == "1/1" and set(row[2:]) == {"-"}


def test_an_engine_that_wants_its_api_key_for_metrics_is_named(
    brook_crd: dict[str, Any], kube_api: KubeApi
) -> None:
    """An engine with ``server.metricsRequireApiKey`` answers the proxy 401 (the pod side here
    is a plain HTTP server answering as the engine does)."""
    _resource(kube_api)
    with PodServer() as pod:
        body = '{"error": {"message": "missing API key", "type": "invalid_request_error"}}'
        pod.answer("/metrics", body, status=401, content_type="application/json")
        _pod(kube_api, POD, pod.port)
        frame = ClusterSource(KubeClient.from_environment(), NAMESPACE, NAME).read()
    assert not frame.readings
    assert "missing API key" in frame.errors[POD]
    assert "metricsRequireApiKey" in frame.errors[POD] and "--prometheus" in frame.errors[POD]


class _Prometheus(BaseHTTPRequestHandler):
    """Prometheus's instant-query API (``/api/v1/query``), answered from the engine's own
    /metrics labelled as a pod monitor labels them. A stand-in: no Prometheus server runs
    here; the answer's format is Prometheus's documented one."""

    engine_url = ""
    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query).get("query", [""])[0]
        type(self).queries.append(query)
        with urllib.request.urlopen(self.engine_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        result = [
            {
                "metric": {"__name__": s.name, **s.labels, "namespace": NAMESPACE, "pod": POD},
                "value": [time.time(), repr(s.value)],
            }
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("brook_engine_")
        ]
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        del args


def test_prometheus_gives_the_same_figures(
    brook_crd: dict[str, Any],
    kube_api: KubeApi,
    engine: ServerProcess,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _resource(kube_api)
    _pod(kube_api, POD, _port(engine))
    handler = type("Prometheus", (_Prometheus,), {"engine_url": engine.url, "queries": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["monitor", NAME, "--prometheus", url, "--interval", "0.2"]) == 0
    finally:
        server.shutdown()
    row = _table_row(capsys.readouterr().out, NAME)
    assert row[1] == "1/1" and row[2].endswith("%") and row[6] != "-"
    assert handler.queries and f'namespace="{NAMESPACE}"' in handler.queries[0]
    assert f'pod=~"{POD}"' in handler.queries[0]
    assert not [r for r in kube_api.requests if r.resource == "pods/proxy"]
