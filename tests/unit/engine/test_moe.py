"""Mixture-of-experts: the router against transformers' own routers, load-aware rerouting's
rules, the expert block grouped by expert, the engine's load figures and the settings it
refuses. (Logits and greedy tokens against transformers for every family are in
``test_engine_vs_transformers``; expert parallelism across processes in
``tests/integration/test_moe_parallel``.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError, parse_engine_config
from brook_engine.layers.moe import ExpertLoad, Routing, SparseMoE, capacity, route
from brook_engine.models.llama import MLP
from support.checkpoints import copy_with
from support.greedy_reference import random_prompts

EXACT_KV = {
    "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}],
    "dynamic_precision": {"enabled": False},
}


def _skewed_logits(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Router logits leaning hard toward experts 0 and 1, as trained routers often do."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, :2] += 2.0
    return logits


def _routing(experts: int = 8, k: int = 2, normalize: bool = True, **kw: Any) -> Routing:
    return Routing(experts, k, normalize, weights_in_model_dtype=False, **kw)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_router_matches_transformers(family: str) -> None:
    import importlib

    import transformers

    config_cls, router_cls, normalize = {
        "mixtral": ("MixtralConfig", "MixtralTopKRouter", True),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeTopKRouter", False),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeTopKRouter", True),
    }[family]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(transformers, config_cls)(
        hidden_size=32, num_experts=8, num_local_experts=8, num_experts_per_tok=2,
        norm_topk_prob=normalize,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = getattr(module, router_cls)(config)
    torch.nn.init.normal_(reference.weight)
    x = torch.randn(40, 32)
    _, want_weights, want_experts = reference(x)
    routing = Routing(8, 2, normalize, weights_in_model_dtype=family != "mixtral")
    got = route(torch.nn.functional.linear(x, reference.weight), routing)
    assert torch.equal(got.experts, want_experts)
    torch.testing.assert_close(got.weights, want_weights)
    assert got.kept is None


def _full_when_dropped(routed: Any) -> None:
    """A slot is dropped only where its expert is full, and an expert holds more than its
    capacity only through tokens all of whose choices were full."""
    kept, cap = routed.kept, routed.capacity
    load = torch.bincount(routed.experts[kept], minlength=int(routed.experts.max()) + 1)
    for t in range(routed.experts.shape[0]):
        choices = routed.experts[t].tolist()
        for slot, e in enumerate(choices):
            if not kept[t, slot]:
                assert load[e] >= cap, f"token {t} dropped expert {e} that had room"
    overflow = int((load - cap).clamp(min=0).sum())
    orphans = [
        t for t in range(kept.shape[0])
        if kept[t].sum() == 1 and all(load[e] >= cap for e in routed.experts[t].tolist())
    ]  # fmt: skip
    assert overflow <= len(orphans)


@pytest.mark.parametrize("favoured", [1, 2])
def test_reroute_stays_within_top_k_and_under_capacity(favoured: int) -> None:
    routing = _routing(reroute=True, threshold=1.25)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(favoured))
    logits[:, :favoured] += 2.0  # a router leaning hard toward a few experts
    plain = route(logits, _routing())
    routed = route(logits, routing)
    assert routed.kept is not None and routed.capacity == capacity(64, routing)
    assert routed.capacity == math.floor(1.25 * 64 * 2 / 8)
    # the same choices, in the same order: rerouting only drops slots
    assert torch.equal(routed.experts, plain.experts)
    before = torch.bincount(plain.experts.reshape(-1), minlength=8)
    load = torch.bincount(routed.experts[routed.kept], minlength=8)
    assert before.max() > routed.capacity  # the skew overloads the favoured experts
    assert (~routed.kept).any()
    assert routed.kept.any(dim=1).all()  # every token keeps one of its own top-k experts
    _full_when_dropped(routed)
    if favoured == 1:  # every token's second choice has room: no expert over capacity
        assert int(load.max()) <= routed.capacity
    assert load.max() < before.max()
    # dropped weight moved to the kept choices, renormalized to 1 as Mixtral does
    torch.testing.assert_close(routed.weights.sum(dim=1), torch.ones(64))
    assert (routed.weights[~routed.kept] == 0).all()


def test_reroute_goes_to_a_choice_with_room_and_only_overflows_when_none_has() -> None:
    routing = _routing(experts=4, k=2, reroute=True, threshold=1.0)
    # every token prefers expert 0, then expert 1: capacity 4 of 16 slots (8 tokens x 2 / 4)
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(8, 1)
    routed = route(logits, routing)
    assert routed.capacity == 4 and routed.kept is not None
    kept = routed.kept
    # tokens 0..3 take expert 0's four places; every other slot of expert 0 is dropped, so
    # tokens 4..7 go to their second choice, expert 1, which tokens 0..3 could not fill
    # (their second choices come after every first choice); that leaves expert 1 full too
    assert kept[:4, 0].all() and not kept[4:, 0].any()
    assert kept[4:, 1].all() and not kept[:4, 1].any()
    _full_when_dropped(routed)


def test_reroute_without_normalization_keeps_the_top_k_mass() -> None:
    routing = _routing(normalize=False, reroute=True, threshold=1.1)
    logits = _skewed_logits(50, 8, seed=3)
    plain = route(logits, _routing(normalize=False))
    routed = route(logits, routing)
    torch.testing.assert_close(routed.weights.sum(dim=1), plain.weights.sum(dim=1))


def test_reroute_is_the_same_for_the_same_batch() -> None:
    routing = _routing(experts=16, k=4, reroute=True, threshold=1.3)
    logits = _skewed_logits(300, 16, seed=5)
    first, second = route(logits, routing), route(logits.clone(), routing)
    assert first.kept is not None and second.kept is not None
    assert torch.equal(first.kept, second.kept) and torch.equal(first.weights, second.weights)


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "threshold"),
    [(7, 4, 2, 1.0), (60, 8, 2, 1.25), (200, 16, 4, 1.1), (33, 6, 3, 1.5)],
)
def test_small_steps_walked_in_python_keep_the_same_slots(
    tokens: int, experts: int, k: int, threshold: float
) -> None:
    from brook_engine.layers import moe

    logits = _skewed_logits(tokens, experts, seed=tokens)
    chosen = torch.topk(logits, k, dim=-1).indices
    cap = capacity(tokens, _routing(experts, k, threshold=threshold))
    walked = moe._keep_in_python(chosen, experts, cap)
    saved = moe.SMALL_STEP
    moe.SMALL_STEP = 0  # the tensor path
    try:
        counted = moe.load_aware_keep(chosen, experts, cap)
    finally:
        moe.SMALL_STEP = saved
    assert torch.equal(walked, counted)


def test_the_utilization_bound_is_reached_by_the_best_assignment_and_never_passed() -> None:
    from brook_engine.layers.moe import utilization_bound

    # 4 experts, 6 tokens top-2; expert 3 is in nobody's top-2
    assert utilization_bound([6, 4, 2, 0], tokens=6, cap=3) == pytest.approx(
        (2 + 2 + 2 + 0) / (4 * 2)  # max load 2 serves all six tokens: 6 slots
    )
    # even demand: a perfect assignment exists
    assert utilization_bound([3, 3, 3, 3], tokens=6, cap=3) == 1.0
    # brute force on small cases: every assignment keeping >= 1 top-k expert per token
    import itertools

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        choices = [torch.randperm(4, generator=g)[:2].tolist() for _ in range(5)]
        demand = [sum(e in c for c in choices) for e in range(4)]
        cap = 3
        best = 0.0
        for keep in itertools.product([(1, 0), (0, 1), (1, 1)], repeat=5):
            load = [0] * 4
            for c, k in zip(choices, keep, strict=True):
                for e, on in zip(c, k, strict=True):
                    load[e] += on
            if max(load) <= cap:
                best = max(best, sum(load) / (4 * max(load)))
        assert utilization_bound(demand, 5, cap) >= best - 1e-12


def test_top_1_routing_has_nothing_to_reroute_to() -> None:
    routed = route(_skewed_logits(32, 8), _routing(k=1, reroute=True))
    assert routed.kept is None


def test_expert_block_groups_tokens_by_expert_and_matches_a_per_token_loop() -> None:
    torch.manual_seed(1)
    routing = _routing(experts=4, k=2)
    from brook_engine.layers.tensor_parallel import Shard

    block = SparseMoE(
        16, 24, 0, routing, 0, torch.float32, Shard(), None,
        lambda width, comm: MLP(16, width, False, torch.float32, comm),
    )  # fmt: skip
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    load = ExpertLoad(4)
    block.load = load
    x = torch.randn(9, 16)
    got = block(x)
    routed = route(block.gate(x), routing)
    want = torch.zeros_like(x)
    for t in range(9):  # the slow, obvious way
        for slot in range(2):
            e = int(routed.experts[t, slot])
            want[t] += routed.weights[t, slot] * block.experts[e](x[t : t + 1])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    figures = load.figures()
    assert figures.routed_total == 18 and sum(figures.expert_tokens_total) == 18
    counts = torch.bincount(routed.experts.reshape(-1), minlength=4).tolist()
    assert list(figures.expert_tokens_total) == counts
    mean = 18 / 4
    assert figures.utilization == pytest.approx(mean / max(counts))
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / 4)
    assert figures.load_cv == pytest.approx(std / mean)


def _llm(folder: Path, **options: Any) -> LLM:
    kv = {**EXACT_KV, **options.pop("kv_cache", {})}
    return LLM(str(folder), dtype="float32", kv_cache=kv, progress=False, **options)


def test_engine_reports_expert_load_and_reroutes_deterministically(
    make_tiny_model: Callable[..., Path],
) -> None:
    folder = make_tiny_model("qwen3_moe")
    prompts = random_prompts(320, [30, 12, 25, 7], seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _llm(folder)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    figures = plain.engine.runner.model.expert_load.figures()  # type: ignore[union-attr]
    assert figures.routed_total > 0 and figures.rerouted_total == 0
    assert 0 < figures.utilization < 1 and figures.load_cv > 0
    # rerouting depends on the batch, so each run starts from a fresh engine (a second run
    # on the same one would find its prompts in the prefix cache and batch differently)
    engines = [_llm(folder, moe={"reroute": True, "load_threshold": 1.05}) for _ in range(2)]
    runs = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for llm in engines
    ]
    assert runs[0] == runs[1]  # the same batches route the same way
    rerouted = engines[0]
    load = rerouted.engine.runner.model.expert_load.figures()  # type: ignore[union-attr]
    assert load.rerouted_total > 0
    assert load.utilization > figures.utilization
    # no assignment within the tokens' top-k beats the bound; rerouting stays under it
    assert figures.utilization_bound is None and load.utilization_bound is not None
    assert load.utilization <= load.utilization_bound + 1e-9
    stats = rerouted.engine.stats()
    assert stats.moe_rerouted_total == load.rerouted_total
    assert stats.moe_expert_utilization == pytest.approx(load.utilization)
    assert len(want) == len(runs[0])


def test_w8a16_experts_are_int8_and_track_the_float_model(
    make_tiny_model: Callable[..., Path],
) -> None:
    from brook_engine.quant.linear import Int8Linear

    folder = make_tiny_model("mixtral")
    llm = _llm(folder, quantization={"weights": "w8a16"})
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp, SparseMoE)
    assert all(isinstance(e.gate_up_proj, Int8Linear) for e in layer.mlp.experts)
    assert layer.mlp.gate.weight.dtype == torch.float32  # the router stays in float
    # The int8 experts are the float ones to within their quantization: the logits stay
    # close to the float engine's — except where a router's near-tie flips a token's expert
    # (a discontinuity of top-k, not an error), which moves that position further.
    [prompt] = random_prompts(320, [40], seed=6)
    want = _llm(folder).engine.prompt_logits(prompt)
    got = llm.engine.prompt_logits(prompt)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float((cosine > 0.998).float().mean()) >= 0.9
    assert float(cosine.min()) > 0.9
    assert not torch.equal(got, want)  # they are quantized
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("family", "options", "message"),
    [
        ("qwen3_moe", {"shapes": {"mode": "compile"}}, r"shapes\.mode: compile mode"),
        ("qwen3", {"shapes": {"mode": "compile"}}, r"shapes\.mode: .*q/k-norm"),
        (
            "mixtral",
            {"offload": {"policy": "static", "device_memory_limit_gb": 1}},
            r"offload\.policy: .*mixture-of-experts",
        ),
        ("llama", {"moe": {"reroute": True}}, r"moe\.reroute: .*dense model"),
        ("llama", {"moe": {"top_k": 2}}, r"moe\.topK: .*dense model"),
        ("mixtral", {"moe": {"top_k": 5}}, r"moe\.topK \(5\) exceeds the model's 4 experts"),
        ("mixtral", {"moe": {"top_k": 1, "reroute": True}}, r"moe\.reroute: with one expert"),
        ("mixtral", {"moe": {"load_threshold": 1.5}}, r"moe\.loadThreshold: applies to rerout"),
        (
            "qwen2_moe",
            {"parallel": {"tensor": 4}},
            r"parallel\.tensor \(4\) must divide .*6 experts",
        ),
    ],
)
def test_settings_it_cannot_honour_are_refused(
    family: str, options: dict[str, Any], message: str, make_tiny_model: Callable[..., Path]
) -> None:
    with pytest.raises(ConfigError, match=message):
        _llm(make_tiny_model(family), **options)


@pytest.mark.parametrize(("family", "tensor"), [("mixtral", 1), ("qwen3_moe", 1), ("qwen3_moe", 2)])
def test_the_memory_plan_counts_what_an_moe_model_loads(
    family: str, tensor: int, make_tiny_model: Callable[..., Path]
) -> None:
    """The torch-free plan (``brook-engine plan``, ``brook validate --model-config``) holds
    a rank's experts, routers and q/k norms at the bytes the loaded tensors take."""
    import json

    from brook_engine.layers.tensor_parallel import Shard
    from brook_engine.models.arch import ModelArch
    from brook_engine.models.loader import load_model
    from brook_engine.offload.plan import ModelShape, Target, build_plan

    folder = make_tiny_model(family)
    config = parse_engine_config(
        {"model": {"uri": str(folder)}, "parallel": {"tensor": tensor}, "device": "cpu"}
    )
    shape = ModelShape.from_config(json.loads((folder / "config.json").read_text()))
    plan = build_plan(config, shape, Target(device="cpu", dtype="float32"))
    arch = ModelArch.from_folder(folder)
    model, _ = load_model(
        arch, folder, torch.float32, torch.device("cpu"), Shard(0, tensor), None, False,
        config=config,
    )  # fmt: skip
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.ranks[0].total_bytes == held


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        # an expert the config does not have
        (
            {"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)},
            r"unexpected tensor 'model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight'",
        ),
        # a part no expert has
        (
            {"model.layers.1.block_sparse_moe.experts.0.w9.weight": torch.zeros(96, 64)},
            r"unexpected tensor 'model\.layers\.1\.block_sparse_moe\.experts\.0\.w9\.weight'",
        ),
        # an expert's projection missing: named as Brook holds it
        (
            {"model.layers.2.block_sparse_moe.experts.1.w3.weight": None},
            r"checkpoint lacks model\.layers\.2\.mlp\.experts\.1\.gate_up_proj\.weight",
        ),
        # a router of the wrong width
        (
            {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(5, 64)},
            r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' has shape \(5, 64\)",
        ),
    ],
)
def test_bad_moe_checkpoints_name_the_tensor(
    tensors: dict[str, torch.Tensor | None],
    message: str,
    make_tiny_model: Callable[..., Path],
    tmp_path: Path,
) -> None:
    copy_with(make_tiny_model("mixtral"), tmp_path, tensors)
    with pytest.raises(ConfigError, match=message):
        _llm(tmp_path)
