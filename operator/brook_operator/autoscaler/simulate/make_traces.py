"""The shipped traces, generated from a fixed seed: ``python -m
brook_operator.autoscaler.simulate.make_traces [--out DIR]`` rewrites
``autoscaler/traces/*.csv.gz`` byte for byte.

Each trace is one hour of Poisson arrivals (thinned from the peak rate, so the rate may vary
over time), sized so that the ``smollm2-135m-cpu`` profile needs a handful of replicas at
peak; ``daily-surge`` spans three days, for the predictive term. Lengths are log-normal and
clipped, chat-like: prompts of a few hundred tokens (median 384), answers of ~128 tokens;
the long prompts of ``long-prompt-burst`` are a few thousand tokens.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from brook_operator.autoscaler.simulate.trace import TRACES_DIR, Request, write_trace

HOUR = 3600.0
DAY = 24 * HOUR
SEED = 20240601


@dataclass(frozen=True)
class Lengths:
    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(self.high, max(self.low, round(value))))


CHAT_INPUT = Lengths(384, 0.8, 16, 2048)
CHAT_OUTPUT = Lengths(128, 0.7, 8, 768)
LONG_INPUT = Lengths(2500, 0.25, 1500, 4000)
LONG_OUTPUT = Lengths(128, 0.5, 16, 512)


def _arrivals(
    rng: random.Random, rate: Callable[[float], float], peak: float, start: float, end: float
) -> list[float]:
    """Poisson arrivals at ``rate(t)`` (≤ ``peak``) per second, by thinning."""
    out: list[float] = []
    t = start
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return out
        if rng.random() * peak < rate(t):
            out.append(t)


def _stream(
    rng: random.Random,
    rate: Callable[[float], float],
    peak: float,
    inputs: Lengths,
    outputs: Lengths,
    start: float = 0.0,
    end: float = HOUR,
) -> list[Request]:
    return [
        Request(round(t, 3), inputs.draw(rng), outputs.draw(rng))
        for t in _arrivals(rng, rate, peak, start, end)
    ]


def _merged(*streams: Sequence[Request]) -> list[Request]:
    return sorted((r for s in streams for r in s), key=lambda r: r.arrival_s)


def diurnal(rng: random.Random) -> list[Request]:
    """A day compressed into the hour: trough at both ends, peak at 30 min, peak/trough 4."""
    trough, peak = 0.9, 3.6

    def rate(t: float) -> float:
        return trough + (peak - trough) * (1 - math.cos(2 * math.pi * t / HOUR)) / 2

    return _stream(rng, rate, peak, CHAT_INPUT, CHAT_OUTPUT)


def spike(rng: random.Random) -> list[Request]:
    """A flat base and, from minute 25 to 35, four times that rate."""
    base = 0.9

    def rate(t: float) -> float:
        return 4 * base if 1500 <= t < 2100 else base

    return _stream(rng, rate, 4 * base, CHAT_INPUT, CHAT_OUTPUT)


def flat(rng: random.Random) -> list[Request]:
    """Constant-rate Poisson."""
    rate = 2.0
    return _stream(rng, lambda t: rate, rate, CHAT_INPUT, CHAT_OUTPUT)


def long_prompt_burst(rng: random.Random) -> list[Request]:
    """A chat base load and, from minute 25 to 35, prompts of a few thousand tokens that
    fill KV caches before queues build."""
    base, burst = 1.2, 0.5
    chat = _stream(rng, lambda t: base, base, CHAT_INPUT, CHAT_OUTPUT)
    long = _stream(rng, lambda t: burst, burst, LONG_INPUT, LONG_OUTPUT, 1500.0, 2100.0)
    return _merged(chat, long)


def daily_surge(rng: random.Random) -> list[Request]:
    """Three days. A day's load follows the sun (0.3 requests/s at 03:00, 1.2 at 15:00),
    and every morning a surge — a launch, a batch job, a team logging on — brings
    3.6 requests/s for 20 minutes from about 09:00: a fourfold step that recurs, a few
    minutes later or earlier each day."""
    night, day, surge = 0.3, 1.2, 3.6
    starts = [d * DAY + 9 * HOUR + rng.uniform(-300.0, 300.0) for d in range(3)]

    def rate(t: float) -> float:
        if any(s <= t < s + 1200.0 for s in starts):
            return surge
        phase = (t % DAY - 3 * HOUR) / DAY
        return night + (day - night) * (1 - math.cos(2 * math.pi * phase)) / 2

    return _stream(rng, rate, surge, CHAT_INPUT, CHAT_OUTPUT, end=3 * DAY)


TRACES: dict[str, Callable[[random.Random], list[Request]]] = {
    "diurnal": diurnal,
    "spike": spike,
    "flat": flat,
    "long-prompt-burst": long_prompt_burst,
    "daily-surge": daily_surge,
}


def make(name: str) -> list[Request]:
    """The trace ``name``, the same on every call (its own seeded generator)."""
    return TRACES[name](random.Random(f"{SEED}:{name}"))


def write_all(folder: Path = TRACES_DIR) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in TRACES:
        path = folder / f"{name}.csv.gz"
        write_trace(make(name), path)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=TRACES_DIR, help="folder to write to")
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
