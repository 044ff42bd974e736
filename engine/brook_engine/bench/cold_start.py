"""``brook-engine bench --workload cold-start``: how long a new replica takes to serve.

Each start is a fresh process (``python -m brook_engine.bench.cold_start``) that builds the
engine from the bench's options, generates one token, and reports the engine's own figures:
seconds from process start until ready and until the first generated token, and the
start-up's compile time. Three starts per round, in this order: eager; compile mode into an
empty ``shapes.cacheDir`` (compiling from scratch); compile mode again on the cache the
previous start filled (a replica starting on a warm volume). ``--rounds`` repeats them and
reports each start's median; the figures feed the autoscaler simulator's profiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from brook_engine.bench.machine import machine_line

STARTS = ("eager", "compile, empty cache", "compile, warm cache")


def bench_cold_start(args: argparse.Namespace, options: dict[str, Any]) -> int:
    shapes = {k: v for k, v in options.pop("shapes", {}).items() if k != "mode"}
    shapes.pop("cache_dir", None)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in STARTS}
    for index in range(max(1, args.rounds)):
        if not args.json:
            print(f"round {index + 1} of {max(1, args.rounds)}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="brook-cold-start-") as cache:
            compiled = {**shapes, "mode": "compile", "cache_dir": cache}
            for name, shape_options in zip(
                STARTS, ({"mode": "eager"}, compiled, compiled), strict=True
            ):
                rounds[name].append(_start(args.model, {**options, "shapes": shape_options}))
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }
    if args.json:
        print(json.dumps({"starts": medians, "rounds": rounds}, indent=2))
        return 0
    eager, scratch, warm = (medians[name] for name in STARTS)
    print("start | ready_s | first_token_s | compile_s")
    print("-" * 46)
    for name in STARTS:
        m = medians[name]
        print(f"{name} | {m['ready']:.1f} | {m['first_token']:.1f} | {m['compile']:.1f}")
    print(
        f"\nto first token, warm cache ÷ empty cache: "
        f"{warm['first_token'] / scratch['first_token']:.2f}; warm cache ÷ eager: "
        f"{warm['first_token'] / eager['first_token']:.2f} "
        f"(median of {max(1, args.rounds)} rounds, seconds from process start)"
    )
    print(machine_line())
    return 0


def _start(model: str, options: dict[str, Any]) -> dict[str, float]:
    """One fresh engine process; its cold-start figures."""
    command = [sys.executable, "-m", "brook_engine.bench.cold_start", model, json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a cold-start process failed:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _main() -> None:
    from brook_engine import LLM, SamplingParams

    model, options = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model, progress=False, **options)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    engine = llm.engine
    print(
        json.dumps(
            {
                "ready": engine.cold_start["ready"],
                "first_token": engine.cold_start["first_token"],
                "compile": engine.runner.compile_seconds,
            }
        )
    )


if __name__ == "__main__":
    _main()
