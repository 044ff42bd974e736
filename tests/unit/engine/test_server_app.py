"""The ASGI app before its model has loaded, its limits on clients, and its API-key settings.
Called in-process through the ASGI interface (no lifespan, so the model never loads; a test
that needs the API open marks the model loaded, and its requests end before the engine)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette

from brook_engine.config import ConfigError, parse_engine_config
from brook_engine.config.server import ApiKeyConfig
from brook_engine.server.app import build_app
from brook_engine.server.auth import read_api_key
from brook_engine.server.engine_calls import sampling_params
from brook_engine.server.protocol import ChatCompletionRequest, CompletionRequest


async def request(
    app: Any,
    method: str,
    path: str,
    chunks: list[bytes] | None = None,
    headers: dict[str, str] | None = None,
    *,
    hang: bool = False,
    num_received: list[int] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request: the body in ``chunks``; ``hang`` keeps the body from ever ending;
    ``num_received`` counts the chunks the app read. Returns (status, headers, body)."""
    sent: list[dict[str, Any]] = []
    pending = list(chunks or [b""])

    async def receive() -> dict[str, Any]:
        if not pending:
            if hang:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}
        await asyncio.sleep(0)  # a real client's bytes arrive between turns of the loop
        if num_received is not None:
            num_received.append(1)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": hang or bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }  # fmt: skip
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    reply_headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], reply_headers, payload


