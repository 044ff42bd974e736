"""Queue bound (429), graceful drain on SIGTERM (in-flight requests finish, new ones get
503, exit 0), the drain timeout, and SIGTERM while the model still loads."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest


@pytest.fixture(scope="module")
def slow_model(make_tiny_model: Any) -> Path:
    """Deeper and wider than the API tests' model, with room for long outputs, so that a
    request is still running when the test acts on it."""
    return Path(
        make_tiny_model(
            "llama", num_hidden_layers=6, intermediate_size=384, max_position_embeddings=4096
        )
    )


def open_stream(server: Any, max_tokens: int) -> http.client.HTTPResponse:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {server.api_key}"}
    connection.request("POST", "/v1/completions", json.dumps(body), headers)
    response = connection.getresponse()
    assert response.status == 200
    return response


def read_events(response: http.client.HTTPResponse) -> list[Any]:
    events = []
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def wait_for(server: Any, condition: Any, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = server.metrics()
        if condition(samples):
            return samples
        time.sleep(0.05)
    raise AssertionError(f"metrics never met the condition: {samples}")


def test_a_full_queue_answers_429_and_keeps_serving(
    server_factory: Any, slow_model: Path, tmp_path: Path
) -> None:
    server = server_factory(
        slow_model, tmp_path, scheduler={"maxNumSeqs": 1, "maxWaitingRequests": 1}
    )
    try:
        first, second = open_stream(server, 2000), open_stream(server, 2000)
        wait_for(server, lambda m: m["brook_engine_num_requests_waiting"] == 1)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
        with pytest.raises(openai.RateLimitError) as error:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert error.value.status_code == 429
        assert error.value.body["code"] == "queue_full"  # type: ignore[index]
        assert int(error.value.response.headers["retry-after"]) >= 1
        wait_for(server, lambda m: m["brook_engine_refused_prompt_tokens_total"] >= 1)
        first.close()
        second.close()
        wait_for(server, lambda m: m["brook_engine_num_requests_running"] == 0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    finally:
        assert server.stop() == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(
    server_factory: Any, slow_model: Path, tmp_path: Path
) -> None:
    server = server_factory(slow_model, tmp_path, scheduler={"maxNumSeqs": 8})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    results: dict[str, Any] = {}

    def whole(name: str) -> None:
        results[name] = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=300, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    threads = [threading.Thread(target=whole, args=(f"whole-{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    streamed = open_stream(server, 300)
    wait_for(server, lambda m: m["brook_engine_num_requests_running"] == 4)

    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while server.get("/ready", auth=False)[0] != 503:
        assert time.monotonic() < deadline, "/ready never turned 503"
        time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert refused.value.status_code == 503

    events = read_events(streamed)
    for thread in threads:
        thread.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    for name in ("whole-0", "whole-1", "whole-2"):
        assert results[name].choices[0].finish_reason == "length"
        assert results[name].usage.completion_tokens == 300
    assert "drained; shutting down" in server.log()


def test_the_drain_timeout_ends_what_is_left(
    server_factory: Any, slow_model: Path, tmp_path: Path
) -> None:
    server = server_factory(slow_model, tmp_path, drain_timeout=1)
    streamed = open_stream(server, 4000)
    wait_for(server, lambda m: m["brook_engine_num_requests_running"] == 1)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    events = read_events(streamed)
    assert server.proc.wait(timeout=60) == 0
    assert time.monotonic() - started < 30
    assert "error" in events[-1], events[-1]
    assert events[-1]["error"]["code"] == "unavailable"
    assert len(events) < 4000
    assert "drain timeout" in server.log()


@pytest.fixture(scope="module")
def large_model(make_tiny_model: Any) -> Path:
    """Large enough that loading it leaves time to act before the server is ready."""
    sizes = {"num_hidden_layers": 8, "num_attention_heads": 16, "intermediate_size": 1536}
    return Path(make_tiny_model("llama", max_position_embeddings=4096, **sizes))


def test_sigterm_while_the_model_loads_exits_0(
    server_factory: Any, large_model: Path, tmp_path: Path
) -> None:
    server = server_factory(large_model, tmp_path, wait=False)
    deadline = time.monotonic() + 120
    while True:
        assert server.proc.poll() is None, server.log()[-3000:]
        assert time.monotonic() < deadline, "/health never answered"
        try:
            if server.get("/health", auth=False)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.01)
    assert server.get("/ready", auth=False)[0] == 503  # still loading
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 0, server.log()[-3000:]
    log = server.log()
    assert "terminate called" not in log
    assert "model load stopped" in log, log[-3000:]
