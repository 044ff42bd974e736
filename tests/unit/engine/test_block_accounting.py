"""Block accounting under random load: thousands of requests of random lengths, random
cancellations, and a cache small enough that preemption happens all the time. The scheduler
and block manager are torch-free, so the "model" here appends a token per finished step;
a second test runs the real engine with random aborts."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from brook_engine.config import SchedulerConfig
from brook_engine.core.scheduler import ScheduledBatch, Scheduler
from brook_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from brook_engine.kv.blocks import BlockManager
from brook_engine.sampling_params import SamplingParams


def _simulate(seed: int, num_requests: int, num_blocks: int, chunked: bool) -> Scheduler:
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=num_blocks, block_size=4)
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 16),
        # Without chunking a whole (recomputed) sequence must fit one step, as the engine's
        # config check guarantees (maxNumBatchedTokens >= model length).
        max_num_batched_tokens=rng.randint(24, 64) if chunked else 64,
        chunked_prefill=chunked,
        max_waiting_requests=num_requests,
    )
    scheduler = Scheduler(config, blocks)
    # Every request must fit the cache alone (the engine checks this at start-up).
    longest = min(num_blocks * 4, 64)
    live: list[Sequence] = []
    for i in range(num_requests):
        prompt = rng.randint(1, min(40, longest // 2))
        params = SamplingParams(max_tokens=rng.randint(1, min(24, longest - prompt)))
        seq = Sequence(f"r{i}", [1] * prompt, prompt, params)
        scheduler.add(seq)
        live.append(seq)
        # Interleave arrivals with steps, like a server.
        for _ in range(rng.randint(0, 2)):
            _step(scheduler, rng, live)
    while scheduler.has_unfinished():
        _step(scheduler, rng, live)
    return scheduler


def _step(scheduler: Scheduler, rng: random.Random, live: list[Sequence]) -> None:
    batch = scheduler.schedule()
    scheduler.block_manager.check_invariants()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens + n
        _advance(scheduler, seq, n)
    _cancel_now_and_then(scheduler, rng, live)
    if not batch.seqs and scheduler.has_unfinished():
        raise AssertionError("scheduler made no progress with requests pending")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(16, 48),
    chunked=st.booleans(),
)
def test_every_block_is_free_after_random_load(seed: int, num_blocks: int, chunked: bool) -> None:
    scheduler = _simulate(seed, num_requests=100, num_blocks=num_blocks, chunked=chunked)
    scheduler.block_manager.check_invariants()
    assert scheduler.block_manager.num_free_blocks == num_blocks
    assert not scheduler.running and not scheduler.waiting


def _simulate_in_flight(seed: int, depth: int, num_blocks: int) -> Scheduler:
    """A pipeline's engine loop: up to ``depth`` steps in flight, each collected later;
    requests are cancelled at random, also while a step holding them is in flight."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=num_blocks, block_size=4)
    config = SchedulerConfig(
        max_num_seqs=rng.randint(2, 16),
        max_num_batched_tokens=rng.randint(24, 64),
        max_waiting_requests=1000,
    )
    scheduler = Scheduler(config, blocks)
    flights: deque[ScheduledBatch] = deque()
    live: list[Sequence] = []
    for i in range(200):
        prompt = rng.randint(1, 30)
        seq = Sequence(f"r{i}", [1] * prompt, prompt, SamplingParams(max_tokens=rng.randint(1, 20)))
        scheduler.add(seq)
        live.append(seq)
        for _ in range(rng.randint(0, 3)):
            _pipelined_step(scheduler, flights, depth, rng, live)
    while scheduler.has_unfinished() or flights:
        _pipelined_step(scheduler, flights, depth, rng, live)
    return scheduler


