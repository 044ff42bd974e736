"""``brook-engine bench --workload parallel``: the same batch run through several replica
layouts on this host's cores, each core standing in for one device.

Rows: one process (one device); PP=2 one step at a time with 1, 2, 4 and 8 micro-batches
(asynchronous sends) and with 4 and blocking sends (the baseline asynchrony is measured
against); PP=2 with a step per stage in flight (the default) at 1, 2 and 4 micro-batches,
and at 4 with blocking sends; PP=2 left to the overlap monitor; TP. Per row:
throughput, the replica's overlap ratio (``parallel.overlap``), its measured bubble next to
GPipe's formula, and communication time by kind. Summary: PP=2 throughput over PP=1 and the
TP scaling efficiency, throughput / (TP × one-device throughput), at the smallest TP degree
the model's head counts allow (2 for most models, 3 for SmolLM2's 9 heads).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from brook_engine.bench.machine import machine_info, machine_line
from brook_engine.bench.run import run_engine
from brook_engine.bench.workload import Workload, random_workload_for
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.llm import engine_config_from_options
from brook_engine.parallel.overlap import Adaptation


@dataclass(frozen=True)
class Layout:
    name: str
    tensor: int = 1
    pipeline: int = 1
    micro_batches: int | None = None
    blocking: bool = False
    adaptive_from: int | None = None  # unpinned, the monitor starting from this many
    steps_in_flight: int | None = None  # None: the engine's default (the pipeline degree)


def tensor_degree(heads: int, kv_heads: int, intermediate: int) -> int:
    """The smallest tensor-parallel degree above 1 the model's shape allows."""
    for t in range(2, heads + 1):
        if heads % t == 0 and intermediate % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0):
            return t
    return 1


PP_LAYOUTS = (
    Layout("1 device"),
    Layout("PP=2 1 step m=1", pipeline=2, micro_batches=1, steps_in_flight=1),
    Layout("PP=2 1 step m=2", pipeline=2, micro_batches=2, steps_in_flight=1),
    Layout("PP=2 1 step m=4", pipeline=2, micro_batches=4, steps_in_flight=1),
    Layout("PP=2 1 step m=8", pipeline=2, micro_batches=8, steps_in_flight=1),
    Layout("PP=2 1 step m=4 blocking", pipeline=2, micro_batches=4, steps_in_flight=1,
           blocking=True),
    Layout("PP=2 m=1", pipeline=2, micro_batches=1),
    Layout("PP=2 m=2", pipeline=2, micro_batches=2),
    Layout("PP=2 m=4", pipeline=2, micro_batches=4),
    Layout("PP=2 m=4 blocking", pipeline=2, micro_batches=4, blocking=True),
    Layout("PP=2 adaptive from m=1", pipeline=2, adaptive_from=1),
)  # fmt: skip


@dataclass
class Row:
    layout: str
    total_tok_s: float
    output_tok_s: float
    elapsed_s: float
    overlap: float | None = None
    exposed_comm_s: float | None = None
    comm_s: dict[str, float] = field(default_factory=dict)
    bubble: float | None = None
    bubble_formula: float | None = None  # (p - 1) / (m + p - 1): share of the step idle
    bubble_over_compute_formula: float | None = None  # (p - 1) / m
    micro_batches: int | None = None


def _run_layout(
    layout: Layout, model: str, options: dict[str, Any], workload: Workload, per_device: int
) -> Row:
    parallel: dict[str, Any] = {"tensor": layout.tensor, "pipeline": layout.pipeline}
    if layout.micro_batches is not None:
        parallel["micro_batches"] = layout.micro_batches
    if layout.steps_in_flight is not None:
        parallel["steps_in_flight"] = layout.steps_in_flight
    config = engine_config_from_options(model, {**options, "parallel": parallel})
    world = layout.tensor * layout.pipeline
    torch.set_num_threads(per_device * world)  # rank 0 keeps its share; workers take theirs
    engine = LLMEngine(config, progress=False)
    try:
        runner = engine.runner
        if layout.adaptive_from is not None:
            ceiling = 8 * layout.pipeline if layout.pipeline > 1 else 2
            runner.micro_batches = Adaptation(layout.adaptive_from, ceiling)
        runner.blocking_sends = layout.blocking
        engine.warm_up()
        before = runner.flush_counters()
        report = run_engine(engine, workload, "batch", progress=False)
        row = Row(layout.name, report.total_tok_s, report.output_tok_s, report.elapsed_s)
        if engine.is_distributed:
            window = runner.flush_counters().minus(before)
            p = layout.pipeline
            m = runner.micro_batches.micro_batches
            row.overlap = window.overlap
            row.exposed_comm_s = window.comm_exposed
            row.comm_s = {k: v for k, v in window.by_kind.items() if v > 0}
            row.bubble = window.bubble(world)
            row.micro_batches = m
            if p > 1:
                row.bubble_formula = (p - 1) / (m + p - 1)
                row.bubble_over_compute_formula = (p - 1) / m
        return row
    finally:
        engine.shutdown()


