"""What ``brook monitor`` shows, computed from successive frames: gauges from the latest
readings (summed or averaged over replicas), rates from the counters' growth between the
last two frames, latency quantiles from the histograms' growth over a rolling window — as
PromQL's ``rate`` and ``histogram_quantile`` would over the same span."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from brook_engine.metrics import names
from brook_operator.monitor.readings import Histogram, Reading

#: Length of each chart in frames.
SERIES_LENGTH = 120


@dataclass(frozen=True)
class Frame:
    """Everything one refresh read about one ``LLMInference``."""

    time: float
    resource: Mapping[str, Any] | None
    """The object as the API server returned it (None: a local server, no resource)."""
    readings: Mapping[str, Reading]
    """Each replica's engine metrics, by pod (or server) name."""
    errors: Mapping[str, str] = field(default_factory=dict)
    """Replicas whose metrics could not be read, and why."""


@dataclass(frozen=True)
class Figures:
    """One refresh's figures, over every replica that answered (None: not known yet)."""

    replicas_reporting: int
    kv_cache_usage: float | None
    waiting: float | None
    running: float | None
    overlap: float | None
    pipeline_bubble: float | None
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    requests_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    prefix_hit_rate: float | None
    window_seconds: float | None
    """The span the quantiles and the hit rate cover (None: since the engines started)."""
    kv_layer_dtypes: tuple[str, ...]
    kv_bytes_per_token: float | None
    device_memory: dict[str, float]
    offload_bytes: dict[str, float]
    offload_exposed_ratio: float | None
    compiled_graphs: float | None
    compile_hit_rate: float | None
    compile_failures: float | None
    cold_start: dict[str, float]
    model: dict[str, str]
    finished: dict[str, float] = field(default_factory=dict)
    """Requests ended since the engines started, by finish reason, over the replicas."""
    preemptions: float | None = None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sum(values: Sequence[float]) -> float | None:
    return sum(values) if values else None


def _gauges(readings: Mapping[str, Reading], name: str) -> list[float]:
    return [v for r in readings.values() if (v := r.value(name)) is not None]


def _growth(
    now: Mapping[str, Reading],
    before: Mapping[str, Reading],
    read: Callable[[Reading], float | None],
) -> float | None:
    """Summed growth of a counter over the replicas present in both frames (a replica whose
    counter went down restarted: its growth is its whole count)."""
    grown = []
    for pod, reading in now.items():
        value, earlier = read(reading), before.get(pod)
        old = read(earlier) if earlier is not None else None
        if value is None or old is None:
            continue
        grown.append(value - old if value >= old else value)
    return sum(grown) if grown else None


def _rate(
    now: Frame, earlier: Sequence[Frame], read: Callable[[Reading], float | None]
) -> float | None:
    """Per second, summed over the replicas: each replica's counter growth since its newest
    earlier reading taken at an earlier time. A Prometheus source repeats a scrape until the
    next one lands (every 15-60 s), so the time is the scrape's, not the refresh's."""
    rates = []
    for pod, reading in now.readings.items():
        value = read(reading)
        at = reading.time if reading.time is not None else now.time
        if value is None:
            continue
        for frame in reversed(earlier):
            old_reading = frame.readings.get(pod)
            if old_reading is None:
                continue
            then = old_reading.time if old_reading.time is not None else frame.time
            old = read(old_reading)
            if then < at and old is not None:
                rates.append((value - old if value >= old else value) / (at - then))
                break
    return sum(rates) if rates else None


def _histogram_growth(
    now: Mapping[str, Reading], before: Mapping[str, Reading] | None, name: str
) -> Histogram | None:
    """The histograms' growth since ``before``, merged over the replicas; a replica that
    ``before`` lacks started within the span and counts whole."""
    merged: Histogram | None = None
    for pod, reading in now.items():
        current = reading.histogram(name)
        if current is None:
            continue
        earlier = before.get(pod) if before is not None else None
        grown = current.minus(earlier.histogram(name) if earlier is not None else None)
        merged = grown if merged is None else merged.plus(grown)
    return merged


def _quantiles(histogram: Histogram | None) -> tuple[float | None, float | None]:
    if histogram is None:
        return None, None
    return histogram.quantile(0.5), histogram.quantile(0.99)


def _ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def _layer_dtypes(reading: Reading) -> tuple[str, ...]:
    by_layer = {
        int(dict(labels)["layer"]): dict(labels)["dtype"]
        for (name, labels), value in reading.samples.items()
        if name == names.KV_CACHE_LAYER_DTYPE and value == 1 and "layer" in dict(labels)
    }
    return tuple(by_layer[i] for i in sorted(by_layer))


