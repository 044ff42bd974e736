"""The operator's memory plan before scheduling: hf:// models' config.json read from a Hub
(here the loopback stand-in of ``support.hub``, which answers the Hub's file URLs), kept,
and turned into SpecValid=False for a plan that cannot fit or a memory request for a pod
that sets none."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from brook_engine.offload.plan import GIB
from brook_operator.api import LLMInference
from brook_operator.controller import Reconciler
from brook_operator.memory_plan import PROCESS_BYTES, manifest_plan, memory_request_bytes
from brook_operator.model_configs import (
    MAX_CONFIG_BYTES,
    RETRY_SECONDS,
    ConfigUnreadable,
    ModelConfigs,
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
    # four ranks (TP=4) in each of the two pods; each rank's pool holds what it streams
    most = max(rank.host_bytes for rank in plan.ranks)
    assert most > 0
    assert memory_request_bytes(llmi, plan) == 4 * most + PROCESS_BYTES


def test_without_a_hub_nothing_is_planned() -> None:
    llmi = _resource(offload={"policy": "static", "deviceMemoryLimitGb": 0.01})
    planned, refusal = Reconciler(kube=None).planned(llmi)  # type: ignore[arg-type]
    assert refusal is None and planned is llmi
