"""``brook monitor``'s arithmetic: PromQL's ``histogram_quantile`` over bucket growth,
counter rates across replicas and restarts, the rolling window, the table and sparklines."""

from __future__ import annotations

import io
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from brook_engine.metrics import names
from brook_operator.monitor import formatting, table
from brook_operator.monitor.figures import Frame, History, figures
from brook_operator.monitor.readings import Histogram as Buckets
from brook_operator.monitor.readings import Reading, ReadingError

TTFT_BUCKETS = (0.1, 0.5, 1.0, 5.0)


def _exposition(
    ttft: list[float], generated: float, kv: float = 0.25, waiting: float = 0
) -> Reading:
    """A Brook engine's /metrics, as prometheus_client writes it."""
    registry = CollectorRegistry()
    Gauge(names.KV_CACHE_USAGE_RATIO, "kv", registry=registry).set(kv)
    Gauge(names.NUM_REQUESTS_WAITING, "w", registry=registry).set(waiting)
    Counter(names.GENERATION_TOKENS_TOTAL.removesuffix("_total"), "g", registry=registry).inc(
        generated
    )
    histogram = Histogram(
        names.TIME_TO_FIRST_TOKEN_SECONDS, "t", buckets=TTFT_BUCKETS, registry=registry
    )
    for value in ttft:
        histogram.observe(value)
    layers = Gauge(names.KV_CACHE_LAYER_DTYPE, "l", ["layer", "dtype"], registry=registry)
    for layer, dtype in enumerate(("fp8_e4m3", "fp8_e4m3", "bfloat16")):
        layers.labels(layer=str(layer), dtype=dtype).set(1)
    return Reading.parse(generate_latest(registry).decode())


def test_quantiles_follow_histogram_quantile() -> None:
    # 10 observations: 4 ≤ 0.1, 4 in (0.1, 0.5], 2 in (0.5, 1]
    buckets = Buckets(((0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (math.inf, 10.0)))
    assert buckets.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)  # rank 5
    assert buckets.quantile(0.99) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)
    assert buckets.quantile(0.2) == pytest.approx(0.1 * 2 / 4)  # first bucket from 0
    overflow = Buckets(((0.1, 1.0), (math.inf, 3.0)))
    assert overflow.quantile(0.99) == 0.1  # in +Inf: the largest finite bound
    assert Buckets(((0.1, 0.0), (math.inf, 0.0))).quantile(0.5) is None


def test_parsed_histogram_and_growth_since_an_earlier_reading() -> None:
    before = _exposition([0.05, 0.05], generated=10)
    after = _exposition([0.05, 0.05, 0.7, 0.7], generated=30)
    grown = after.histogram(names.TIME_TO_FIRST_TOKEN_SECONDS)
    assert grown is not None and grown.count == 4
    since = grown.minus(before.histogram(names.TIME_TO_FIRST_TOKEN_SECONDS))
    assert since.count == 2 and since.quantile(0.5) == pytest.approx(0.5 + 0.5 * 1 / 2)


def test_not_an_engine_is_refused() -> None:
    with pytest.raises(ReadingError, match="is this a Brook engine"):
        Reading.parse("some_metric 1\n")
    with pytest.raises(ReadingError, match="not Prometheus text"):
        Reading.parse("<html>login</html>\n")


def test_rates_sum_replicas_and_survive_a_restart() -> None:
    first = Frame(0.0, None, {"a": _exposition([], 100), "b": _exposition([], 50)})
    # a restarted (its counter fell to 20: all 20 are new); b generated 30 more
    second = Frame(2.0, None, {"a": _exposition([], 20), "b": _exposition([], 80)})
    result = figures(second, [first], None, None)
    assert result.generation_tokens_per_s == pytest.approx((20 + 30) / 2)
    assert result.replicas_reporting == 2
    assert result.kv_layer_dtypes == ("fp8_e4m3", "fp8_e4m3", "bfloat16")