def call(
    app: Any, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    status, reply_headers, payload = asyncio.run(request(app, method, path, [body], headers))
    if reply_headers.get("content-type", "").startswith("application/json"):
        return status, json.loads(payload)
    return status, payload.decode()


@pytest.fixture()
def model_folder(make_tiny_model: Any) -> Path:
    return Path(make_tiny_model("llama"))


def loaded_app(model_folder: Path, **server: Any) -> Starlette:
    """An app whose model counts as loaded; requests that pass the checks would reach the
    engine, which these tests never do."""
    app = build_app(parse_engine_config({"model": {"uri": str(model_folder)}, "server": server}))
    app.state.brook.is_ready = True
    return app


def test_before_the_model_loads_health_is_ok_and_the_rest_503(model_folder: Path) -> None:
    app = build_app(parse_engine_config({"model": {"uri": str(model_folder)}}))
    assert call(app, "GET", "/health")[0] == 200
    status, body = call(app, "GET", "/ready")
    assert (status, body["status"]) == (503, "loading")
    status, body = call(app, "POST", "/v1/completions", b'{"model": "x", "prompt": "hi"}')
    assert status == 503
    assert body["error"]["type"] == "service_unavailable_error"
    assert "loading" in body["error"]["message"]


def test_a_body_in_many_small_chunks_is_read_in_linear_time(model_folder: Path) -> None:
    app = loaded_app(model_folder)
    chunks = [b" " * 1024] * (31 * 1024)  # 31 MiB in 1 KiB pieces, as a trickling client
    status, _, body = asyncio.run(
        asyncio.wait_for(request(app, "POST", "/v1/completions", chunks), 10)
    )  # appending to bytes copied them each time: minutes
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"


def test_a_body_over_the_limit_is_413_and_the_rest_is_not_read(model_folder: Path) -> None:
    app = loaded_app(model_folder, maxBodyBytes=1024 * 1024)
    received: list[int] = []
    status, _, body = asyncio.run(
        request(app, "POST", "/v1/completions", [b"x" * 65536] * 64, num_received=received)
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    assert len(received) == 17  # the chunk that crossed 1 MiB was the last one read
    status, _, _ = asyncio.run(
        request(app, "POST", "/v1/completions", [b"{}"], {"Content-Length": str(2**20 + 1)})
    )
    assert status == 413


def test_a_body_that_stops_arriving_is_408(model_folder: Path) -> None:
    app = loaded_app(model_folder, bodyReadTimeoutSeconds=0.2)
    status, headers, body = asyncio.run(
        asyncio.wait_for(request(app, "POST", "/v1/completions", [b'{"mod'], hang=True), 10)
    )
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "0.2" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400_naming_the_problem(model_folder: Path, path: str) -> None:
    depth = 100_000
    body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, reply = call(loaded_app(model_folder), "POST", path, body)
    assert status == 400, reply
    assert reply["error"]["code"] == "invalid_json"
    assert "nested too deeply" in reply["error"]["message"]


def test_beyond_max_concurrent_requests_the_api_gets_503_and_probes_still_answer(
    model_folder: Path,
) -> None:
    app = loaded_app(model_folder, maxConcurrentRequests=2)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        stuck = [
            asyncio.ensure_future(request(app, "POST", "/v1/completions", [b"{"], hang=True))
            for _ in range(2)
        ]
        await asyncio.sleep(0.05)
        replies = [
            await request(app, "POST", "/v1/completions", [b"{}"]),
            await request(app, "GET", "/health"),
            await request(app, "GET", "/ready"),
            await request(app, "GET", "/metrics"),
        ]
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        replies.append(await request(app, "POST", "/v1/completions", [b"{}"]))
        return replies

    refused, health, ready, metrics, after = asyncio.run(scenario())
    assert refused[0] == 503 and refused[1]["retry-after"] == "1"
    assert json.loads(refused[2])["error"]["code"] == "overloaded"
    assert (health[0], ready[0], metrics[0]) == (200, 200, 200)
    assert after[0] == 400  # the slots came back: the next call is read (and lacks fields)


def test_uvicorn_runs_with_the_limits_and_timeouts(model_folder: Path) -> None:
    from brook_engine.server.serve import uvicorn_config

    config = parse_engine_config(
        {
            "model": {"uri": str(model_folder)},
            "server": {
                "maxConcurrentRequests": 100,
                "maxConnections": 300,
                "keepAliveTimeoutSeconds": 7,
            },
        }
    )
    settings = uvicorn_config(build_app(config), config)
    assert settings.limit_concurrency == 300
    assert settings.timeout_keep_alive == 7
    assert getattr(settings.http, "header_timeout_seconds", None) == 10


def test_api_key_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  secret-key\n")
    assert read_api_key(ApiKeyConfig(file=str(key_file))) == "secret-key"
    monkeypatch.setenv("BROOK_TEST_KEY", "k2")
    assert read_api_key(ApiKeyConfig(env="BROOK_TEST_KEY")) == "k2"
    assert read_api_key(None) is None


@pytest.mark.parametrize("setup", ["missing file", "empty file", "unset env"])
def test_a_missing_api_key_stops_start_up_without_showing_it(
    setup: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BROOK_TEST_KEY", raising=False)
    if setup == "missing file":
        config = ApiKeyConfig(file=str(tmp_path / "nope"))
    elif setup == "empty file":
        (tmp_path / "key").write_text("\n")
        config = ApiKeyConfig(file=str(tmp_path / "key"))
    else:
        config = ApiKeyConfig(env="BROOK_TEST_KEY")
    with pytest.raises(ConfigError, match=r"server\.apiKey"):
        read_api_key(config)


def keyed_app(model_folder: Path, key_file: Path, **server: Any) -> Starlette:
    return build_app(
        parse_engine_config(
            {
                "model": {"uri": str(model_folder)},
                "server": {"apiKey": {"file": str(key_file)}, **server},
            }
        )
    )


def test_wrong_key_is_401_before_anything_else(model_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("right")
    app = keyed_app(model_folder, tmp_path / "key")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic right"}):
        status, body = call(app, "GET", "/v1/models", headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer right"})[0] == 200


def test_a_rotated_api_key_file_takes_effect_without_a_restart(
    model_folder: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("old-key\n")
    app = keyed_app(model_folder, key_file)

    def status(key: str) -> int:
        return call(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0]

    assert status("old-key") == 200
    # Kubernetes swaps a Secret's files in at once; meanwhile the file may be missing.
    key_file.unlink()
    time.sleep(1.1)  # the file is looked at no more than once a second
    assert status("old-key") == 200
    (tmp_path / "key.new").write_text("new-key\n")
    os.replace(tmp_path / "key.new", key_file)
    time.sleep(1.1)
    assert (status("new-key"), status("old-key")) == (200, 401)


def test_metrics_can_require_the_api_key(model_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("right")
    assert call(keyed_app(model_folder, tmp_path / "key"), "GET", "/metrics")[0] == 200
    app = keyed_app(model_folder, tmp_path / "key", metricsRequireApiKey=True)
    status, body = call(app, "GET", "/metrics")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(app, "GET", "/metrics", headers={"Authorization": "Bearer right"})[0] == 200
    assert call(app, "GET", "/health")[0] == 200


def test_cache_salt_reaches_the_prefix_cache_key() -> None:
    salted = {"model": "tiny", "cache_salt": "tenant-a"}
    completion = CompletionRequest.model_validate({**salted, "prompt": "hi"})
    chat = ChatCompletionRequest.model_validate(
        {**salted, "messages": [{"role": "user", "content": "hi"}]}
    )
    for req in (completion, chat):
        assert sampling_params(req, 4, None).cache_extra == ("tenant-a",)
    unsalted = CompletionRequest.model_validate({"model": "tiny", "prompt": "hi"})
    assert sampling_params(unsalted, 4, None).cache_extra == ()
