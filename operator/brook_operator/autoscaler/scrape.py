"""Reading an engine's ``/metrics``: the three numbers the autoscaler decides on, parsed
with prometheus_client's own parser and looked up by the names the engine exports
(``brook_engine.metrics.names``, the one source of truth for them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from brook_engine.metrics import names
from brook_operator.autoscaler.rates import DemandCounters
from brook_operator.pod_http import PodReadError, read_body

#: Longest a scrape may take; a slow engine is reported stale, not waited for.
SCRAPE_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class EngineSample:
    kv_cache_usage: float
    waiting_requests: float
    running_requests: float | None
    overlap_ratio: float | None
    """None from an engine that does not export it (treated as 1: no communication)."""

    demand: DemandCounters | None = None
    """The demand counters; None from an engine without them (no arrival signal)."""


def parse_metrics(text: str) -> EngineSample:
    """The autoscaler's inputs from a Prometheus text exposition."""
    wanted = {
        names.KV_CACHE_USAGE_RATIO,
        names.NUM_REQUESTS_WAITING,
        names.NUM_REQUESTS_RUNNING,
        names.COMM_COMPUTE_OVERLAP_RATIO,
        names.PROMPT_TOKENS_TOTAL,
        names.GENERATION_TOKENS_TOTAL,
        names.REFUSED_PROMPT_TOKENS_TOTAL,
    }
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and sample.name not in values:
                    values[sample.name] = float(sample.value)
    except ValueError as exc:
        raise PodReadError(f"unparsable metrics: {exc}") from None
    missing = sorted({names.KV_CACHE_USAGE_RATIO, names.NUM_REQUESTS_WAITING} - values.keys())
    if missing:
        raise PodReadError(f"metrics lack {', '.join(missing)} (is this a Brook engine?)")
    kv = values[names.KV_CACHE_USAGE_RATIO]
    waiting = values[names.NUM_REQUESTS_WAITING]
    running = values.get(names.NUM_REQUESTS_RUNNING)
    overlap = values.get(names.COMM_COMPUTE_OVERLAP_RATIO)
    prompt = values.get(names.PROMPT_TOKENS_TOTAL)
    generated = values.get(names.GENERATION_TOKENS_TOTAL)
    # NaN and ±Inf are valid in the exposition format and pass every comparison below
    # (NaN < 0 is False): a pod reporting them has no usable sample, it is stale.
    bad = sorted(k for k, v in values.items() if not math.isfinite(v))
    if bad:
        raise PodReadError(f"metrics not finite: {', '.join(f'{k}={values[k]}' for k in bad)}")
    if (
        not 0.0 <= kv <= 1.0
        or waiting < 0
        or (running is not None and running < 0)
        or (overlap is not None and not 0.0 <= overlap <= 1)
        or any(v < 0 for v in (prompt, generated) if v is not None)
    ):
        raise PodReadError(
            f"metrics out of range: kv={kv} waiting={waiting} running={running} "
            f"overlap={overlap} prompt_tokens={prompt} generation_tokens={generated}"
        )
    demand = None
    if prompt is not None and generated is not None:
        refused = max(0.0, values.get(names.REFUSED_PROMPT_TOKENS_TOTAL, 0.0))
        demand = DemandCounters(prompt, generated, refused)
    return EngineSample(
        kv_cache_usage=kv,
        waiting_requests=waiting,
        running_requests=running,
        overlap_ratio=overlap,
        demand=demand,
    )


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> EngineSample:
    """GET ``url`` (an engine's /metrics) and parse it."""
    return parse_metrics(read_body(url, timeout, "text/plain"))


Scraper = Callable[[str], EngineSample]


def scrape_all(
    urls: Sequence[str], scraper: Scraper = scrape
) -> dict[str, EngineSample | PodReadError]:
    """Every URL at once (a slow pod must not delay the others' samples)."""
    if not urls:
        return {}

    def one(url: str) -> EngineSample | PodReadError:
        try:
            return scraper(url)
        except PodReadError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return dict(zip(urls, pool.map(one, urls), strict=True))