def test_the_window_starts_at_the_engines_start_until_it_fills() -> None:
    history = History(window_seconds=10, chart_seconds=5)
    slow = [3.0] * 10
    history.add(Frame(0.0, None, {"a": _exposition(slow, 0)}))
    early = history.add(Frame(5.0, None, {"a": _exposition(slow, 0)}))
    assert early.window_seconds is None  # since the engines started: the slow requests count
    assert early.ttft_p50 is not None and early.ttft_p50 > 1.0
    fast = slow + [0.05] * 10
    late = history.add(Frame(12.0, None, {"a": _exposition(fast, 0)}))
    assert late.window_seconds == 10  # only what finished in the last 10 s
    assert late.ttft_p99 is not None and late.ttft_p99 <= 0.1
    # each chart point covers the 5 s before it: none finished in 0..5, only fast ones after
    first, nothing, recent = history.series["ttft_p99"]
    assert first is not None and first > 1.0  # the first frame: since the engines started
    assert nothing is None  # a gap in the chart
    assert recent is not None and recent <= 0.1


def test_table_and_cells() -> None:
    history = History()
    history.add(Frame(0.0, None, {"a": _exposition([0.05], 0, kv=0.5, waiting=3)}))
    latest = history.add(Frame(1.0, None, {"a": _exposition([0.05], 40, kv=0.5, waiting=3)}))
    resource = {"spec": {"replicas": 2}, "status": {"readyReplicas": 1, "desiredReplicas": 2}}
    text = table.render([table.row("tiny", resource, latest), table.row("idle", None, None)])
    header, tiny, idle = text.splitlines()
    assert header.split()[:3] == ["NAME", "READY", "KV"]
    assert tiny.split()[:6] == ["tiny", "1/2", "50%", "3", "-", "40"]
    assert idle.split()[:2] == ["idle", "0/1"] and set(idle.split()[2:]) == {"-"}
    assert formatting.seconds(0.0421) == "42ms" and formatting.seconds(2.5) == "2.50s"
    assert formatting.sparkline([0, 5, 10, None], 5) == " ▁▅█ "


def test_a_restart_is_judged_per_bucket() -> None:
    before = Buckets(((0.1, 10.0), (1.0, 10.0), (math.inf, 10.0)))
    # restarted, then 12 observations all slow: the total passed the old one, the first
    # bucket went down
    after = Buckets(((0.1, 0.0), (1.0, 12.0), (math.inf, 12.0)))
    assert after.minus(before) == after


def test_prometheus_rates_use_the_scrape_times() -> None:
    """Prometheus repeats a scrape until the next lands (30 s here) while the monitor
    refreshes every 2 s: the rate is the growth over the scrape interval, not 0 then 15x."""

    def reading(generated: float, scraped: float) -> Reading:
        samples = [
            ({"__name__": names.KV_CACHE_USAGE_RATIO}, 0.5),
            ({"__name__": names.GENERATION_TOKENS_TOTAL}, generated),
        ]
        return Reading.from_series(samples, scraped)

    history = History()
    rates = []
    for refresh in range(20):  # every 2 s; scrapes at 0 and 30 s: 600 tokens apart
        now = 1000.0 + 2 * refresh
        scraped = 1000.0 if now < 1030 else 1030.0
        generated = 0.0 if scraped == 1000 else 600.0
        rates.append(history.add(Frame(now, None, {"p": reading(generated, scraped)})))
    assert {f.generation_tokens_per_s for f in rates[:15]} == {None}  # one scrape so far
    assert [f.generation_tokens_per_s for f in rates[15:]] == [pytest.approx(20.0)] * 5


def test_a_failed_refresh_keeps_the_last_frame_and_says_why() -> None:
    from rich.console import Console

    from brook_operator.monitor import dashboard
    from brook_operator.monitor.sources import MonitorError

    reads = iter([Frame(0.0, None, {"a": _exposition([0.05], 10)})])

    def read() -> Frame:
        try:
            return next(reads)
        except StopIteration:
            raise MonitorError("default/tiny: the API server: 503 ServiceUnavailable") from None

    console = Console(record=True, width=130, height=40, file=io.StringIO())
    dashboard.run("default/tiny", read, History(), "pod proxy", 0.0, console, frames=2)
    screen = console.export_text()
    assert "the last refresh failed" in screen and "503 ServiceUnavailable" in screen
    assert "Throughput" in screen  # the last good frame, still drawn
