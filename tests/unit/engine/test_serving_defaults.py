"""A server's defaults where its configuration leaves the choice to Brook: on CPU a step
budget of 512 tokens (first tokens sooner), anything set kept as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from brook_engine.config import load_engine_config
from brook_engine.core.serving_defaults import CPU_SERVING_BATCHED_TOKENS, serving_defaults
from brook_engine.llm import engine_config_from_options


def test_a_cpu_server_without_a_budget_takes_the_serving_one() -> None:
    config = engine_config_from_options("m", {"device": "cpu"})
    assert config.scheduler.max_num_batched_tokens == 2048  # the offline default
    served = serving_defaults(config)
    assert served.scheduler.max_num_batched_tokens == CPU_SERVING_BATCHED_TOKENS == 512
    assert serving_defaults(served) is served  # now set: applied once
    assert config.scheduler.max_num_batched_tokens == 2048  # the caller's config unchanged


@pytest.mark.parametrize(
    ("options", "budget"),
    [
        ({"max_num_batched_tokens": 4096}, 4096),  # set: kept, even at the offline default
        ({"max_num_batched_tokens": 2048}, 2048),
        ({"max_num_seqs": 600}, 600),  # a decode step may need one token per sequence
        ({"scheduler": {"chunked_prefill": False}}, 2048),  # whole prompts need the room
        ({"device": "cuda"}, 2048),  # an accelerator prefills 2,048 tokens in milliseconds
        ({"device": "npu"}, 2048),
    ],
)
def test_what_is_set_or_needs_more_room_is_kept(options: dict[str, object], budget: int) -> None:
    config = engine_config_from_options("m", {"device": "cpu", **options})
    assert serving_defaults(config).scheduler.max_num_batched_tokens == budget


def test_a_config_file_that_sets_the_budget_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("model: {uri: m}\ndevice: cpu\nscheduler: {maxNumBatchedTokens: 2048}\n")
    assert serving_defaults(load_engine_config(path)).scheduler.max_num_batched_tokens == 2048
    path.write_text("model: {uri: m}\ndevice: cpu\nscheduler: {maxNumSeqs: 32}\n")
    assert serving_defaults(load_engine_config(path)).scheduler.max_num_batched_tokens == 512