def bench_parallel(args: Any, options: dict[str, Any]) -> int:
    options = {"device": "cpu", **options}
    probe = LLMEngine(engine_config_from_options(args.model, options), progress=False)
    arch = probe.arch
    tp = tensor_degree(arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    layouts = list(PP_LAYOUTS)
    if 1 < tp <= cores:
        layouts += [
            Layout(f"TP={tp} m=1", tensor=tp, micro_batches=1),
            Layout(f"TP={tp} m=2 interleaved", tensor=tp, micro_batches=2),
            Layout(f"TP={tp} adaptive from m=1", tensor=tp, adaptive_from=1),
        ]
    elif tp > cores and not args.json:
        print(f"TP skipped: this model needs TP={tp}, more than this host's {cores} cores")
    wanted = [w.strip().lower() for w in (args.layouts or "").split(",") if w.strip()]
    if wanted:  # one device always runs: the ratios are against it
        layouts = [lay for i, lay in enumerate(layouts) if i == 0 or lay.name.lower() in wanted]
    per_device = max(1, cores // 2)
    workload = random_workload_for(args, probe)
    del probe
    rows: list[Row] = []
    for layout in layouts:
        if not args.json:
            print(f"running {layout.name} ...", flush=True)
        rows.append(_run_layout(layout, args.model, options, workload, per_device))
    single = rows[0].total_tok_s

    def ratio(name: str, devices: int) -> float | None:
        row = next((r for r in rows if r.layout == name), None)
        return row.total_tok_s / (devices * single) if row else None

    def overlap(name: str) -> float | None:
        return next((r.overlap for r in rows if r.layout == name), None)

    summary = {
        "threads_per_device": per_device,
        "requests": len(workload.prompts),
        "pp2_over_one_device": ratio("PP=2 m=1", 1),
        "pp2_one_step_over_one_device": ratio("PP=2 1 step m=1", 1),
        "pp2_m4_over_one_device": ratio("PP=2 m=4", 1),
        "tensor_degree": tp,
        "tp_scaling_efficiency": ratio(f"TP={tp} m=1", tp),
        "tp_scaling_efficiency_interleaved": ratio(f"TP={tp} m=2 interleaved", tp),
        "overlap_async_m4": overlap("PP=2 m=4"),
        "overlap_blocking_m4": overlap("PP=2 m=4 blocking"),
        "overlap_async_m4_one_step": overlap("PP=2 1 step m=4"),
        "overlap_async_m8_one_step": overlap("PP=2 1 step m=8"),
    }
    if args.json:
        rows_out = [row.__dict__ for row in rows]
        out = {"machine": machine_info(), "rows": rows_out, "summary": summary}
        print(json.dumps(out, indent=2))
        return 0
    header = (
        f"{'layout':<26}{'total tok/s':>12}{'overlap':>9}{'exposed s':>10}{'bubble':>8}"
        f"{'(p-1)/(m+p-1)':>15}{'m':>4}  comm s by kind"
    )
    print(header)
    for r in rows:
        comm = ", ".join(f"{k} {v:.2f}" for k, v in r.comm_s.items())
        print(
            f"{r.layout:<26}{r.total_tok_s:>12.1f}{_f(r.overlap):>9}{_f(r.exposed_comm_s):>10}"
            f"{_f(r.bubble):>8}{_f(r.bubble_formula):>15}{r.micro_batches or '-':>4}  {comm}"
        )
    print(
        f"PP=2 / one device: {_f(summary['pp2_over_one_device'])}× (one step at a time "
        f"{_f(summary['pp2_one_step_over_one_device'])}×, m=4 "
        f"{_f(summary['pp2_m4_over_one_device'])}×); TP={tp} scaling "
        f"efficiency (throughput / ({tp} × one device)): "
        f"{_f(summary['tp_scaling_efficiency'])}, interleaved "
        f"{_f(summary['tp_scaling_efficiency_interleaved'])} ({per_device} thread(s) per device)"
    )
    print(machine_line())
    return 0


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
