"""Expert parallelism across real processes (gloo on loopback): the experts split whole over
two tensor ranks generate token for token what one process generates (and transformers), for
single requests and a mixed batch with chunked prefill and preemption; with rerouting on,
both layouts route the same batches the same way. Pipeline stages split MoE layers too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.examples import ROOT
from tests.support.parallel_llm import EXACT_KV
from tests.support.parallel_llm import parallel_llm as _engine

from brook_engine import LLM, SamplingParams
from brook_engine.layers.moe import SparseMoE
from support.greedy_reference import hf_greedy, random_prompts

NEW_TOKENS = 24
BATCH = {
    "kv_cache": {"num_blocks": 14, "block_size": 8},
    "max_num_batched_tokens": 16,
    "max_num_seqs": 8,
    "max_model_len": 96,
}


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _single(folder: Path, **options: Any) -> LLM:
    kv = {**EXACT_KV, **options.pop("kv_cache", {})}
    return LLM(str(folder), dtype="float32", device="cpu", kv_cache=kv, progress=False, **options)


@pytest.mark.parametrize(
    ("family", "tensor", "pipeline"),
    [
        pytest.param("mixtral", 2, 1, id="mixtral-ep2"),  # 2 experts per rank
        # 3 experts per rank, the shared expert split by width, layer 1 a dense MLP
        pytest.param("qwen2_moe", 2, 1, id="qwen2-moe-ep2"),
        pytest.param("qwen3_moe", 1, 2, id="qwen3-moe-pp2"),
    ],
)
def test_expert_parallel_matches_one_process_and_transformers(
    family: str,
    tensor: int,
    pipeline: int,
    make_tiny_model: Callable[..., Path],
    engines: list[LLM],
) -> None:
    folder = make_tiny_model(family)
    singles = random_prompts(320, [9, 23], seed=1)
    mixed = random_prompts(320, [3, 38, 11, 25, 1, 17], seed=2)
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want_singles = [hf_greedy(reference, p, NEW_TOKENS) for p in singles]
    one = _single(folder, **BATCH)
    want_mixed = _tokens(one, mixed)
    assert one.engine.scheduler.num_preemptions_total > 0

    parallel = _engine(folder, tensor, pipeline, **BATCH)
    engines.append(parallel)
    if tensor > 1:  # this rank holds half of each sparse layer's experts
        layer = parallel.engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp, SparseMoE) and layer.mlp.first_expert == 0
        assert len(layer.mlp.experts) * tensor == reference.config.num_experts
    assert [_tokens(parallel, [p])[0] for p in singles] == want_singles
    assert _tokens(parallel, mixed) == want_mixed
    assert parallel.engine.scheduler.num_preemptions_total > 0
    parallel.engine.block_manager.check_invariants()


def test_rerouting_across_ranks_is_consistent_and_repeatable(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """Each rank routes the whole (all-reduced, hence identical) batch with the same
    replicated router, so the ranks agree on every slot; the same batches give the same
    tokens. (Two layouts need not agree token for token: their partial sums round apart,
    and a capacity decision turns on the order of slots.)"""
    folder = make_tiny_model("mixtral")
    mixed = random_prompts(320, [3, 38, 11, 25, 1, 17], seed=3)
    reroute = {"reroute": True, "load_threshold": 1.05}
    no_sharing = {**BATCH["kv_cache"], "prefix_sharing": {"enabled": False}}
    # micro-batches pinned: each is routed on its own, and unpinned their number follows the
    # overlap monitor's timing
    parallel = _engine(
        folder,
        2,
        1,
        moe=reroute,
        parallel={"micro_batches": 1},
        **{**BATCH, "kv_cache": no_sharing},
    )
    engines.append(parallel)
    first = _tokens(parallel, mixed)
    assert _tokens(parallel, mixed) == first
    figures = parallel.engine.stats()
    assert figures.moe_rerouted_total > 0
    assert 0 < figures.moe_rank_utilization <= 1


def test_moe_example_runs_expert_parallel_with_rerouting(
    make_tiny_model: Callable[..., Path], engines: list[LLM]
) -> None:
    """``crds/examples/qwen3-moe-npu-ep4.yaml``'s engine sections as written (its moe,
    scheduler and KV block size) on a tiny random Qwen3-MoE, tensor parallel reduced from 4
    to this host's 2 (experts 4 per rank), float32 on CPU."""
    spec = yaml.safe_load((ROOT / "crds" / "examples" / "qwen3-moe-npu-ep4.yaml").read_text())[
        "spec"
    ]
    assert spec["parallel"]["tensor"] == 4 and spec["moe"]["reroute"] is True
    folder = make_tiny_model("qwen3_moe")
    llm = _engine(
        folder,
        2,
        1,
        moe=spec["moe"],
        scheduler=spec["scheduler"],
        kv_cache={"blockSize": spec["kvCache"]["blockSize"], "numBlocks": 16},
        max_model_len=512,
    )
    engines.append(llm)
    prompts = random_prompts(320, [40, 7, 90, 23, 5, 61], seed=9)
    outs = _tokens(llm, prompts)
    assert [len(o) for o in outs] == [NEW_TOKENS] * len(prompts)
    stats = llm.engine.stats()
    assert stats.moe_routed_total > 0 and stats.moe_rerouted_total > 0
    assert 0 < stats.moe_expert_utilization <= 1


