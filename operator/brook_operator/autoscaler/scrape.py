"""Reading an engine's ``/metrics``: the three numbers the autoscaler decides on, parsed
with prometheus_client's own parser and looked up by the names the engine exports
(``brook_engine.metrics.names``, the one source of truth for them)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from brook_engine.metrics import names

#: Longest a scrape may take; a slow engine is reported stale, not waited for.
SCRAPE_TIMEOUT_SECONDS = 3.0
#: Largest /metrics body read (the engine's is a few tens of KiB).
MAX_BODY_BYTES = 4 * 1024 * 1024


class ScrapeError(Exception):
    """The endpoint did not answer, or its answer lacks what the autoscaler needs."""


@dataclass(frozen=True)
class EngineSample:
    kv_cache_usage: float
    waiting_requests: float
    overlap_ratio: float | None
    """None from an engine that does not export it (treated as 1: no communication)."""


def parse_metrics(text: str) -> EngineSample:
    """The autoscaler's inputs from a Prometheus text exposition."""
    wanted = {
        names.KV_CACHE_USAGE_RATIO,
        names.NUM_REQUESTS_WAITING,
        names.COMM_COMPUTE_OVERLAP_RATIO,
    }
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and sample.name not in values:
                    values[sample.name] = float(sample.value)
    except ValueError as exc:
        raise ScrapeError(f"unparsable metrics: {exc}") from None
    missing = sorted({names.KV_CACHE_USAGE_RATIO, names.NUM_REQUESTS_WAITING} - values.keys())
    if missing:
        raise ScrapeError(f"metrics lack {', '.join(missing)} (is this a Brook engine?)")
    kv = values[names.KV_CACHE_USAGE_RATIO]
    waiting = values[names.NUM_REQUESTS_WAITING]
    overlap = values.get(names.COMM_COMPUTE_OVERLAP_RATIO)
    if not 0.0 <= kv <= 1.0 or waiting < 0 or (overlap is not None and not 0.0 <= overlap <= 1):
        raise ScrapeError(f"metrics out of range: kv={kv} waiting={waiting} overlap={overlap}")
    return EngineSample(kv_cache_usage=kv, waiting_requests=waiting, overlap_ratio=overlap)


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> EngineSample:
    """GET ``url`` (an engine's /metrics) and parse it."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_BODY_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ScrapeError(f"{url}: {exc}") from None
    if len(body) > MAX_BODY_BYTES:
        raise ScrapeError(f"{url}: more than {MAX_BODY_BYTES} bytes of metrics")
    return parse_metrics(body.decode("utf-8", errors="replace"))


Scraper = Callable[[str], EngineSample]


def scrape_all(
    urls: Sequence[str], scraper: Scraper = scrape
) -> dict[str, EngineSample | ScrapeError]:
    """Every URL at once (a slow pod must not delay the others' samples)."""
    if not urls:
        return {}

    def one(url: str) -> EngineSample | ScrapeError:
        try:
            return scraper(url)
        except ScrapeError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return dict(zip(urls, pool.map(one, urls), strict=True))
