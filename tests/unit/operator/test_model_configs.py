"""The operator's memory plan before scheduling: hf:// models' config.json read from a Hub
(here the loopback stand-in of ``support.hub``, which answers the Hub's file URLs), kept,
and turned into SpecValid=False for a plan that cannot fit or a memory request for a pod
that sets none."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from brook_engine.config import ConfigError
from brook_engine.offload.plan import GIB
from brook_operator.api import LLMInference
from brook_operator.controller import Reconciler
from brook_operator.memory_plan import PROCESS_BYTES, manifest_plan, memory_request_bytes
from brook_operator.model_configs import (
    MAX_CONFIG_BYTES,
    RETRY_SECONDS,
    ConfigUnreadable,
    ModelConfigs,
    check_endpoint,
    config_url,
    read_config,
)
from support import hub

ROOT = Path(__file__).parents[3]
SMOLLM2 = ROOT / "tests" / "data" / "model_configs" / "SmolLM2-135M-Instruct.json"
QWEN_110B = ROOT / "tests" / "data" / "model_configs" / "Qwen1.5-110B-Chat.json"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def smollm2_hub(tmp_path: Path) -> Iterator[hub.Hub]:
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(SMOLLM2, folder / "config.json")
    with hub.serving(folder, REPO) as served:
        yield served


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _resource(**spec: Any) -> LLMInference:
    manifest = yaml.safe_load((ROOT / "crds" / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["model"]["uri"] = f"hf://{REPO}"
    manifest["spec"].update(spec)
    return LLMInference.model_validate(manifest)


def test_config_url_is_the_hubs_file_url() -> None:
    assert config_url("https://huggingface.co/", "hf://Qwen/Qwen2.5-7B", None) == (
        "https://huggingface.co/Qwen/Qwen2.5-7B/resolve/main/config.json"
    )
    assert config_url("https://hf-mirror.example", "hf://org/m", "refs/pr/1") == (
        "https://hf-mirror.example/org/m/resolve/refs%2Fpr%2F1/config.json"
    )
    for uri in ("pvc://claim/m", "s3://bucket/m", "oci://reg/m:1", "file:///models/m"):
        assert config_url("https://huggingface.co", uri, None) is None


def test_a_config_is_read_once_and_kept(smollm2_hub: hub.Hub) -> None:
    configs = ModelConfigs(smollm2_hub.url)
    first = configs.get(f"hf://{REPO}", "main")
    assert first == json.loads(SMOLLM2.read_text())
    assert configs.get(f"hf://{REPO}", "main") == first
    assert smollm2_hub.paths == [f"GET /{REPO}/resolve/main/config.json"]
    assert configs.get("pvc://claim/SmolLM2", None) is None  # not a Hub source: no request
    assert len(smollm2_hub.paths) == 1


def test_a_missing_config_is_logged_once_and_tried_again_later(
    smollm2_hub: hub.Hub, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    configs = ModelConfigs(smollm2_hub.url, clock=clock)
    with caplog.at_level(logging.WARNING):
        assert configs.get("hf://org/private-model", None) is None
        assert configs.get("hf://org/private-model", None) is None  # kept: no new request
        clock.now += RETRY_SECONDS + 1
        assert configs.get("hf://org/private-model", None) is None  # asked again
    assert len(smollm2_hub.paths) == 2
    (warning,) = [r.getMessage() for r in caplog.records if "private-model" in r.getMessage()]
    assert "HTTP 404" in warning and "the engine checks it at start" in warning


@pytest.fixture
def odd_server() -> Iterator[tuple[str, dict[str, bytes | None]]]:
    """A server answering each path with the body set for it (None: never answers)."""
    bodies: dict[str, bytes | None] = {}
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies[self.path]
            if body is None:
                stop.wait(10)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            del args

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_answers_that_are_not_a_config_are_refused(
    odd_server: tuple[str, dict[str, bytes | None]],
) -> None:
    url, bodies = odd_server
    bodies["/list"] = b"[1, 2]"
    bodies["/html"] = b"<html>login</html>"
    bodies["/huge"] = b" " * (MAX_CONFIG_BYTES + 1)
    bodies["/silent"] = None
    for path, why in [
        ("/list", "not a config.json object"),
        ("/html", "not JSON"),
        ("/huge", "larger than"),
        ("/silent", "timed out"),
    ]:
        started = time.monotonic()
        with pytest.raises(ConfigUnreadable, match=why):
            read_config(url + path, timeout=0.5)
        assert time.monotonic() - started < 5, path


def test_a_plan_that_cannot_fit_is_refused_with_the_numbers(smollm2_hub: hub.Hub) -> None:
    reconciler = Reconciler(kube=None, model_configs=ModelConfigs(smollm2_hub.url))  # type: ignore[arg-type]
    llmi = _resource(offload={"policy": "static", "deviceMemoryLimitGb": 0.01})
    _, refusal = reconciler.planned(llmi)
    assert refusal is not None
    assert refusal.startswith(f"memory plan of hf://{REPO}: spec.offload.deviceMemoryLimitGb: ")
    assert "cannot hold rank 0's fixed weights" in refusal and "raise it to" in refusal


def test_a_pod_without_a_memory_request_gets_its_plans(smollm2_hub: hub.Hub) -> None:
    reconciler = Reconciler(kube=None, model_configs=ModelConfigs(smollm2_hub.url))  # type: ignore[arg-type]
    asked = _resource()  # the example asks for 2Gi: kept
    planned, refusal = reconciler.planned(asked)
    assert refusal is None and planned.spec.resources.requests["memory"] == "2Gi"

    bare = _resource(resources={"requests": {"cpu": "2"}})
    planned, refusal = reconciler.planned(bare)
    assert refusal is None
    plan = manifest_plan(bare, json.loads(SMOLLM2.read_text()), None)
    (rank,) = plan.ranks
    # on CPU the host holds every weight and the KV cache (256 blocks, as the example sets)
    assert rank.kv["blocks"] == 256
    expected = rank.device_bytes + rank.kv["bytes"] + PROCESS_BYTES
    assert memory_request_bytes(bare, plan) == expected
    assert planned.spec.resources.requests == {"cpu": "2", "memory": f"{-(-expected // 2**20)}Mi"}
    assert bare.spec.resources.requests == {"cpu": "2"}  # the parsed spec is left as it was
    # SmolLM2 in float32 with its tied head packed: about 0.5 GiB of weights
    assert 0.4 * GIB < rank.device_bytes < 0.8 * GIB


def test_an_accelerator_pod_requests_its_streamed_weights_host_pool() -> None:
    manifest = yaml.safe_load(
        (ROOT / "crds" / "examples" / "qwen-110b-npu-tp4-pp2.yaml").read_text()
    )
    manifest["spec"]["quantization"] = {"weights": "none"}
    manifest["spec"]["offload"] = {"policy": "static", "deviceMemoryLimitGb": 20}
    del manifest["spec"]["resources"]["requests"]["memory"]
    llmi = LLMInference.model_validate(manifest)
    plan = manifest_plan(llmi, json.loads(QWEN_110B.read_text()), None)
    # By hand: each rank streams 13 FFN pieces (test_validate_memory_plan.py) of gate, up
    # and down, 8,192 x 49,152 / TP 4 each in bf16, all held in its pinned pool; a pod
    # runs four ranks (TP=4), each its own process.
    pool = 13 * 3 * 8192 * (49152 // 4) * 2
    assert pool == 7_851_737_088
    assert memory_request_bytes(llmi, plan) == 4 * (pool + PROCESS_BYTES)


def test_without_a_hub_nothing_is_planned() -> None:
    llmi = _resource(offload={"policy": "static", "deviceMemoryLimitGb": 0.01})
    planned, refusal = Reconciler(kube=None).planned(llmi)  # type: ignore[arg-type]
    assert refusal is None and planned is llmi


def test_a_memory_limit_is_left_to_kubernetes(smollm2_hub: hub.Hub) -> None:
    """With a limit and no request Kubernetes requests the limit; a request above it would
    stop the pods from being created."""
    reconciler = Reconciler(kube=None, model_configs=ModelConfigs(smollm2_hub.url))  # type: ignore[arg-type]
    limited = _resource(resources={"limits": {"memory": "1Gi"}})
    planned, refusal = reconciler.planned(limited)
    assert refusal is None and "memory" not in planned.spec.resources.requests


def test_the_last_config_stays_in_use_while_the_hub_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(SMOLLM2, folder / "config.json")
    clock = _Clock()
    with hub.serving(folder, REPO) as served:
        configs = ModelConfigs(served.url, clock=clock)
        first = configs.get(f"hf://{REPO}", None)
        assert first is not None
    clock.now += 2 * 3600  # kept an hour: read again, and the Hub is gone
    with caplog.at_level(logging.WARNING):
        assert configs.get(f"hf://{REPO}", None) == first
        clock.now += RETRY_SECONDS + 1
        assert configs.get(f"hf://{REPO}", None) == first
    (warning,) = [r.getMessage() for r in caplog.records]  # once per outage
    assert "the last one read stays in use" in warning


def test_without_a_plan_the_running_request_is_kept(smollm2_hub: hub.Hub) -> None:
    """A Hub that cannot be reached (an operator restarted meanwhile) must not roll the
    pods: the request the engine container has is kept."""

    class Workload:
        def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
            assert (api_version, kind, name) == ("apps/v1", "Deployment", "tiny-cpu")
            containers = [
                {"name": "fetch-model"},
                {"name": "engine", "resources": {"requests": {"cpu": "2", "memory": "1700Mi"}}},
            ]
            return {"spec": {"template": {"spec": {"containers": containers}}}}

    down = ModelConfigs("http://127.0.0.1:9", timeout=0.5)  # nothing listens on port 9
    reconciler = Reconciler(kube=Workload(), model_configs=down)  # type: ignore[arg-type]
    planned, refusal = reconciler.planned(_resource(resources={"requests": {"cpu": "2"}}))
    assert refusal is None
    assert planned.spec.resources.requests == {"cpu": "2", "memory": "1700Mi"}


def test_on_cpu_dtype_auto_is_refused_only_where_no_dtype_fits(smollm2_hub: hub.Hub) -> None:
    """The engine picks bfloat16 on CPUs with AVX-512 BF16 or AMX and float32 elsewhere: a
    budget only bfloat16 fits is accepted (and sized in bfloat16), one neither fits is not."""
    reconciler = Reconciler(kube=None, model_configs=ModelConfigs(smollm2_hub.url))  # type: ignore[arg-type]
    config = json.loads(SMOLLM2.read_text())
    for budget in (0.2, 0.4):  # SmolLM2's fixed weights: 0.199 GiB bf16, 0.211 float32 + slots
        llmi = _resource(
            model={"uri": f"hf://{REPO}", "dtype": "auto", "maxModelLen": 512},
            offload={"policy": "static", "deviceMemoryLimitGb": budget},
        )
        _, refusal = reconciler.planned(llmi)
        assert refusal is None, (budget, refusal)
    bf16_only = _resource(
        model={"uri": f"hf://{REPO}", "dtype": "auto", "maxModelLen": 512},
        offload={"policy": "static", "deviceMemoryLimitGb": 0.2},
    )
    with pytest.raises(ConfigError):
        manifest_plan(bf16_only, config, None)  # float32 does not fit
    manifest_plan(bf16_only, config, None, dtype="bfloat16")
    too_small = _resource(
        model={"uri": f"hf://{REPO}", "dtype": "auto", "maxModelLen": 512},
        offload={"policy": "static", "deviceMemoryLimitGb": 0.05},
    )
    assert reconciler.planned(too_small)[1] is not None


def test_a_config_the_plan_cannot_read_is_left_to_the_engine(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with hub.serving(folder, REPO) as served:
        reconciler = Reconciler(kube=None, model_configs=ModelConfigs(served.url))  # type: ignore[arg-type]
        llmi = _resource(offload={"policy": "static", "deviceMemoryLimitGb": 0.01})
        assert reconciler.plan_refusal(llmi) is None


def test_a_model_uri_names_only_a_repository_on_the_endpoint() -> None:
    for uri in (
        "hf://../../admin?",
        "hf://org/../../x",
        "hf://org/name#x",
        "hf://a/b/c",
        "hf://a b",
    ):
        assert config_url("https://hf.example", uri, None) is None, uri
    assert config_url("https://hf.example", "hf://org/name/", None) == (
        "https://hf.example/org/name/resolve/main/config.json"
    )
    assert check_endpoint("off") == "off"
    assert check_endpoint("https://hf-mirror.example/prefix") == "https://hf-mirror.example/prefix"
    for bad in ("hf-mirror.example", "file:///etc", "https://user:secret@hf.example"):
        with pytest.raises(ValueError):
            check_endpoint(bad)


@pytest.fixture
def raw_server() -> Iterator[Callable[[bytes], str]]:
    """Servers that answer every connection with the given bytes, then close it; each gives
    its base URL."""
    servers: list[socket.socket] = []

    def serve(answer: bytes) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        servers.append(listener)

        def run() -> None:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:  # closed at teardown
                    return
                with connection:
                    connection.recv(65536)
                    connection.sendall(answer)

        threading.Thread(target=run, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield serve
    for listener in servers:
        listener.close()


def test_protocol_errors_and_foreign_redirects_are_unreadable_not_raised(
    raw_server: Callable[[bytes], str],
) -> None:
    garbage = raw_server(b"NOT-HTTP garbage\r\n\r\n")
    with pytest.raises(ConfigUnreadable):
        read_config(garbage + "/config.json", timeout=2)
    short = raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}")
    with pytest.raises(ConfigUnreadable):
        read_config(short + "/config.json", timeout=2)
    redirect = raw_server(
        b"HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/latest\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    with pytest.raises(ConfigUnreadable, match="redirected to another server"):
        read_config(redirect + "/config.json", timeout=2)
    for endpoint in (garbage, short, redirect):  # nothing escapes to the reconciler
        assert ModelConfigs(endpoint).get(f"hf://{REPO}", None) is None


def test_a_dripping_body_is_cut_at_the_deadline() -> None:
    """One byte every 0.3 s never trips a 1 s timeout per receive; the overall one does."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            while not stop.wait(0.3):
                try:
                    connection.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=drip, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigUnreadable, match="not read within"):
            read_config(f"http://127.0.0.1:{listener.getsockname()[1]}/config.json", timeout=1)
    finally:
        stop.set()
        listener.close()
    assert time.monotonic() - started < 3


def test_other_sources_keep_no_earlier_request(smollm2_hub: hub.Hub) -> None:
    """Only an hf:// plan that could not be had keeps the request it gave before: a pvc://
    resource whose spec sets none gets none (and the workload is not even read)."""

    class NoReads:
        def get(self, *args: object) -> dict[str, Any]:
            raise AssertionError("the workload was read")

    reconciler = Reconciler(kube=NoReads(), model_configs=ModelConfigs(smollm2_hub.url))  # type: ignore[arg-type]
    pvc = _resource(
        model={"uri": "pvc://models/SmolLM2", "dtype": "float32", "maxModelLen": 512},
        resources={"requests": {"cpu": "2"}},
    )
    planned, refusal = reconciler.planned(pvc)
    assert refusal is None and planned.spec.resources.requests == {"cpu": "2"}