def test_served_moe_model_answers_the_openai_client_and_exports_expert_load(
    make_tiny_model: Callable[..., Path], server_factory: Any, tmp_path: Path
) -> None:
    """A Qwen2-MoE (shared expert, a dense layer) served over HTTP with rerouting on: the
    official client's completion is the offline engine's, and ``/metrics`` carries the load
    figures."""
    import openai

    folder = make_tiny_model("qwen2_moe")
    moe = {"reroute": True, "loadThreshold": 1.05}
    server = server_factory(
        folder, tmp_path, moe=moe, scheduler={"maxNumSeqs": 8, "maxNumBatchedTokens": 64}
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
        prompt = random_prompts(320, [30], seed=12)[0]
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        offline = LLM(
            str(folder), dtype="float32", device="cpu", num_blocks=64, progress=False,
            moe={"reroute": True, "load_threshold": 1.05},
        )  # fmt: skip
        [expected] = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
        assert reply.choices[0].text == expected.outputs[0].text
        samples = server.metrics()
        assert samples["brook_engine_moe_routed_tokens_total"] > 0
        assert samples["brook_engine_moe_rerouted_tokens_total"] > 0
        assert 0 < samples["brook_engine_moe_expert_utilization"] <= 1
        assert samples["brook_engine_moe_load_cv"] >= 0
        per_expert = [
            samples.get(f'brook_engine_moe_expert_tokens_total{{expert="{e}"}}', 0)
            for e in range(6)
        ]
        assert sum(per_expert) == samples["brook_engine_moe_routed_tokens_total"]
    finally:
        assert server.stop() == 0


def test_moe_bench_reports_rerouting_off_and_on(
    make_tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``brook-engine bench --workload moe`` on a tiny Mixtral (this checks the tool, not
    speed): four rows, the load figures, the quality cost; a dense model is refused."""
    import json

    from brook_engine.cli import main

    folder = make_tiny_model("mixtral")
    common = ["bench", "--workload", "moe", "--num-requests", "6", "--input-len", "8:24"]
    common += ["--output-len", "4", "--moe-load-threshold", "1.05", "--json"]
    assert main([*common, "--model", str(folder)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["layout"], r["reroute"]): r for r in report["rows"]}
    assert set(rows) == {("1 device", False), ("1 device", True), ("EP=2", False), ("EP=2", True)}
    for (_, reroute), row in rows.items():
        assert row["output_tok_s"] > 0 and 0 < row["expert_utilization"] <= 1
        assert (row["reroute_rate"] > 0) == reroute
    summary = report["summary"]
    assert summary["threshold"] == 1.05 and 0 <= summary["teacher_forced_agreement"] <= 1
    assert 0 <= summary["w8a16_agreement"] <= 1
    dense = [a for a in common if a not in ("--moe-load-threshold", "1.05")]
    assert main([*dense, "--model", str(make_tiny_model("llama"))]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().out
