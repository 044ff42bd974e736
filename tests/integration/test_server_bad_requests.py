"""Malformed requests and slow clients: each gets its documented status and an OpenAI-shaped
error naming the field, or is cut off, and the server keeps serving."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from support.bad_requests import CASES, CHAT, COMPLETIONS, completion


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_malformed_request(
    api_server: Any, path: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    got, reply = api_server.post(path, body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    if param is not None:
        assert param.split("[")[0] in error["message"], error
    # ... and the server still answers a good request.
    ok, answer = api_server.post(COMPLETIONS, completion(max_tokens=2))
    assert ok == 200, answer


def test_wrong_paths_and_methods_get_openai_errors(api_server: Any) -> None:
    status, body = api_server.get("/v1/nothing")
    assert status == 404 and body.startswith('{"error"')
    status, body = api_server.get("/v1/chat/completions")
    assert status == 405 and body.startswith('{"error"')


def test_deeply_nested_json_is_refused_without_a_traceback(api_server: Any) -> None:
    depth = 100_000
    messages = b'[{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]"
    status, reply = api_server.post(CHAT, b'{"model": "tiny", "messages": ' + messages + b"}")
    assert status == 400, reply
    assert "nested too deeply" in reply["error"]["message"]
    assert "RecursionError" not in api_server.log()
    assert "Traceback" not in api_server.log()


def raw_connection(server: Any) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=15)


def test_slow_clients_are_cut_off_and_cannot_starve_the_probes(
    server_factory: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    server = server_factory(
        tiny_llama,
        tmp_path,
        server={
            "maxConcurrentRequests": 2,
            "headerReadTimeoutSeconds": 1,
            "bodyReadTimeoutSeconds": 3,
        },
    )
    try:
        # Headers that never end: the connection is closed after the header timeout.
        started = time.monotonic()
        with raw_connection(server) as trickle:
            trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tiny\r\n")
            assert trickle.recv(1024) == b""
        assert time.monotonic() - started < 10
        # Bodies that never end hold both request slots...
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: 1000\r\n\r\n{{"
        ).encode()
        slow = [raw_connection(server) for _ in range(2)]
        for connection in slow:
            connection.sendall(head)
        deadline = time.monotonic() + 2
        while (status := server.post(COMPLETIONS, b"{}")[0]) != 503:
            assert status == 400 and time.monotonic() < deadline, status
            time.sleep(0.05)
        # ... so further API calls get 503 with Retry-After, but the probes still answer.
        with raw_connection(server) as refused:
            refused.sendall(
                f"GET /v1/models HTTP/1.1\r\nHost: tiny\r\n"
                f"Authorization: Bearer {server.api_key}\r\n\r\n".encode()
            )
            reply = refused.recv(4096).lower()
        assert reply.startswith(b"http/1.1 503") and b"retry-after: 1" in reply, reply
        assert server.get("/health", auth=False)[0] == 200
        assert server.get("/ready", auth=False)[0] == 200
        # After the body timeout the slow requests end with 408 and the slots are free.
        for connection in slow:
            with connection:
                assert connection.recv(4096).startswith(b"HTTP/1.1 408")
        status, answer = server.post(COMPLETIONS, completion(max_tokens=2))
        assert status == 200, answer
    finally:
        assert server.stop() == 0
