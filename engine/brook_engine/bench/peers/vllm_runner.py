# mypy: ignore-errors
"""vLLM's CPU build as a benchmark peer: ``LLM.generate`` on a peer workload.

    .venv-vllm/bin/python engine/brook_engine/bench/peers/vllm_runner.py --workload FILE

A standalone script for vLLM's own venv: it imports only the standard library, vllm, torch
and ``peer_protocol`` (the stdlib-only file beside it, shared with ``hf_runner``), never
brook_engine. "batch" hands every request to one ``LLM.generate`` call (vLLM's
continuous batching schedules them); "single" calls ``generate`` once per request. Prompts go
in as token ids (``TokensPrompt``) and no tokenizer is loaded (``skip_tokenizer_init``), so the
model folder needs no tokenizer and nothing is detokenized. The workload and result formats
are described in ``brook_engine/bench/peers/__init__.py``.

CPU settings, each taken from the environment when already set:
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache): 4.
- ``VLLM_CPU_OMP_THREADS_BIND``: the first ``threads`` CPUs this process may run on. vLLM's
  default "auto" reserves a core per rank for its scheduler process, which on a 2-core
  machine leaves the model a single thread.
- ``LD_PRELOAD``: the venv's Intel OpenMP (``libiomp5.so``), by re-executing the script.
- ``VLLM_LOGGING_STREAM``: stderr; stdout carries only the result line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

if __package__:  # imported as brook_engine.bench.peers.vllm_runner
    from brook_engine.bench.peers.peer_protocol import (
        machine_busy_ticks,
        other_cpu_frac,
        process_ticks,
        read_workload,
        result_fields,
        summary,
        workload_from_args,
    )
else:  # a plain script in vLLM's venv, without brook_engine: the module beside this file
    from peer_protocol import (
        machine_busy_ticks,
        other_cpu_frac,
        process_ticks,
        read_workload,
        result_fields,
        summary,
        workload_from_args,
    )

DEFAULT_KVCACHE_GIB = 4
_WARMUP_PROMPT = [1, 2, 3, 4]
_WARMUP_TOKENS = 2


def _log(message):
    print(f"[vllm-runner] {message}", file=sys.stderr, flush=True)


def preload_intel_openmp():
    """Re-exec this script with Intel OpenMP preloaded, as vLLM's CPU docs ask (vllm-cpu
    installs libiomp5.so into the venv): about 30 % faster decode than the libgomp fallback
    here. Skipped when an OpenMP runtime is already preloaded or BROOK_VLLM_IOMP=0."""
    preload = os.environ.get("LD_PRELOAD", "")
    if os.environ.get("BROOK_VLLM_IOMP") == "0" or any(
        name in preload for name in ("libiomp", "libgomp", "libomp")
    ):
        return
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not lib.is_file():
        _log(f"{lib} not found; vLLM falls back to torch's libgomp")
        return
    os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


def configure_cpu_env(threads):
    """Set vLLM's CPU knobs (before vllm is imported); an existing setting wins."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        _log(f"asked for {threads} threads but only {len(cpus)} CPUs are available")
    bind = cpus[:threads]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KVCACHE_GIB))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in bind))
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        _log(f"{name}={os.environ[name]}")


def _descendants(pid):
    """Process ids of every descendant of ``pid`` (read from /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _peak_rss_kib(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_ticks():
    """(ticks every CPU spent busy, ticks this process and its descendants spent)."""
    pids = [os.getpid(), *_descendants(os.getpid())]
    return machine_busy_ticks(), sum(process_ticks(p) for p in pids)


def peak_rss_mb():
    """Peak RSS of this process plus that of each live descendant (vLLM's engine core and
    worker are child processes), in MiB: an upper bound of the peak of their sum."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (own + sum(_peak_rss_kib(p) for p in _descendants(os.getpid()))) / 1024.0


def run(workload):
    configure_cpu_env(workload.threads)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = workload.prompts
    max_tokens = workload.max_tokens
    max_model_len = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    max_model_len = max(max_model_len, len(_WARMUP_PROMPT) + _WARMUP_TOKENS)

    _log(f"loading {workload.model} ({workload.dtype}, max_model_len {max_model_len})")
    load_started = time.perf_counter()
    llm = LLM(
        model=str(workload.model),
        dtype=workload.dtype,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        seed=0,
        disable_log_stats=False,  # RequestOutput.metrics (first-token latency) needs stats
    )

    def params(budget):
        return SamplingParams(
            max_tokens=budget,
            ignore_eos=workload.ignore_eos,
            temperature=0.0,
            detokenize=False,
        )

    llm.generate(
        [TokensPrompt(prompt_token_ids=_WARMUP_PROMPT)], params(_WARMUP_TOKENS), use_tqdm=False
    )
    load_s = time.perf_counter() - load_started
    _log(f"loaded and warmed up in {load_s:.2f} s; mode {workload.mode}")

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    sampling = [params(m) for m in max_tokens]
    ticks_before = _cpu_ticks()
    started = time.perf_counter()
    if workload.mode == "batch":
        outputs = llm.generate(requests, sampling, use_tqdm=False)
    else:
        outputs = []
        for request, sp in zip(requests, sampling, strict=True):
            outputs.extend(llm.generate([request], sp, use_tqdm=False))
    elapsed_s = time.perf_counter() - started
    ticks_after = _cpu_ticks()

    output_tokens = 0
    ttft_s = []
    for i, (out, budget) in enumerate(zip(outputs, max_tokens, strict=True)):
        got = len(out.outputs[0].token_ids)
        if workload.ignore_eos and got != budget:
            raise RuntimeError(f"request {i} got {got} tokens, expected {budget}")
        output_tokens += got
        metrics = getattr(out, "metrics", None)
        latency = getattr(metrics, "first_token_latency", None)
        ttft_s.append(float(latency) if latency else None)

    result = {
        **result_fields(
            "vllm",
            vllm.__version__,
            torch.__version__,
            workload,
            output_tokens=output_tokens,
            computed_output_tokens=output_tokens,
            elapsed_s=elapsed_s,
            load_s=load_s,
            ttft_s=ttft_s,
            peak_rss_mb=peak_rss_mb(),
            other_cpu_frac=other_cpu_frac(ticks_before, ticks_after, elapsed_s),
        ),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if workload.return_token_ids:
        result["token_ids"] = [list(out.outputs[0].token_ids) for out in outputs]
    del llm
    return result


def main(argv=None):
    path = workload_from_args("Run a peer workload on vLLM (CPU build).", argv)
    if argv is None:
        preload_intel_openmp()
    workload = read_workload(path)
    if workload is None:
        return 2
    # Everything vLLM and its child processes write to stdout goes to stderr; the original
    # stdout carries only the result line.
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    result = run(workload)
    _log(summary(result))
    with os.fdopen(result_fd, "w") as result_out:
        result_out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
