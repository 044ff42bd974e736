"""A compile-mode server whose graphs cannot be compiled — an image without a C++ compiler —
serves every request eagerly through the official ``openai`` client, and says so in
``/metrics`` (compile failures, no graphs held, misses) and its cold-start figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from brook_engine import LLM, SamplingParams


def test_compile_errors_leave_the_server_serving_eagerly(
    tiny_llama: Path, server_factory: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = server_factory(
        tiny_llama,
        tmp_path_factory.mktemp("compile-server"),
        scheduler={"maxNumSeqs": 4, "maxNumBatchedTokens": 8},  # buckets 1, 2, 4, 8
        shapes={"mode": "compile"},
        env={"CXX": "/bin/false"},  # Inductor finds no working C++ compiler
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8, 9, 10], max_tokens=6, temperature=0
        )
        offline = LLM(str(tiny_llama), dtype="float32", device="cpu", num_blocks=64, progress=False)
        expected = (
            offline.generate(
                [[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        assert reply.choices[0].text == expected
        samples = server.metrics()
        assert samples["brook_engine_compile_failures_total"] == 4
        assert samples["brook_engine_compiled_graphs"] == 0
        assert samples["brook_engine_compile_cache_misses_total"] > 0
        assert samples["brook_engine_compile_cache_hits_total"] == 0
        ready = samples['brook_engine_cold_start_seconds{until="ready"}']
        assert 0 < ready <= samples['brook_engine_cold_start_seconds{until="first_token"}']
        assert "compiling the 8-token bucket failed; it runs eager" in server.log()
    finally:
        server.stop()
