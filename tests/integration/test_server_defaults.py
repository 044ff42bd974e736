"""A real ``brook-engine serve`` on CPU whose configuration sets no token budget runs with a
server's (512 tokens a step, core/serving_defaults.py), says so in its log and in
``brook_engine_model_info``, and answers as usual."""

from __future__ import annotations

from pathlib import Path

from tests.support.engine_server import start_server


def test_a_cpu_server_without_a_token_budget_runs_512_a_step(
    tiny_llama: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_llama, tmp_path)  # no scheduler section
    try:
        info = next(k for k in server.metrics() if k.startswith("brook_engine_model_info"))
        assert 'max_num_batched_tokens="512"' in info
        assert 'device="cpu"' in info
        assert "512 tokens a step, a server's default on CPU" in server.log()
        prompt = [5 + i % 300 for i in range(400)]  # the tiny model's vocabulary is 320
        status, body = server.post(
            "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3}
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == 400
        assert body["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0
