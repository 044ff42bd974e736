"""The memory plan (torch-free): per-rank figures for the shipped examples checked by hand,
the resident/streamed choice under a budget, and refusals with the numbers."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from brook_engine.config import ConfigError, parse_engine_config
from brook_engine.offload.command import memory_plan, read_plan_config
from brook_engine.offload.plan import GIB, ModelShape, Target, build_plan, spread

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests" / "data" / "model_configs"
EXAMPLES = ROOT / "crds" / "examples"


def _config(**sections: object) -> object:
    return parse_engine_config({"model": {"uri": "file:///m"}, **sections})


def _shape(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def test_110b_tp4_pp2_w8a16_plan_matches_a_hand_count() -> None:
    config = read_plan_config(EXAMPLES / "qwen-110b-npu-tp4-pp2.yaml")
    plan = memory_plan(config, CONFIGS / "Qwen1.5-110B-Chat.json", 64)
    assert len(plan.ranks) == 8 and plan.target.device == "npu"
    # By hand: hidden 8192, 64 heads of 128, 8 KV heads, MLP 49152; a tensor rank holds
    # 16 heads and 2 KV heads: qkv (2048 + 2·256) × 8192 int8 + a bf16 scale per row and a
    # bf16 bias per row (Qwen), o 8192 × 2048 int8 + scales.
    qkv_rows = 2048 + 2 * 256
    attention = (qkv_rows * 8192 + 2 * qkv_rows + 2 * qkv_rows) + (8192 * 2048 + 2 * 8192)
    ffn = (2 * 12288 * 8192 + 2 * 2 * 12288) + (8192 * 12288 + 2 * 8192)
    rank = plan.ranks[0]
    assert rank.piece_bytes == {"attention": attention, "ffn": ffn}
    assert rank.layers == (0, 40)  # 80 layers over two stages (the head weighs ~2 layers)
    # the first stage holds the embedding slice: 152064 / 4 rows × 8192 × 2 bytes
    assert rank.fixed_bytes["embedding"] == 38016 * 8192 * 2
    last = plan.ranks[-1]
    assert last.fixed_bytes["head"] == 38016 * 8192 * 2 + 38016 * 8192 + 38016 * 2
    assert not rank.streamed  # no offload in this example
    assert rank.kv["blocks"] > 0 and rank.kv["sequences"] >= 1


def test_qwen3_moe_ep4_plan_matches_a_hand_count() -> None:
    config = read_plan_config(EXAMPLES / "qwen3-moe-npu-ep4.yaml")
    plan = memory_plan(config, CONFIGS / "Qwen3-30B-A3B.json", 64)
    assert len(plan.ranks) == 4
    # By hand: hidden 2048, 32 heads of 128 and 4 KV heads over 4 ranks (8 and 1 each);
    # 128 experts of 768, 32 whole experts per rank, the router (128 x 2048) on every rank.
    attention = (1024 + 2 * 128) * 2048 * 2 + 2048 * 1024 * 2
    ffn = 128 * 2048 * 2 + 32 * (2 * 768 * 2048 * 2 + 2048 * 768 * 2)
    rank = plan.ranks[0]
    assert rank.piece_bytes == {"attention": attention, "ffn": ffn}
    # the layers' norms and Qwen3's per-head q/k norms, and the final norm
    assert rank.fixed_bytes["norms"] == 48 * (2 * 2048 + 2 * 128) * 2 + 2048 * 2
    assert rank.fixed_bytes["embedding"] == rank.fixed_bytes["head"] == 37984 * 2048 * 2
    # 30.5 B parameters in bfloat16 over four cards
    assert rank.total_bytes / GIB == pytest.approx(14.236, abs=0.001)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_plans(example: str) -> None:
    config = read_plan_config(EXAMPLES / example)
    model = {
        "llama-70b-npu-tp8.yaml": "Llama-3.1-70B-Instruct",
        "qwen-110b-npu-tp4-pp2.yaml": "Qwen1.5-110B-Chat",
        "qwen-7b-autoscaled.yaml": "Qwen2.5-7B-Instruct",
        "qwen3-moe-npu-ep4.yaml": "Qwen3-30B-A3B",
    }.get(example, "SmolLM2-135M-Instruct")
    plan = memory_plan(config, CONFIGS / f"{model}.json", 64)
    assert plan.ranks and all(r.total_bytes > 0 for r in plan.ranks)
    assert "rank" in plan.table()


def test_a_budget_keeps_attention_then_spread_whole_layers() -> None:
    shape = _shape("Qwen2.5-7B-Instruct")
    target = Target("npu", "bfloat16")
    full = build_plan(_config(), shape, target).ranks[0]
    budget = 0.42 * full.total_bytes
    config = _config(offload={"policy": "static", "deviceMemoryLimitGb": budget / GIB})
    rank = build_plan(config, shape, target).ranks[0]
    assert rank.device_bytes <= budget
    assert all((i, "attention") in rank.resident for i in range(28))  # priorityLayers
    streamed_layers = sorted({i for i, _ in rank.streamed})
    assert all(kind == "ffn" for _, kind in rank.streamed)
    assert rank.slots == {"ffn": 2}
    gaps = {b - a for a, b in itertools.pairwise(streamed_layers)}
    assert max(gaps) <= 2  # resident layers spread between the streamed ones
    assert rank.host_pieces == len(rank.streamed)  # accelerators: every piece in the pool


def test_spread_is_even() -> None:
    assert spread(2, 0, 10) == [2, 7]
    assert spread(0, 0, 10) == []
    assert spread(10, 0, 10) == list(range(10))


def test_a_budget_below_the_fixed_weights_is_refused_with_numbers() -> None:
    config = _config(offload={"policy": "static", "deviceMemoryLimitGb": 1})
    with pytest.raises(ConfigError) as err:
        build_plan(config, _shape("Qwen2.5-7B-Instruct"), Target("cuda", "bfloat16"))
    text = str(err.value)
    assert "deviceMemoryLimitGb: 1.000 GiB cannot hold rank 0's fixed weights" in text
    assert "raise it to" in text and "GiB" in text


def test_a_pool_below_the_staging_buffers_is_refused() -> None:
    shape = _shape("Qwen2.5-7B-Instruct")
    config = _config(offload={"policy": "static", "deviceMemoryLimitGb": 6, "cpuMemoryPoolGb": 0.1})
    with pytest.raises(ConfigError, match=r"cpuMemoryPoolGb: 0.1 GiB cannot hold rank 0's staging"):
        build_plan(config, shape, Target("npu", "bfloat16"))


def test_plan_command_prints_a_table_and_json(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "brook_engine.cli", "plan"]
    example = str(EXAMPLES / "qwen-110b-npu-tp4-pp2.yaml")
    model = str(CONFIGS / "Qwen1.5-110B-Chat.json")
    table = subprocess.run(
        [*run, "--config", example, "--model-config", model, "--device-memory-gb", "64"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "tensor 4 x pipeline 2" in table and table.count("\n") >= 10
    data = json.loads(
        subprocess.run(
            [*run, "--config", example, "--model-config", model, "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert len(data["ranks"]) == 8