def figures(
    now: Frame, earlier: Sequence[Frame], baseline: Frame | None, window_seconds: float | None
) -> Figures:
    """``now``'s figures: rates against the ``earlier`` frames (oldest first), quantiles and
    hit rate against ``baseline`` (None: since the engines started, which their counters
    cover)."""
    readings = now.readings

    def rate(read: Callable[[Reading], float | None]) -> float | None:
        return _rate(now, earlier, read)

    def windowed(read: Callable[[Reading], float | None]) -> float | None:
        if baseline is None:
            return _sum([v for r in readings.values() if (v := read(r)) is not None])
        return _growth(readings, baseline.readings, read)

    before = baseline.readings if baseline is not None else None
    ttft = _quantiles(_histogram_growth(readings, before, names.TIME_TO_FIRST_TOKEN_SECONDS))
    tpot = _quantiles(_histogram_growth(readings, before, names.TIME_PER_OUTPUT_TOKEN_SECONDS))
    first = next(iter(readings.values()), Reading())
    hits = windowed(lambda r: r.value(names.PREFIX_CACHE_HITS_TOTAL))
    queries = windowed(lambda r: r.value(names.PREFIX_CACHE_QUERIES_TOTAL))
    compile_hits = _sum(_gauges(readings, names.COMPILE_CACHE_HITS_TOTAL))
    compile_misses = _sum(_gauges(readings, names.COMPILE_CACHE_MISSES_TOTAL))
    transfer = _sum(_gauges(readings, names.OFFLOAD_TRANSFER_SECONDS_TOTAL))
    exposed = _sum(_gauges(readings, names.OFFLOAD_EXPOSED_SECONDS_TOTAL))
    return Figures(
        replicas_reporting=len(readings),
        kv_cache_usage=_mean(_gauges(readings, names.KV_CACHE_USAGE_RATIO)),
        waiting=_sum(_gauges(readings, names.NUM_REQUESTS_WAITING)),
        running=_sum(_gauges(readings, names.NUM_REQUESTS_RUNNING)),
        overlap=_mean(_gauges(readings, names.COMM_COMPUTE_OVERLAP_RATIO)),
        pipeline_bubble=_mean(_gauges(readings, names.PIPELINE_BUBBLE_RATIO)),
        generation_tokens_per_s=rate(lambda r: r.value(names.GENERATION_TOKENS_TOTAL)),
        prompt_tokens_per_s=rate(lambda r: r.value(names.PROMPT_TOKENS_TOTAL)),
        requests_per_s=rate(lambda r: r.total(names.REQUESTS_TOTAL)),
        ttft_p50=ttft[0],
        ttft_p99=ttft[1],
        tpot_p50=tpot[0],
        tpot_p99=tpot[1],
        prefix_hit_rate=_ratio(hits, queries),
        window_seconds=window_seconds if baseline is not None else None,
        kv_layer_dtypes=_layer_dtypes(first),
        kv_bytes_per_token=first.value(names.KV_CACHE_BYTES_PER_TOKEN),
        device_memory=first.by_label(names.DEVICE_MEMORY_BYTES, "kind"),
        offload_bytes=first.by_label(names.OFFLOAD_WEIGHT_BYTES, "where"),
        offload_exposed_ratio=_ratio(exposed, transfer),
        compiled_graphs=first.value(names.COMPILED_GRAPHS),
        compile_hit_rate=_ratio(compile_hits, (compile_hits or 0) + (compile_misses or 0)),
        compile_failures=_sum(_gauges(readings, names.COMPILE_FAILURES_TOTAL)),
        cold_start=first.by_label(names.COLD_START_SECONDS, "until"),
        model=first.labels(names.MODEL_INFO),
        finished=_by_reason(readings),
        preemptions=_sum(_gauges(readings, names.PREEMPTIONS_TOTAL)),
    )


def _by_reason(readings: Mapping[str, Reading]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for reading in readings.values():
        for reason, value in reading.by_label(names.REQUESTS_TOTAL, "finish_reason").items():
            totals[reason] = totals.get(reason, 0.0) + value
    return totals


@dataclass
class History:
    """The frames of one resource over the last ``window_seconds``, and each refresh's
    figures as series for the charts.

    The headline figures' quantiles and hit rate cover the window once it has been watched
    that long, and until then everything since the engines started (their counters' whole
    span: a one-shot table still shows latencies). A chart's point covers the
    ``chart_seconds`` before it (or as much of them as was watched), so it moves with load.
    """

    window_seconds: float = 300.0
    chart_seconds: float = 60.0
    frames: deque[Frame] = field(default_factory=deque)
    series: dict[str, deque[float | None]] = field(default_factory=dict)
    latest: Figures | None = None

    CHARTED = (
        "generation_tokens_per_s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "kv_cache_usage",
        "waiting",
        "running",
        "overlap",
    )
    #: Charted from the figures over ``chart_seconds`` rather than the headline window.
    WINDOWED = frozenset({"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"})

    def _baseline(self, now: float, seconds: float) -> Frame | None:
        """The newest frame at least ``seconds`` old, else the oldest before ``now``."""
        older = [f for f in self.frames if f.time < now]
        if not older:
            return None
        aged = [f for f in older if now - f.time >= seconds]
        return aged[-1] if aged else older[0]

    def add(self, frame: Frame) -> Figures:
        earlier = list(self.frames)
        self.frames.append(frame)
        keep = max(self.window_seconds, self.chart_seconds)
        while len(self.frames) > 2 and frame.time - self.frames[1].time >= keep:
            self.frames.popleft()
        filled = frame.time - self.frames[0].time >= self.window_seconds
        baseline = self._baseline(frame.time, self.window_seconds) if filled else None
        latest = figures(frame, earlier, baseline, self.window_seconds)
        chart_base = self._baseline(frame.time, self.chart_seconds)
        charted = figures(frame, earlier, chart_base, self.chart_seconds)
        for name in self.CHARTED:
            values = self.series.setdefault(name, deque(maxlen=SERIES_LENGTH))
            values.append(getattr(charted if name in self.WINDOWED else latest, name))
        self.latest = latest
        return latest
