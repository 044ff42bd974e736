"""``brook-engine bench``: build the workload, run Brook, optionally the peers on the very same
prompts, and print one table (or JSON)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from brook_engine.bench.gemm import measure_gemm_flops
from brook_engine.bench.machine import (
    machine_info,
    machine_line,
    model_parameters,
    model_product_rate,
)
from brook_engine.bench.run import BenchReport, run_engine
from brook_engine.bench.workload import Workload, random_workload_for
from brook_engine.config import EngineConfig
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.llm import engine_config_from_options

_COLUMNS = (
    ("engine", "{}"),
    ("output_tok_s", "{:.1f}"),
    ("total_tok_s", "{:.1f}"),
    ("ttft_p50_s", "{:.3f}"),
    ("ttft_p99_s", "{:.3f}"),
    ("tpot_p50_s", "{:.4f}"),
    ("tpot_p99_s", "{:.4f}"),
    ("peak_rss_mb", "{:.0f}"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def bench(args: argparse.Namespace, options: dict[str, Any]) -> int:
    if args.quantized is not None and args.workload != "w8a16-quality":
        print("error: --quantized applies to --workload w8a16-quality", file=sys.stderr)
        return 2
    if args.workload == "cold-start":
        from brook_engine.bench.cold_start import bench_cold_start

        return bench_cold_start(args, options)
    if args.workload == "moe":
        from brook_engine.bench.moe_routing import bench_moe

        return bench_moe(args, options)
    if args.workload == "parallel":
        from brook_engine.bench.parallel_layouts import bench_parallel

        return bench_parallel(args, options)
    if args.workload != "random":
        return _bench_kv(args, options)
    if args.mode == "serve":
        served_peers = {p.strip() for p in args.compare.split(",") if p.strip()}
        if served_peers - {"vllm"}:
            print("error: --mode serve compares with vllm only", file=sys.stderr)
            return 2
        if served_peers:
            from brook_engine.bench.served_compare import compare_served

            return compare_served(args, served_config(args, options))
        return _bench_serving(args, served_config(args, options))
    rounds = args.rounds
    if rounds < 1:
        print(f"error: --rounds {rounds}: use 1 or more", file=sys.stderr)
        return 2
    peers = [p.strip() for p in args.compare.split(",") if p.strip()]
    if peers:
        from brook_engine.bench.peers.setup_vllm import PeerError, ensure_vllm_venv, run_peer
    runs: dict[str, list[BenchReport]] = {"brook": []}
    failed: set[str] = set()
    for index in range(rounds):
        if rounds > 1 and not args.json:
            print(f"round {index + 1} of {rounds}", file=sys.stderr)
        report, workload = _brook_round(args, options)
        runs["brook"].append(report)
        if peers:
            spec = {
                "model": str(Path(args.model).resolve()),
                "dtype": report.extra["dtype"],
                "threads": torch.get_num_threads(),
                "prompts": workload.prompts,
                "max_tokens": workload.max_tokens,
                "ignore_eos": True,
                "mode": args.mode,
            }
            for peer in peers:
                if peer in failed:
                    continue
                try:
                    python = ensure_vllm_venv() if peer == "vllm" else Path(sys.executable)
                    result = run_peer(peer, spec, python=python, env=_uncapped_env())
                    peer_report = _peer_report(result, args.mode)
                    runs.setdefault(peer, []).append(peer_report)
                except PeerError as exc:
                    failed.add(peer)
                    print(f"peer {peer} failed: {exc}", file=sys.stderr)
    _print([median_round(r) for r in runs.values()], args.json)
    return 1 if failed else 0


# Variables that make this CPU run smaller vector paths (BROOK_CPU_ISA for Brook's kernels,
# the others for oneDNN's and ATen's): Brook runs under them, the peers never do — vLLM's
# BF16 path aborts without AVX-512 — so a capped comparison is one against the peers at
# their best.
CPU_CAP_VARIABLES = ("BROOK_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def _uncapped_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CPU_CAP_VARIABLES}


def _caps_line() -> str | None:
    caps = [f"{k}={os.environ[k]}" for k in CPU_CAP_VARIABLES if os.environ.get(k)]
    if not caps:
        return None
    return f"Brook ran capped ({', '.join(caps)}); the peers ran without the caps"


def _brook_round(args: argparse.Namespace, options: dict[str, Any]) -> tuple[BenchReport, Workload]:
    """One run of Brook's engine on the workload (the same prompts every round: seeded); the
    engine is freed before the peers run."""
    config = engine_config_from_options(args.model, options)
    engine = LLMEngine(config, progress=not args.json)
    workload = random_workload_for(args, engine)
    report = run_engine(engine, workload, args.mode, progress=not args.json)
    gemm = measure_gemm_flops(dtype=engine.runner.dtype)
    # The stable denominator: the model's own products at the decode batch the workload
    # runs at, measured now (the large-GEMM figure drifts with what the kernel keeps in cache).
    rows = 1 if args.mode == "single" else min(len(workload.prompts), config.scheduler.max_num_seqs)
    products = model_product_rate(engine.runner.model, rows, engine.runner.dtype)
    params = model_parameters(engine.runner.model)
    tokens = report.prompt_tokens + report.output_tokens
    report.mfu = 2 * params * tokens / report.elapsed_s / gemm
    report.extra.update(
        gemm_gflops=gemm / 1e9,
        parameters=params,
        threads=torch.get_num_threads(),
        products_gflops=products / 1e9,
        products_rows=rows,
        mfu_products=2 * params * tokens / report.elapsed_s / products,
    )
    report.extra["dtype"] = str(engine.runner.dtype).removeprefix("torch.")
    return report, workload


def median_round(reports: list[BenchReport]) -> BenchReport:
    """The round with the median output tokens/s (the lower of the two middle ones for an
    even count), its ``extra`` listing every round's figure: a shared host's speed drifts
    between runs, and rounds that alternate the engines see the same drift."""
    ordered = sorted(reports, key=lambda r: r.output_tok_s)
    middle = ordered[(len(ordered) - 1) // 2]
    middle.extra["rounds_output_tok_s"] = [round(r.output_tok_s, 2) for r in reports]
    return middle


def _bench_kv(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from brook_engine.bench import kv_workloads, quant_workloads

    run = {
        "shared-prefix": kv_workloads.shared_prefix,
        "zipf-prefix": kv_workloads.zipf_prefix,
        "long-context": kv_workloads.long_context,
        "w8a16-quality": quant_workloads.w8a16_quality,
    }[args.workload]
    if args.quantized is not None:
        run = functools.partial(quant_workloads.w8a16_quality, quantized=args.quantized)
    result = run(args.model, options, args.num_requests, args.seed, not args.json)
    if args.json:
        out = {
            "machine": machine_info(),
            "reports": [r.as_dict() for r in result.reports],
            "summary": result.summary,
        }
        print(json.dumps(out, indent=2, default=str))
        return 0
    if result.reports:
        columns = (*_COLUMNS, ("peak_kv_mb", "{:.1f}"), ("prefix_hit_rate", "{:.1%}"))
        header = " | ".join(name for name, _ in columns)
        print(header)
        print("-" * len(header))
        for r in result.reports:
            values = {**r.as_dict(), **r.extra}
            print(" | ".join(_cell(values.get(name), fmt) for name, fmt in columns))
        print()
    for key, value in result.summary.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    print(machine_line())
    return 0


def served_config(args: argparse.Namespace, options: dict[str, Any]) -> EngineConfig:
    """The engine configuration ``--mode serve`` runs: every engine flag the bench was given,
    ``--max-num-seqs`` as ``--concurrency`` unless it is given too, and what a server takes
    where they leave a choice (on CPU a smaller token budget: ``serving_defaults``)."""
    from brook_engine.core.serving_defaults import serving_defaults

    if "max_num_seqs" not in options:
        options = {**options, "max_num_seqs": args.concurrency}
    return serving_defaults(engine_config_from_options(args.model, options))


def _bench_serving(args: argparse.Namespace, config: EngineConfig) -> int:
    """Offline API and HTTP server, both at ``--concurrency`` requests at a time."""
    from brook_engine.bench.serving import run_http

    engine = LLMEngine(config, progress=not args.json)
    workload = random_workload_for(args, engine)
    offline = run_engine(engine, workload, "batch", progress=not args.json)
    offline.engine, offline.mode = "brook (offline)", f"batch×{args.concurrency}"
    del engine
    http = run_http(config, workload, args.concurrency, progress=not args.json)
    overhead = 1 - http.output_tok_s / offline.output_tok_s
    if args.json:
        out = {
            "machine": machine_info(),
            "offline": offline.as_dict(),
            "http": http.as_dict(),
            "overhead": overhead,
        }
        print(json.dumps(out, indent=2, default=str))
        return 0
    header = " | ".join(name for name, _ in _COLUMNS)
    print(header)
    print("-" * len(header))
    for r in (offline, http):
        print(" | ".join(_cell(getattr(r, name), fmt) for name, fmt in _COLUMNS))
    print(
        f"\n{http.requests} requests at {args.concurrency} at a time; serving overhead "
        f"{overhead:.1%} (1 - HTTP output tok/s ÷ offline output tok/s)"
    )
    print(machine_line())
    return 0


def _peer_report(result: dict[str, Any], mode: str) -> BenchReport:
    return BenchReport.measured(
        str(result["engine"]),
        mode,
        requests=int(result["requests"]),
        prompt_tokens=int(result["prompt_tokens"]),
        output_tokens=int(result.get("useful_output_tokens") or result["output_tokens"]),
        elapsed_s=float(result["elapsed_s"]),
        ttft=[t for t in (result.get("ttft_s") or []) if t is not None],
        peak_rss_mb=float(result.get("peak_rss_mb") or 0),
        extra={"version": result.get("version"), "raw": result},
    )


def _print(reports: list[BenchReport], as_json: bool) -> None:
    brook = reports[0]
    if as_json:
        out = {
            "machine": machine_info(),
            "peers_uncapped": _caps_line() is not None and len(reports) > 1,
            "brook": brook.as_dict(),
            "peers": [r.as_dict() for r in reports[1:]],
        }
        out["ratios"] = {
            r.engine: {"output_tok_s": brook.output_tok_s / r.output_tok_s} for r in reports[1:]
        }
        print(json.dumps(out, indent=2, default=str))
        return
    header = " | ".join(name for name, _ in _COLUMNS) + " | brook ÷ peer"
    print(header)
    print("-" * len(header))
    for r in reports:
        cells = [_cell(getattr(r, name), fmt) for name, fmt in _COLUMNS]
        ratio = "" if r is brook else f"{brook.output_tok_s / r.output_tok_s:.2f}×"
        print(" | ".join(cells) + f" | {ratio}")
    rounds = brook.extra.get("rounds_output_tok_s", [])
    if len(rounds) > 1:
        per_engine = "; ".join(
            f"{r.engine} " + " / ".join(f"{x:.1f}" for x in r.extra["rounds_output_tok_s"])
            for r in reports
        )
        print(f"\nmedian of {len(rounds)} rounds (output tok/s per round: {per_engine})", end="")
    print(
        f"\n{brook.requests} requests, {brook.prompt_tokens} prompt + {brook.output_tokens} "
        f"output tokens in {brook.elapsed_s:.1f} s; MFU {brook.mfu:.2f} "
        f"(2 × {brook.extra['parameters'] / 1e6:.1f} M params × tokens / "
        f"{brook.extra['gemm_gflops']:.1f} GFLOP/s measured GEMM); MFU "
        f"{brook.extra['mfu_products']:.2f} of the model's own products at "
        f"{brook.extra['products_rows']} rows ({brook.extra['products_gflops']:.1f} GFLOP/s, "
        f"measured after the run); preemptions {brook.extra['preemptions']}"
    )
    offload = brook.extra.get("offload")
    if offload:
        print(
            f"weight offload: {offload['weights_device_mb']:.1f} MiB of weights on the device, "
            f"{offload['streamed_mb']:.1f} MiB streamed; {offload['transfer_s']:.2f} s of "
            f"transfers, {offload['hidden_ratio']:.0%} hidden behind compute; "
            f"{offload['plan_changes']} plan changes"
        )
    compiled = brook.extra.get("compile")
    if compiled:
        print(
            f"compile mode: {compiled['hit_rate']:.1%} of steps ran a compiled graph "
            f"({compiled['hits']} of {compiled['hits'] + compiled['misses']}); "
            f"{compiled['graphs']} graphs held {compiled['buckets']}, "
            f"{compiled['evictions']} evicted; start-up compile "
            f"{compiled['startup_compile_s']:.1f} s, online {compiled['online_compile_s']:.1f} s"
        )
    print(machine_line())
    caps = _caps_line()
    if caps is not None and len(reports) > 1:
        print(caps)
