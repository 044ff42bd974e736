"""The engine thread behind the server: outputs reach their callers, an early close frees the
blocks, a failed step ends only its requests, and stopping ends what is left."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from brook_engine import LLM, SamplingParams
from brook_engine.core.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStoppedError,
    SubRequest,
)
from brook_engine.core.requests import RequestError
from brook_engine.core.scheduler import QueueFullError
from brook_engine.metrics.prometheus import EngineMetrics


@pytest.fixture()
def llm(make_tiny_model: Any) -> LLM:
    path = Path(make_tiny_model("llama"))
    return LLM(str(path), dtype="float32", device="cpu", num_blocks=64, progress=False)


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


async def drain(stream: Any) -> dict[int, Any]:
    final = {}
    async for index, output in stream:
        if output.finished:
            final[index] = output
    return final


def test_concurrent_calls_get_their_own_outputs(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    async def run() -> list[list[int]]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        streams = [
            await engine.add([SubRequest(f"r{i}", p, GREEDY)]) for i, p in enumerate(prompts)
        ]
        finals = await asyncio.gather(*(drain(s) for s in streams))
        await engine.stop()
        return [f[0].outputs[0].token_ids for f in finals]

    assert asyncio.run(run()) == expected


def test_closing_a_stream_aborts_and_frees_its_blocks(llm: LLM) -> None:
    registry = CollectorRegistry()

    async def run() -> None:
        engine = AsyncEngine(llm.engine, EngineMetrics(registry, {"model": "tiny"}))
        engine.start()
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = await engine.add([SubRequest("a", [5, 6, 7], long), SubRequest("b", [8], long)])
        await stream.__anext__()
        assert llm.engine.block_manager.num_used_blocks > 0
        stream.close()
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await engine.stop()

    asyncio.run(run())
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()
    aborted = registry.get_sample_value("brook_engine_requests_total", {"finish_reason": "abort"})
    assert aborted == 2


def test_refused_calls_raise_before_any_output(llm: LLM) -> None:
    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await engine.add([SubRequest("ok", [5], GREEDY), SubRequest("bad", [10**6], GREEDY)])
        assert not llm.engine.has_unfinished_requests()  # the good half did not stay behind
        await engine.stop()

    asyncio.run(run())


def _one_seq_llm(make_tiny_model: Any, max_waiting: int) -> LLM:
    """A tiny model's engine with one batch slot and ``max_waiting`` queue places."""
    path = Path(make_tiny_model("llama"))
    return LLM(
        str(path), dtype="float32", device="cpu", num_blocks=64, progress=False,
        scheduler={"max_num_seqs": 1, "max_waiting_requests": max_waiting},
    )  # fmt: skip


def test_a_full_queue_is_refused(make_tiny_model: Any) -> None:
    llm = _one_seq_llm(make_tiny_model, max_waiting=0)

    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        with pytest.raises(QueueFullError):
            await engine.add([SubRequest("a", [5, 6, 7], GREEDY)])
        await engine.stop()
        # Demand turned away is counted (the autoscaler's arrival signal reads it), apart
        # from the prompt tokens the engine took in.
        stats = llm.engine.stats()
        assert (stats.num_refused_prompt_tokens_total, stats.num_prompt_tokens_total) == (3, 0)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("ended_ago", "retry_after"),
    [
        ((), 1),  # nothing ended in the last minute: no estimate, the shortest
        ((9.5, 5.0), 10),  # a request ends every ~9.5 s: it frees the slot the waiting one takes
        ((59.5, 59.0), 60),  # a stalled engine: capped
        ((200.0, 100.0), 1),  # older than a minute: no estimate
    ],
)
def test_a_refused_request_is_told_when_the_queue_moves(
    make_tiny_model: Any, ended_ago: tuple[float, ...], retry_after: int
) -> None:
    llm = _one_seq_llm(make_tiny_model, max_waiting=1)
    engine = llm.engine
    engine.add_request("waits", [5], GREEDY)
    now = time.monotonic()
    engine._recent_finishes.extend(now - ago for ago in ended_ago)
    with pytest.raises(QueueFullError) as refused:
        engine.add_request("refused", [5, 6], GREEDY)
    assert refused.value.retry_after_seconds == retry_after


def test_a_refused_call_is_counted_as_refused_demand_whole(make_tiny_model: Any) -> None:
    """Three choices, room for two in the queue: the call is refused whole. None of its
    choices was received or ended; all three prompts are refused demand."""
    llm = _one_seq_llm(make_tiny_model, max_waiting=2)

    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        choices = [SubRequest(f"c{i}", [5, 6, 7], GREEDY) for i in range(3)]
        with pytest.raises(QueueFullError):
            await engine.add(choices)
        await engine.stop()

    asyncio.run(run())
    stats = llm.engine.stats()
    assert (stats.num_prompt_tokens_total, stats.num_refused_prompt_tokens_total) == (0, 9)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine._recent_finishes  # nothing ended: Retry-After is not shortened
    assert not llm.engine.take_finished_stats()  # no request counted as aborted


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    issue = llm.engine.runner.issue
    calls = {"n": 0}

    def flaky(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return issue(batch)

    monkeypatch.setattr(llm.engine.runner, "issue", flaky)

    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        stream = await engine.add([SubRequest("a", [5, 6], GREEDY)])
        with pytest.raises(EngineStepError, match="device fell over"):
            await drain(stream)
        assert llm.engine.block_manager.num_used_blocks == 0
        final = await drain(await engine.add([SubRequest("b", [5, 6], GREEDY)]))
        assert len(final[0].outputs[0].token_ids) == 10
        await engine.stop()

    asyncio.run(run())


def test_stop_ends_unfinished_requests(llm: LLM) -> None:
    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = await engine.add([SubRequest("a", [5], long)])
        await stream.__anext__()
        await engine.stop()
        with pytest.raises(EngineStoppedError):
            await drain(stream)
        with pytest.raises(EngineStoppedError):
            await engine.add([SubRequest("b", [5], GREEDY)])

    asyncio.run(run())
    assert llm.engine.block_manager.num_used_blocks == 0


def test_launch_builds_and_steps_on_one_thread(llm: LLM) -> None:
    """OpenMP keeps a pool per calling thread: the engine must be built, warmed up and
    stepped on the same one."""
    import threading

    seen: set[str] = set()
    original_step = llm.engine.step

    def step() -> Any:
        seen.add(threading.current_thread().name + str(threading.get_ident()))
        return original_step()

    def build() -> tuple[Any, None]:
        seen.add(threading.current_thread().name + str(threading.get_ident()))
        llm.engine.step = step  # type: ignore[method-assign]
        return llm.engine, None

    async def run() -> None:
        engine = await AsyncEngine.launch(build)
        await drain(await engine.add([SubRequest("a", [5, 6, 7], GREEDY)]))
        await engine.stop()

    asyncio.run(run())
    assert len(seen) == 1 and next(iter(seen)).startswith("brook-engine")


def test_launch_raises_what_the_build_raised() -> None:
    def build() -> tuple[Any, None]:
        raise FileNotFoundError("model.path: no such folder")

    async def run() -> None:
        await AsyncEngine.launch(build)

    with pytest.raises(FileNotFoundError, match="no such folder"):
        asyncio.run(run())
