"""Generation behaviour: stop conditions, seeded sampling, top-k/top-p, logprobs, chat,
rotary scalings against transformers, and bad input that must not disturb other requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_engine.core.requests import RequestError
from brook_engine.kv.cache import LayerKVCache
from brook_engine.sampling_params import SamplingError

EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


@pytest.fixture(scope="module")
def llm(make_tiny_model: Callable[..., Path]) -> LLM:
    return LLM(
        str(make_tiny_model("llama")),
        dtype="float32",
        max_model_len=128,
        kv_cache={**EXACT_KV, "num_blocks": 64},
        progress=False,
    )


def _greedy(max_tokens: int = 20, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    prompt = [5, 6, 7]
    free = llm.generate([prompt], _greedy(40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # Make the 4th generated token the stop token: generation ends right there.
    stop_token = free.token_ids[3]
    out = llm.generate([prompt], _greedy(40, stop_token_ids=(stop_token,)), use_tqdm=False)[0]
    first = free.token_ids.index(stop_token)
    assert out.outputs[0].token_ids == free.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_token
    # min_tokens keeps stop tokens from ending it early.
    late = llm.generate(
        [prompt], _greedy(40, stop_token_ids=(stop_token,), min_tokens=first + 2), use_tqdm=False
    )[0].outputs[0]
    assert len(late.token_ids) > first + 1


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    prompt = "The quick brown"
    free = llm.generate([prompt], _greedy(30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], _greedy(30, stop=(stop,), ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_max_tokens_and_model_length(llm: LLM) -> None:
    out = llm.generate([[9] * 120], _greedy(50, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8  # 120 + 8 = max_model_len 128
    assert out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate([[4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3
    batch = llm.generate(
        [[7, 8], [4, 5, 6], [10] * 9, [3]], [others[0], params, *others[1:]], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    differently_seeded = (
        llm.generate([[4, 5, 6]], params.model_copy(update={"seed": 99}), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert differently_seeded != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([[11, 12]], _greedy(12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(
        [[11, 12]],
        SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logprobs_are_those_of_the_model(llm: LLM) -> None:
    prompt = [20, 21, 22, 23]
    out = llm.generate([prompt], _greedy(3, ignore_eos=True, logprobs=2), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    logits = llm.engine.prompt_logits(prompt + out.token_ids[:1])
    expected = torch.log_softmax(logits[-2], -1)
    sampled, top = out.logprobs[0]
    assert sampled == pytest.approx(float(expected[out.token_ids[0]]), abs=1e-4)
    assert list(top) == torch.topk(expected, 2).indices.tolist()
    assert sampled == pytest.approx(max(top.values()), abs=1e-6)  # greedy takes the top one


def test_chat_uses_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "The capital of France?"}]
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert rendered.endswith("<|im_start|>assistant\n")
    chat = llm.chat(messages, _greedy(8, ignore_eos=True), use_tqdm=False)[0]
    plain = llm.generate([rendered], _greedy(8, ignore_eos=True), use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.prompt_token_ids == llm.tokenizer.encode(rendered)


def test_bad_requests_are_refused_and_others_carry_on(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], _greedy(10, ignore_eos=True))
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request("empty", "", _greedy())
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request("empty-ids", [], _greedy())
    with pytest.raises(RequestError, match="prompt has 200 tokens but the model length is 128"):
        engine.add_request("long", [5] * 200, _greedy())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("vocab", [5, 10_000], _greedy())
    with pytest.raises(RequestError, match="already running"):
        engine.add_request("good", [5], _greedy())
    with pytest.raises(
        SamplingError, match=r"max_tokens: Input should be greater than or equal to 1"
    ):
        SamplingParams.from_dict({"max_tokens": 0})
    with pytest.raises(
        SamplingError, match=r"temprature: unknown field; known fields: .*temperature"
    ):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 10


def test_unknown_llm_option_is_named(make_tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="unknown option 'max_num_seq'"):
        LLM(str(make_tiny_model("llama")), max_num_seq=4, progress=False)
    with pytest.raises(ConfigError, match=r"model\.uri"):
        LLM("hf://org/model", progress=False)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scalings_match_transformers(
    rope: dict[str, Any], make_tiny_model: Callable[..., Path]
) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("llama", rope_parameters={"rope_theta": 10000.0, **rope})
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache={**EXACT_KV, "num_blocks": 64}, progress=False)
    prompt = list(range(3, 103))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.engine.prompt_logits(prompt), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kind", "tolerance"),
    [("fp16", 1e-3), ("bf16", 8e-3), ("fp8_e4m3", 7e-2), ("fp8_e5m2", 1.3e-1)],
)
def test_kv_storage_round_trip(kind: Any, tolerance: float) -> None:
    cache = LayerKVCache.allocate(4, 8, 2, 16, kind, torch.float32, torch.device("cpu"))
    k = torch.randn(5, 2, 16) * 3
    v = torch.randn(5, 2, 16) / 7
    slots = torch.tensor([3, 9, 0, 31, 17])
    cache.write(slots, k, v)
    rk, rv = cache.read(slots)  # [kv_heads, tokens, head_dim]
    for got, want in ((rk, k), (rv, v)):
        relative = (got.transpose(0, 1) - want).norm() / want.norm()
        assert relative < tolerance
    # Whole blocks read back the same values at the same places.
    bk, bv = cache.read_blocks(torch.tensor([[0, 1], [3, 2]]))  # [kv_heads, 2, 2 * 8, head_dim]
    torch.testing.assert_close(bk[:, 0, 3], rk[:, 0])  # slot 3: block 0, offset 3
    torch.testing.assert_close(bv[:, 1, 7], rv[:, 3])  # slot 31: block 3 (row 1), offset 7


@pytest.mark.parametrize(
    ("options", "text"),
    [
        (
            {
                "offload": {"policy": "static", "device_memory_limit_gb": 1},
                "shapes": {"one_row_weights": "fp32"},
            },
            "shapes.oneRowWeights: one-row copies would double",
        ),
        (
            {"quantization": {"weights": "w8a16"}, "shapes": {"one_row_weights": "bf16"}},
            "shapes.oneRowWeights",
        ),
        ({"shapes": {"online_learning": True}}, "shapes.onlineLearning"),
    ],
)
def test_settings_not_yet_available_are_refused(
    options: dict[str, Any], text: str, make_tiny_model: Callable[..., Path]
) -> None:
    with pytest.raises(ConfigError, match=text):
        LLM(str(make_tiny_model("llama")), progress=False, **options)


def test_loader_names_what_is_wrong(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = make_tiny_model("llama")
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*not supported; Brook runs"):
        LLM(str(broken), progress=False)
    (broken / "config.json").write_text(json.dumps(config))
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ConfigError, match=r"checkpoint lacks model\.layers\.1\.mlp\.gate_up_proj"):
        LLM(str(broken), progress=False)
    with pytest.raises(ConfigError, match="not a folder"):
        LLM(str(tmp_path / "nowhere"), progress=False)


def test_sharded_checkpoint_loads_the_same(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    source = make_tiny_model("qwen2")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((source / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    kv = {**EXACT_KV, "num_blocks": 32}
    prompt = [5, 9, 14, 3]
    whole = LLM(str(source), dtype="float32", kv_cache=kv, progress=False)
    parts = LLM(str(sharded), dtype="float32", kv_cache=kv, progress=False)
    torch.testing.assert_close(
        parts.engine.prompt_logits(prompt), whole.engine.prompt_logits(prompt)
    )
