"""Malformed and extreme requests, each with the status it must get and the field its
OpenAI error must name: the table the bad-request tests and the soak both send."""

from __future__ import annotations

from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", **fields}


# (name, path, body, status, param)
CASES: list[tuple[str, str, bytes | dict[str, Any], int, str | None]] = [
    ("bad JSON", CHAT, b'{"model": "tiny", "messages": [', 400, None),
    ("not UTF-8", CHAT, b"\xff\xfe\x00", 400, None),
    ("body is a list", CHAT, b"[1, 2]", 400, None),
    ("missing model", CHAT, {"messages": USER}, 400, "model"),
    ("unknown model", CHAT, chat(model="gpt-4"), 404, "model"),
    ("missing messages", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role"),
    ("content of wrong type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     "messages[0].content"),
    ("max_tokens as a string", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("negative max_tokens", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens beyond the context", COMPLETIONS, completion(max_tokens=100_000), 400,
     "max_tokens"),
    ("temperature too high", CHAT, chat(temperature=3.5), 400, "temperature"),
    ("temperature negative", COMPLETIONS, completion(temperature=-0.1), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("n too large", CHAT, chat(n=1000), 400, "n"),
    ("n zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("unknown field", CHAT, chat(frobnicate=True), 400, "frobnicate"),
    ("stream not a bool", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs too many", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    ("presence_penalty set", CHAT, chat(presence_penalty=1.0), 400, "presence_penalty"),
    ("tools given", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools"),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt of mixed types", COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt"),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("token id out of range", COMPLETIONS, completion(prompt=[1, 99999]), 400, "prompt"),
    ("prompt longer than the model", COMPLETIONS, completion(prompt=list(range(3, 203)) * 3),
     400, "prompt"),
    ("negative seed", CHAT, chat(seed=-5), 400, "seed"),
    ("echo", COMPLETIONS, completion(echo=True), 400, "echo"),
    ("deeply nested JSON", COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, None),
    ("top_k below -1", CHAT, chat(top_k=-5), 400, "top_k"),
    ("negative min_tokens", COMPLETIONS, completion(min_tokens=-1), 400, "min_tokens"),
    ("too many stop strings", CHAT, chat(stop=["a"] * 17), 400, "stop"),
    ("seed beyond 63 bits", COMPLETIONS, completion(seed=2**64), 400, "seed"),
    ("frequency_penalty set", CHAT, chat(frequency_penalty=0.5), 400, "frequency_penalty"),
    ("repetition_penalty set", COMPLETIONS, completion(repetition_penalty=2.0), 400,
     "repetition_penalty"),
    ("logit_bias given", CHAT, chat(logit_bias={"1": 5.0}), 400, "logit_bias"),
    ("best_of other than n", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    ("suffix given", COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    ("json response_format", CHAT, chat(response_format={"type": "json_object"}), 400,
     "response_format"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("empty cache_salt", CHAT, chat(cache_salt=""), 400, "cache_salt"),
    ("cache_salt too long", COMPLETIONS, completion(cache_salt="s" * 300), 400, "cache_salt"),
    ("user too long", CHAT, chat(user="u" * 600), 400, "user"),
    ("ignore_eos not a bool", COMPLETIONS, completion(ignore_eos="yes"), 400, "ignore_eos"),
    ("zero max_completion_tokens", CHAT, chat(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("empty model", CHAT, chat(model=""), 400, "model"),
    ("temperature as a string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p above 1", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("n not an integer", CHAT, chat(n=1.5), 400, "n"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("too many prompts", COMPLETIONS, completion(prompt=["a"] * 300), 400, "prompt"),
    ("temperature overflowing to inf", CHAT, b'{"model": "tiny", "messages": [{"role": '
     b'"user", "content": "hi"}], "temperature": 1e400}', 400, "temperature"),
]  # fmt: skip
