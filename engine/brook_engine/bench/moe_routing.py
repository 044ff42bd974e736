"""``brook-engine bench --workload moe``: load-aware expert routing, off and on, on one device
and expert parallel over this host's cores (each core standing in for one device).

The model (``--model random-moe``, built once into ``--moe-model-dir``) is a random
Mixtral-shaped MoE whose router leans toward a few experts, as trained routers often do: the
embedding carries a shared direction and the favoured experts' router rows point along it.
Any MoE folder works as ``--model`` too.

Per row: throughput, the load figures the engine exports (coefficient of variation of
tokens per expert, expert utilization = mean / busiest expert, the same over the
expert-parallel ranks, the share of token slots rerouted). The quality cost is the
teacher-forced agreement of reroute-on with reroute-off: over the workload's prompts, the
share of positions where both pick the same next token (each prompt's prefill is one
routing batch per chunk).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from brook_engine.bench.machine import machine_info, machine_line
from brook_engine.bench.run import run_engine
from brook_engine.bench.workload import Workload, random_workload_for
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.llm import engine_config_from_options

RANDOM_MOE = "random-moe"
#: The random MoE: 8 experts of 1,024 on 4 layers, top-2, hidden 512 (float32: 0.30 GiB)
SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
FAVOURED = 2  # experts the router leans toward
SKEW = {"embedding": 1.0, "router": 0.6, "head": 4.0}  # the shared direction's weight in each


def build_random_moe(folder: Path) -> Path:
    """Write the skewed random MoE (and a word-level tokenizer for its ids) into ``folder``,
    unless a build of the same recipe is there already."""
    recipe = {"shape": SHAPE, "favoured": FAVOURED, "skew": SKEW, "seed": 0, "tokenizer": 2}
    marker = folder / "brook-random-moe.json"
    if marker.exists() and json.loads(marker.read_text(encoding="utf-8")) == recipe:
        return folder
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.MixtralConfig(**SHAPE, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    hidden = SHAPE["hidden_size"]
    direction = torch.randn(hidden)
    direction /= direction.norm()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed += SKEW["embedding"] * embed.std() * direction  # every token shares it
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[:FAVOURED] += SKEW["router"] * direction
        # random init predicts near-uniformly; sharpen it so next-token choices are decisive
        # (as a trained model's mostly are) and agreement measures routing, not ties
        model.lm_head.weight.mul_(SKEW["head"])
    model.save_pretrained(folder, safe_serialization=True)
    # byte-level: any text encodes (KV calibration reads text); ids past the bytes are spare
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), SHAPE["vocab_size"])})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<t1>", "tokenizer_class": "PreTrainedTokenizerFast"}),
        encoding="utf-8",
    )
    marker.write_text(json.dumps(recipe), encoding="utf-8")
    return folder


@dataclass
class Row:
    layout: str
    reroute: bool
    output_tok_s: float
    total_tok_s: float
    elapsed_s: float
    load_cv: float
    load_std: float
    expert_utilization: float
    rank_utilization: float
    reroute_rate: float
    preemptions: int
    utilization_bound: float | None = None


def _engine(
    model: str, options: dict[str, Any], tensor: int, reroute: bool, threshold: float
) -> LLMEngine:
    parallel = {"tensor": tensor, "micro_batches": 1}  # one routing batch per step
    moe = {k: v for k, v in options.get("moe", {}).items() if k != "load_threshold"}
    moe["reroute"] = reroute
    if reroute:
        moe["load_threshold"] = threshold
    config = engine_config_from_options(model, {**options, "parallel": parallel, "moe": moe})
    return LLMEngine(config, progress=False)


def _run(
    model: str,
    options: dict[str, Any],
    workload: Workload,
    tensor: int,
    reroute: bool,
    threshold: float,
    per_device: int,
) -> Row:
    torch.set_num_threads(per_device * tensor)  # rank 0 keeps its share, workers theirs
    engine = _engine(model, options, tensor, reroute, threshold)
    try:
        load = engine.runner.model.expert_load
        if load is not None:
            load.window = 1 << 40  # the whole run's steps, prefill ones included
        engine.warm_up()
        report = run_engine(engine, workload, "batch", progress=False)
        stats = engine.stats()
        routed = max(1, stats.moe_routed_total + stats.moe_rerouted_total)
        name = "1 device" if tensor == 1 else f"EP={tensor}"
        return Row(
            name,
            reroute,
            report.output_tok_s,
            report.total_tok_s,
            report.elapsed_s,
            stats.moe_load_cv,
            stats.moe_load_std,
            stats.moe_expert_utilization,
            stats.moe_rank_utilization,
            stats.moe_rerouted_total / routed,
            stats.num_preemptions_total,
            load.figures().utilization_bound if load is not None else None,
        )
    finally:
        engine.shutdown()


def teacher_forced_agreement(
    model: str, options: dict[str, Any], prompts: list[list[int]], threshold: float
) -> tuple[float, float]:
    """Over ``prompts``' positions: the share where reroute-on picks reroute-off's next
    token, and the mean KL divergence of its next-token distribution from reroute-off's."""
    return _compare(
        [_engine(model, options, 1, reroute, threshold) for reroute in (False, True)], prompts
    )


def w8a16_agreement(
    model: str, options: dict[str, Any], prompts: list[list[int]], threshold: float
) -> tuple[float, float]:
    """The same for W8A16 against the float model (reroute off): a change of known size."""
    quantized = {**options, "quantization": {"weights": "w8a16"}}
    plain = {**options, "quantization": {"weights": "none"}}
    engines = [_engine(model, plain, 1, False, threshold)]
    engines.append(_engine(model, quantized, 1, False, threshold))
    return _compare(engines, prompts)


