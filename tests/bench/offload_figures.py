"""Weight offload figures: batch throughput (64 mixed-length requests, as in
docs/performance.md) and single-stream decode at several budgets against all-resident, with
the share of transfer time compute hid. A figure, not a test.

``python tests/bench/offload_figures.py [MODEL_DIR] [--budgets 100,75,50,42,25] [--rounds 3]
[--cold-cache]``

With ``--rounds N`` every budget runs once per round, the budgets in turn (so drift on a
shared host falls on all of them alike), and the medians are printed with each round's
figure. ``--cold-cache`` evicts each streamed piece's pages from the page cache after its
layer (``POSIX_FADV_DONTNEED``), so every use reads the disk: what a host whose memory cannot
keep the spill file in its page cache sees. It applies to CPU, where the file is mapped."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_engine.offload import tiers
from brook_engine.offload.plan import GIB
from brook_engine.offload.streamer import WeightStreamer


def _mixed(seed: int, vocab: int, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))])
        params.append(
            SamplingParams(temperature=0, max_tokens=rng.randint(16, 256), ignore_eos=True)
        )
    return prompts, params


@dataclass
class Figures:
    """One budget's figures, a value per round."""

    label: str
    weights_mib: float = 0.0
    streamed: int = 0
    batch: list[float] = field(default_factory=list)
    single: list[float] = field(default_factory=list)
    hidden_batch: list[float] = field(default_factory=list)
    hidden_single: list[float] = field(default_factory=list)
    transfer_seconds: list[float] = field(default_factory=list)
    refused: str = ""

    def line(self) -> str:
        if self.refused:
            return f"{self.label:>28}: refused: {self.refused}"

        def med(values: list[float], fmt: str) -> str:
            rounds = " / ".join(format(v, fmt) for v in values)
            middle = format(statistics.median(values), fmt)
            return middle + (f" ({rounds})" if len(values) > 1 else "")

        text = (
            f"{self.label:>28}: weights on device {self.weights_mib:.1f} MiB, {self.streamed} "
            f"pieces streamed; batch {med(self.batch, '.1f')} tok/s, single "
            f"{med(self.single, '.1f')} tok/s"
        )
        if self.hidden_batch:
            text += (
                f"; hidden {med(self.hidden_batch, '.2f')} batch / "
                f"{med(self.hidden_single, '.2f')} single "
                f"({statistics.median(self.transfer_seconds):.1f} s of batch transfers)"
            )
        return text


def _cold_cache() -> None:
    """Make every unmapped piece leave the page cache too (the next use reads the disk)."""
    drop = tiers.SpillMap.drop

    def drop_and_evict(self: tiers.SpillMap, key: int) -> None:
        drop(self, key)
        offset, nbytes = self.offsets[key]
        os.posix_fadvise(self.map_fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    tiers.SpillMap.drop = drop_and_evict  # type: ignore[method-assign]


def _run(model: str, dtype: str, requests: int, pct: int, total: int | None, row: Figures) -> int:
    offload: dict[str, object] = {"policy": "none"}
    if pct:
        assert total is not None
        offload = {"policy": "static", "device_memory_limit_gb": total * pct / 100 / GIB}
    try:
        llm = LLM(model, dtype=dtype, progress=False, offload=offload)
    except ConfigError as exc:  # a budget below the fixed weights and slots
        row.refused = str(exc)
        return total or 0
    try:
        runner = llm.engine.runner
        vocab = runner.arch.vocab_size
        prompts, params = _mixed(0, vocab, requests)
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        row.batch.append(
            sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
        )
        streamer = runner.model.streamer
        if not isinstance(streamer, WeightStreamer):
            streamer = None
        if streamer is not None:
            stats = streamer.snapshot()
            row.hidden_batch.append(stats.hidden_ratio)
            row.transfer_seconds.append(stats.transfer_seconds)
            streamer.reset_stats()
        single_params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        started = time.perf_counter()
        for prompt in prompts[:3]:
            llm.generate([prompt[:32]], single_params, use_tqdm=False)
        row.single.append(3 * 128 / (time.perf_counter() - started))
        if streamer is not None:
            row.hidden_single.append(streamer.snapshot().hidden_ratio)
        plan = runner.offload_plan
        row.streamed = len(plan.streamed) if plan is not None else 0
        row.weights_mib = runner.weight_bytes / 2**20
        return total if total is not None else int(runner.weight_bytes)
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--budgets", default="100,75,50,42,25")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's compute threads")
    parser.add_argument("--cold-cache", action="store_true", help="read streamed pieces from disk")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cold_cache:
        _cold_cache()
    budgets = [0, *(int(b) for b in args.budgets.split(","))]
    rows = {p: Figures(f"{p}%" if p else "all resident (policy none)") for p in budgets}
    total: int | None = None
    for turn in range(args.rounds):
        for pct in budgets:
            if not rows[pct].refused:
                total = _run(args.model, args.dtype, args.requests, pct, total, rows[pct])
            if turn == args.rounds - 1:
                print(rows[pct].line(), flush=True)


if __name__ == "__main__":
    main()
