"""The adaptive weight-offload policy driven through a KV-pressure phase and a calm one, the
same way for one device and for a replica of several ranks: every step the weights stay
within the budget and the runner's cache agrees with the block table."""

from __future__ import annotations

from collections.abc import Callable

from brook_engine import SamplingParams
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.offload.adaptive import AdaptivePolicy


def quick_policy(engine: LLMEngine) -> AdaptivePolicy:
    """The engine's adaptive policy, its hysteresis shortened to a test's few steps."""
    policy = engine.adaptive
    assert policy is not None
    policy.pressure_steps, policy.calm_steps, policy.cooldown_steps = 2, 6, 3
    return policy


def run_under_pressure(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    held: Callable[[], int],
    budget: int,
) -> tuple[list[list[int]], int]:
    """Every prompt at once; the tokens of each, in order, and the most KV blocks seen."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    got: dict[str, list[int]] = {}
    most_blocks = engine.block_manager.num_blocks
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        assert held() <= budget
        most_blocks = max(most_blocks, engine.block_manager.num_blocks)
        assert engine.runner.num_blocks == engine.block_manager.num_blocks
    return [got[f"p{i}"] for i in range(len(prompts))], most_blocks


def calm_until_restored(
    engine: LLMEngine, prompt: list[int], held: Callable[[], int], budget: int, tries: int = 40
) -> None:
    """One short request at a time, until every move out has come back (or ``tries``)."""
    policy = engine.adaptive
    assert policy is not None
    for i in range(tries):
        engine.add_request(f"calm{i}", prompt, SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
            assert held() <= budget
        if not policy.evicted:
            return
