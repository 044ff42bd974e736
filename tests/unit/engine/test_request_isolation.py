"""One request cannot hurt another: a near-zero temperature samples greedily instead of
overflowing, a request whose logits cannot be sampled fails alone while the batch goes on,
and a caller that stops reading holds one merged output per request (deltas), then loses its
requests after the stall timeout — their blocks freed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.core.async_engine import AsyncEngine, SubRequest
from brook_engine.core.output_stream import ClientStalledError, RequestFailedError
from brook_engine.layers import sampler
from brook_engine.layers.sampler import sample


@pytest.fixture()
def llm(make_tiny_model: Any) -> LLM:
    path = Path(make_tiny_model("llama"))
    return LLM(str(path), dtype="float32", device="cpu", num_blocks=64, progress=False)


def _settled(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_a_tiny_temperature_samples_greedily(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True, seed=3)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    got = llm.generate(prompts, [tiny, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in got)


def test_the_sampler_fails_only_the_rows_it_cannot_sample() -> None:
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 3] = float("inf")
    params = [SamplingParams(temperature=0.7, seed=1, logprobs=2)] * 4
    drawn = sample(logits, params, [None] * 4)
    assert drawn.error(0) is None and 0 <= drawn.token_ids[0] < 50
    assert drawn.logprobs[0] is not None
    for row in (1, 2, 3):
        assert "not finite" in (drawn.error(row) or "")
        assert drawn.logprobs[row] is None
    clean = sample(torch.randn(2, 50), params[:2], [None, None])
    assert clean.errors == []


def test_a_request_that_fails_ends_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampler.draw

    def failing(logits: torch.Tensor, params: list[SamplingParams], uniform: Any) -> Any:
        if any(p.seed == 666 for p in params):  # the batch fails, then that row alone
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, uniform)

    monkeypatch.setattr(sampler, "draw", failing)
    bad = SamplingParams(max_tokens=20, temperature=1.0, seed=666, ignore_eos=True)
    good = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = llm.generate([[8, 9]], good, use_tqdm=False)[0].outputs[0].token_ids

    async def run() -> tuple[BaseException | None, list[int]]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        failing_call = await engine.add([SubRequest("bad", [5, 6, 7], bad)])
        good_call = await engine.add([SubRequest("good", [8, 9], good)])
        error: BaseException | None = None
        try:
            async for _ in failing_call:
                pass
        except RequestFailedError as exc:
            error = exc
        tokens: list[int] = []
        async for _, output in good_call:
            tokens += output.delta_token_ids
        assert engine.is_running
        await engine.stop()
        return error, tokens

    error, tokens = asyncio.run(run())
    assert error is not None and "probability tensor" in str(error)
    assert tokens == expected
    _settled(llm)


def test_outputs_are_deltas_and_only_the_final_one_is_whole(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request("r", [5, 6, 7, 8], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    *running, final = outputs
    assert len(running) == 11 and final.finished
    for out in running:  # nothing cumulative is copied at every step
        assert out.outputs[0].token_ids == [] and out.prompt_token_ids == []
        assert len(out.delta_token_ids) == 1 and len(out.delta_logprobs or []) == 1
    assert [t for o in outputs for t in o.delta_token_ids] == final.outputs[0].token_ids
    assert "".join(o.delta_text for o in outputs) == final.outputs[0].text
    assert [lp for o in outputs for lp in o.delta_logprobs or []] == final.outputs[0].logprobs
    assert final.prompt_token_ids == [5, 6, 7, 8]


def test_an_unread_call_holds_one_merged_output_per_request(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def run() -> tuple[int, list[Any]]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        stream = await engine.add([SubRequest("a", [5, 6], params), SubRequest("b", [7], params)])
        while llm.engine.has_unfinished_requests():  # read nothing while they generate
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        unread = stream.num_unread
        outputs = [output async for _, output in stream]
        await engine.stop()
        return unread, outputs

    unread, outputs = asyncio.run(run())
    assert unread == 2  # not 60: later outputs merged into the unread one
    assert len(outputs) == 2 and all(o.finished for o in outputs)
    for output in outputs:
        assert output.delta_token_ids == output.outputs[0].token_ids  # nothing lost
        assert len(output.delta_token_ids) == 30
    _settled(llm)


def test_a_stalled_caller_loses_its_requests_and_their_blocks(llm: LLM) -> None:
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def run() -> BaseException | None:
        engine = AsyncEngine(llm.engine, stall_seconds=0.05)
        engine.start()
        stream = await engine.add([SubRequest("s", [5, 6], params)])
        await asyncio.sleep(1.0)  # a client that stopped reading
        error = None
        try:
            async for _ in stream:
                pass
        except ClientStalledError as exc:
            error = exc
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await engine.stop()
        return error

    error = asyncio.run(run())
    assert error is not None and "read nothing" in str(error)
    assert llm.engine.stats().num_generation_tokens_total < 500  # aborted, not finished
    _settled(llm)