def _compare(engines: list[LLMEngine], prompts: list[list[int]]) -> tuple[float, float]:
    logits: list[list[torch.Tensor]] = []
    for engine in engines:
        try:
            logits.append([engine.prompt_logits(p).float() for p in prompts])
        finally:
            engine.shutdown()
    same, kl, positions = 0, 0.0, 0
    for base, other in zip(*logits, strict=True):
        same += int((base.argmax(-1) == other.argmax(-1)).sum())
        log_base, log_other = base.log_softmax(-1), other.log_softmax(-1)
        kl += float((log_base.exp() * (log_base - log_other)).sum())
        positions += base.shape[0]
    return same / positions, kl / positions


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def bench_moe(args: Any, options: dict[str, Any]) -> int:
    model = args.model
    if model == RANDOM_MOE:
        folder = Path(args.moe_model_dir or Path.home() / ".cache" / "brook" / RANDOM_MOE)
        if not args.json:
            print(f"building the skewed random MoE in {folder} (once) ...", flush=True)
        model = str(build_random_moe(folder))
    options = {"device": "cpu", **options}
    threshold = float(options.get("moe", {}).get("load_threshold", 1.25))
    probe = _engine(model, options, 1, False, threshold)
    experts = probe.arch.experts
    if experts is None:
        print(f"error: --workload moe needs a mixture-of-experts model; {model} is dense")
        probe.shutdown()
        return 2
    workload = random_workload_for(args, probe)
    probe.shutdown()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    tensor = 2 if cores >= 2 and experts.num_experts % 2 == 0 else 1
    per_device = max(1, cores // tensor)
    rounds = max(1, int(getattr(args, "rounds", 1) or 1))
    runs: dict[tuple[int, bool], list[Row]] = {}
    for index in range(rounds):  # alternating, so drift of the host falls on every row
        for layout in sorted({1, tensor}):
            for reroute in (False, True):
                if not args.json:
                    name = "1 device" if layout == 1 else f"EP={layout}"
                    state = "on" if reroute else "off"
                    print(f"round {index + 1}/{rounds}: {name}, reroute {state} ...", flush=True)
                row = _run(model, options, workload, layout, reroute, threshold, per_device)
                runs.setdefault((layout, reroute), []).append(row)
    # each row at its median round by output throughput (the load figures do not vary)
    rows = [sorted(rs, key=lambda r: r.output_tok_s)[len(rs) // 2] for rs in runs.values()]
    quality_prompts = workload.prompts[: min(16, len(workload.prompts))]
    agreement, kl = teacher_forced_agreement(model, options, quality_prompts, threshold)
    w8_agreement, w8_kl = w8a16_agreement(model, options, quality_prompts, threshold)

    def pair(layout: str) -> tuple[Row, Row]:
        off = next(r for r in rows if r.layout == layout and not r.reroute)
        on = next(r for r in rows if r.layout == layout and r.reroute)
        return off, on

    top = rows[-1].layout
    off, on = pair(top)
    summary = {
        "layout": top,
        "threshold": threshold,
        "load_std_change": (on.load_std / off.load_std - 1) if off.load_std else None,
        "load_cv_change": (on.load_cv / off.load_cv - 1) if off.load_cv else None,
        "utilization_off": off.expert_utilization,
        "utilization_on": on.expert_utilization,
        "utilization_bound_within_top_k": on.utilization_bound,
        "throughput_gain": on.output_tok_s / off.output_tok_s - 1,
        "teacher_forced_agreement": agreement,
        "teacher_forced_kl": kl,
        "w8a16_agreement": w8_agreement,
        "w8a16_kl": w8_kl,
        "requests": len(workload.prompts),
        "rounds": rounds,
        "rounds_output_tok_s": {
            f"{r[0].layout} reroute {'on' if r[0].reroute else 'off'}": [x.output_tok_s for x in r]
            for r in runs.values()
        },
    }
    if args.json:
        print(
            json.dumps(
                {"machine": machine_info(), "rows": [asdict(r) for r in rows], "summary": summary},
                indent=2,
            )
        )
        return 0
    print(
        f"{'layout':<10}{'reroute':>8}{'out tok/s':>11}{'total tok/s':>12}{'load std':>9}"
        f"{'load CV':>9}"
        f"{'expert util':>12}{'rank util':>10}{'rerouted':>9}"
    )
    for r in rows:
        print(
            f"{r.layout:<10}{'on' if r.reroute else 'off':>8}{r.output_tok_s:>11.1f}"
            f"{r.total_tok_s:>12.1f}{r.load_std:>9.2f}{r.load_cv:>9.3f}"
            f"{r.expert_utilization:>12.3f}"
            f"{r.rank_utilization:>10.3f}{r.reroute_rate:>9.1%}"
        )
    change = summary["load_std_change"]
    print(
        f"{top}, reroute on vs off (loadThreshold {threshold}): expert load std "
        f"{'-' if change is None else f'{change:+.0%}'} (tokens per expert per layer-step), "
        f"utilization {off.expert_utilization:.0%} -> {on.expert_utilization:.0%} (no "
        f"assignment within the tokens' top-k and this capacity passes "
        f"{_pct(on.utilization_bound)}), output "
        f"throughput {summary['throughput_gain']:+.1%}; quality: teacher-forced agreement "
        f"{agreement:.1%}, KL {kl:.4f} nats/token over {len(quality_prompts)} prompts (for "
        f"scale, W8A16 vs float on the same prompts: {w8_agreement:.1%}, KL {w8_kl:.4f})"
    )
    if rounds > 1:
        print(f"(each row: the median of {rounds} alternating rounds)")
    print(machine_line())
    return 0
