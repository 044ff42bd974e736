"""The engine server driven by the official ``openai`` client: completions, chat (whole and
streamed), models, many concurrent streams, disconnects, the API key."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from brook_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    """The offline API on the same weights: what the server must reproduce."""
    return LLM(str(tiny_llama), dtype="float32", device="cpu", num_blocks=64, progress=False)


def client(server: Any, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=kwargs.pop("api_key", server.api_key), max_retries=0
    )


def wait_idle(server: Any, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = server.metrics()
        idle = (
            samples["brook_engine_num_requests_running"] == 0
            and samples["brook_engine_num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_models_lists_the_served_name(api_server: Any) -> None:
    models = client(api_server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client(api_server).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(api_server).models.retrieve("gpt-4")


def test_completion_matches_the_offline_api(api_server: Any, offline: LLM) -> None:
    prompt = "The capital of France is"
    reply = client(api_server).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = offline.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


def test_completion_of_token_ids_and_several_prompts(api_server: Any) -> None:
    reply = client(api_server).completions.create(
        model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    # n greedy choices of one prompt agree; the two prompts are independent requests.
    assert reply.choices[0].text == reply.choices[1].text
    assert reply.choices[2].text == reply.choices[3].text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 5
    assert reply.usage.completion_tokens == 16


def test_chat_matches_the_offline_api(api_server: Any, offline: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client(api_server).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    expected = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected[0].outputs[0].text
    assert reply.choices[0].finish_reason == expected[0].outputs[0].finish_reason


def test_streamed_chat_assembles_to_the_whole_reply(api_server: Any) -> None:
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The quick brown fox"},
    ]
    whole = client(api_server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0
    )
    chunks = list(
        client(api_server).chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_seeded_sampling_repeats_and_logprobs_come_back(api_server: Any) -> None:
    def ask() -> Any:
        return client(api_server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
            temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
        )  # fmt: skip

    first, second = ask(), ask()
    assert first.choices[0].message.content == second.choices[0].message.content
    content = first.choices[0].logprobs.content
    assert len(content) == first.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)


def test_stop_string_ends_the_text_before_it(api_server: Any) -> None:
    free = client(api_server).completions.create(
        model="tiny", prompt="Paris", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    if len(text) < 4:
        pytest.skip("the random model produced too little text to cut")
    stop = text[2:4]
    cut = client(api_server).completions.create(
        model="tiny", prompt="Paris", max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_api_key_is_required_but_probes_are_open(api_server: Any) -> None:
    with pytest.raises(openai.AuthenticationError) as error:
        client(api_server, api_key="wrong").models.list()
    assert error.value.status_code == 401
    assert error.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    status, _ = api_server.post("/v1/completions", {"model": "tiny", "prompt": "x"}, auth=False)
    assert status == 401
    for path in ("/health", "/ready", "/metrics"):
        assert api_server.get(path, auth=False)[0] == 200


def test_cache_salt_keeps_cached_prefixes_apart(api_server: Any) -> None:
    prompt = list(range(40, 88))  # three full KV blocks no other test sends

    def hits(**salt: str) -> float:
        before = wait_idle(api_server)["brook_engine_prefix_cache_hits_total"]
        client(api_server).completions.create(
            model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body=salt
        )
        return wait_idle(api_server)["brook_engine_prefix_cache_hits_total"] - before

    assert hits(cache_salt="tenant-a") == 0  # the first time: nothing cached
    assert hits(cache_salt="tenant-b") == 0  # another tenant shares nothing
    assert hits() == 0  # nor does an unsalted request
    assert hits(cache_salt="tenant-a") >= 32  # the same tenant finds its blocks


def test_64_concurrent_streams_are_all_accounted_for(api_server: Any) -> None:
    before = wait_idle(api_server)

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, Any]:
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Request {i}: tell me more"}],
            max_tokens=8 + i % 24, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    async def run() -> list[tuple[str, Any]]:
        aclient = openai.AsyncOpenAI(
            base_url=api_server.url + "/v1", api_key=api_server.api_key, max_retries=0
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64 and all(usage is not None for _, usage in results)
    after = wait_idle(api_server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    ended = sum(delta(f'brook_engine_requests_total{{finish_reason="{r}"}}') for r in
                ("stop", "length", "abort"))  # fmt: skip
    assert ended == 64
    assert delta('brook_engine_requests_total{finish_reason="abort"}') == 0
    assert delta("brook_engine_generation_tokens_total") == sum(
        u.completion_tokens for _, u in results
    )
    assert delta("brook_engine_prompt_tokens_total") == sum(u.prompt_tokens for _, u in results)
    assert delta("brook_engine_e2e_request_latency_seconds_count") == 64
    assert after["brook_engine_kv_cache_usage_ratio"] == 0
    assert after["kv_cache_usage_perc"] == 0
    assert after["num_requests_running"] == 0


def test_a_disconnect_mid_stream_frees_its_blocks(api_server: Any) -> None:
    host, port = api_server.url.removeprefix("http://").split(":")
    body = {"model": "tiny", "prompt": "Count", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    # The tiny model can finish 400 tokens before the metrics are read; then the race
    # was lost (nothing to disconnect from) and the scenario runs again.
    for _attempt in range(5):
        before = wait_idle(api_server)
        assert before["brook_engine_kv_cache_usage_ratio"] == 0
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request(
            "POST", "/v1/completions", json.dumps(body),
            {"Content-Type": "application/json",
             "Authorization": f"Bearer {api_server.api_key}"},
        )  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # tokens are flowing
        busy = api_server.metrics()
        if busy["brook_engine_num_requests_running"] == 1:
            break
        connection.close()
    else:
        pytest.fail("the request always ended before it could be observed running")
    assert busy["brook_engine_kv_cache_usage_ratio"] > 0
    connection.close()  # the client goes away mid-stream
    after = wait_idle(api_server)
    assert after["brook_engine_kv_cache_usage_ratio"] == before["brook_engine_kv_cache_usage_ratio"]
    aborted = 'brook_engine_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    # Fewer tokens than asked for were generated: the request really stopped.
    generated = after["brook_engine_generation_tokens_total"]
    assert generated - before["brook_engine_generation_tokens_total"] < 400


def test_metrics_carry_the_documented_names(api_server: Any) -> None:
    from brook_engine.metrics import names

    samples = api_server.metrics()
    for name in (
        names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.KV_CACHE_USAGE_RATIO,
        names.COMM_COMPUTE_OVERLAP_RATIO, names.PROMPT_TOKENS_TOTAL,
        names.GENERATION_TOKENS_TOTAL, names.PREEMPTIONS_TOTAL,
        names.PREFIX_CACHE_QUERIES_TOTAL, names.PREFIX_CACHE_HITS_TOTAL,
        names.TIME_TO_FIRST_TOKEN_SECONDS + "_count",
        names.TIME_PER_OUTPUT_TOKEN_SECONDS + "_count",
        names.E2E_REQUEST_LATENCY_SECONDS + "_count",
        names.GATEWAY_NUM_REQUESTS_WAITING, names.GATEWAY_NUM_REQUESTS_RUNNING,
        names.GATEWAY_KV_CACHE_USAGE_PERC,
        f'{names.VLLM_KV_CACHE_USAGE_PERC}{{model_name="tiny"}}',
        f'{names.VLLM_GENERATION_TOKENS_TOTAL}{{model_name="tiny"}}',
        f'{names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS}_count{{model_name="tiny"}}',
    ):  # fmt: skip
        assert name in samples, name
    assert samples[names.COMM_COMPUTE_OVERLAP_RATIO] == 1.0
    for kind in names.MEMORY_KINDS:
        assert samples[f'{names.DEVICE_MEMORY_BYTES}{{kind="{kind}"}}'] > 0
    info = [k for k in samples if k.startswith(names.MODEL_INFO)]
    assert len(info) == 1 and 'model="tiny"' in info[0] and 'tensor_parallel="1"' in info[0]
