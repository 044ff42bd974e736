"""The ASGI app before its model has loaded, and its API-key settings. Called in-process
through the ASGI interface (no lifespan, so the model never loads)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from brook_engine.config import ConfigError, parse_engine_config
from brook_engine.config.server import ApiKeyConfig
from brook_engine.server.app import build_app, read_api_key


def call(
    app: Any, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload) if payload else None


@pytest.fixture()
def model_folder(make_tiny_model: Any) -> Path:
    return Path(make_tiny_model("llama"))


def test_before_the_model_loads_health_is_ok_and_the_rest_503(model_folder: Path) -> None:
    app = build_app(parse_engine_config({"model": {"uri": str(model_folder)}}))
    assert call(app, "GET", "/health")[0] == 200
    status, body = call(app, "GET", "/ready")
    assert (status, body["status"]) == (503, "loading")
    status, body = call(app, "POST", "/v1/completions", b'{"model": "x", "prompt": "hi"}')
    assert status == 503
    assert body["error"]["type"] == "service_unavailable_error"
    assert "loading" in body["error"]["message"]


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


def test_wrong_key_is_401_before_anything_else(model_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("right")
    config = parse_engine_config(
        {"model": {"uri": str(model_folder)}, "server": {"apiKey": {"file": str(tmp_path / "key")}}}
    )
    app = build_app(config)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic right"}):
        status, body = call(app, "GET", "/v1/models", headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer right"})[0] == 200