def _pipelined_step(
    scheduler: Scheduler,
    flights: deque[ScheduledBatch],
    depth: int,
    rng: random.Random,
    live: list[Sequence],
) -> None:
    issued = False
    if len(flights) < depth:
        batch = scheduler.schedule(depth)
        scheduler.block_manager.check_invariants()
        if batch.seqs:
            assert not any(seq.in_flight for seq in batch.seqs)  # never in two steps at once
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.in_flight = True
                assert len(seq.block_table) * 4 >= seq.num_computed_tokens + n
            flights.append(batch)
            issued = True
    in_flight = [s for b in flights for s in b.seqs if not s.is_finished]
    # A step in flight keeps its blocks: nothing preempted them.
    assert all(s.status is SequenceStatus.RUNNING and s.block_table for s in in_flight)
    if flights and (len(flights) >= depth or not issued):
        batch = flights.popleft()
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.in_flight = False
            if not seq.is_finished:  # (cancelled while in flight: nothing to apply)
                _advance(scheduler, seq, n)
    _cancel_now_and_then(scheduler, rng, live)


def _advance(scheduler: Scheduler, seq: Sequence, n: int) -> None:
    """The "model": ``n`` tokens computed; a token appended when the sequence is done."""
    seq.num_computed_tokens += n
    if seq.num_computed_tokens == seq.num_tokens:
        seq.token_ids.append(2)
        if seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, FinishReason.LENGTH)


def _cancel_now_and_then(scheduler: Scheduler, rng: random.Random, live: list[Sequence]) -> None:
    """Cancel a random live request now and then, whatever state it is in."""
    unfinished = [s for s in live if s.status is not SequenceStatus.FINISHED]
    if unfinished and rng.random() < 0.1:
        scheduler.finish(rng.choice(unfinished), FinishReason.ABORT)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), depth=st.integers(2, 4), num_blocks=st.integers(16, 48))
def test_steps_in_flight_keep_blocks_consistent(seed: int, depth: int, num_blocks: int) -> None:
    scheduler = _simulate_in_flight(seed, depth, num_blocks)
    scheduler.block_manager.check_invariants()
    assert scheduler.block_manager.num_free_blocks == num_blocks
    assert not scheduler.running and not scheduler.waiting


def test_each_step_in_flight_takes_its_share() -> None:
    """Two steps in flight split eight decoding sequences four and four: the second step
    takes the sequences the first does not hold."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256), BlockManager(64, 4))
    seqs = [Sequence(f"r{i}", [1] * 5, 5, SamplingParams()) for i in range(8)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule(2)
    assert len(first.seqs) == 4
    for seq in first.seqs:
        seq.in_flight = True
    second = scheduler.schedule(2)
    assert len(second.seqs) == 4
    assert not {id(s) for s in first.seqs} & {id(s) for s in second.seqs}
    for seq in second.seqs:
        seq.in_flight = True
    assert not scheduler.schedule(2).seqs  # everything is in flight


def test_thousands_of_requests_preempt_and_end_clean() -> None:
    scheduler = _simulate(seed=7, num_requests=3000, num_blocks=20, chunked=True)
    assert scheduler.num_preemptions_total > 100
    assert scheduler.block_manager.num_free_blocks == 20


def test_real_engine_with_random_aborts(make_tiny_model: Callable[..., Path]) -> None:
    from brook_engine import LLM

    llm = LLM(
        str(make_tiny_model("llama")),
        dtype="float32",
        kv_cache={"num_blocks": 12, "block_size": 8},
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=64,
        progress=False,
    )
    engine = llm.engine
    rng = random.Random(3)
    ids = 0
    for _ in range(150):
        if rng.random() < 0.5:
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                max_tokens=rng.randint(1, 30),
                seed=rng.randint(0, 9),
            )
            engine.add_request(f"q{ids}", prompt, params)
            ids += 1
        if rng.random() < 0.15 and ids:
            engine.abort_request(f"q{rng.randrange(ids)}")
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == 12
    assert engine.scheduler.num_preemptions_total > 0
    assert not engine.runner.sampler.generators
