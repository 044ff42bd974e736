"""Weight offload figures: batch throughput (64 mixed-length requests, as in
docs/performance.md) and single-stream decode at several budgets against all-resident, with
the share of transfer time compute hid. A figure, not a test.

``python tests/bench/offload_figures.py [MODEL_DIR] [--budgets 100,75,50,42,25]``"""

from __future__ import annotations

import argparse
import random
import time

import torch

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_engine.offload.plan import GIB


def _mixed(seed: int, vocab: int, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))])
        params.append(
            SamplingParams(temperature=0, max_tokens=rng.randint(16, 256), ignore_eos=True)
        )
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--budgets", default="100,75,50,42,25")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's compute threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    total = None
    for pct in [0, *(int(b) for b in args.budgets.split(","))]:
        offload: dict[str, object] = {"policy": "none"}
        if pct:
            assert total is not None
            offload = {"policy": "static", "device_memory_limit_gb": total * pct / 100 / GIB}
        try:
            llm = LLM(args.model, dtype=args.dtype, progress=False, offload=offload)
        except ConfigError as exc:  # a budget below the fixed weights and slots
            print(f"{pct:>27}%: refused: {exc}", flush=True)
            continue
        runner = llm.engine.runner
        if total is None:
            total = runner.weight_bytes
        vocab = runner.arch.vocab_size
        prompts, params = _mixed(0, vocab, args.requests)
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        batch = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
        streamer = runner.model.streamer
        batch_stats = streamer.snapshot() if streamer is not None else None
        if streamer is not None:
            streamer.reset_stats()
        single_params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        started = time.perf_counter()
        for prompt in prompts[:3]:
            llm.generate([prompt[:32]], single_params, use_tqdm=False)
        single = 3 * 128 / (time.perf_counter() - started)
        single_stats = streamer.snapshot() if streamer is not None else None
        plan = runner.offload_plan
        streamed = len(plan.streamed) if plan is not None else 0
        hidden = (
            f"hidden {batch_stats.hidden_ratio:.2f} batch / {single_stats.hidden_ratio:.2f} "
            f"single ({batch_stats.transfer_seconds:.1f} s of transfers)"
            if batch_stats and single_stats
            else ""
        )
        label = f"{pct}%" if pct else "all resident (policy none)"
        print(
            f"{label:>28}: weights on device {runner.weight_bytes / 2**20:.1f} MiB, "
            f"{streamed} pieces streamed; batch {batch:.1f} tok/s, single {single:.1f} tok/s "
            f"{hidden}",
            flush=True,
        )
        llm.close()


if __name__ == "__main__":
    main()
